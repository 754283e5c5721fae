//! The JSON Schemas a tool shows the model, derived from its Rust argument and output
//! types: without the `$schema` meta key, without `title`s (type names the model does not
//! need) and without numeric `format`s (`double`, `uint32`, ...), and with unknown
//! arguments refused unless the tool opts out. Meaningful formats (`date-time`, `uri`,
//! ...) are kept. It shapes schemas, and checks arguments against an input schema for
//! [`Tool::call`](crate::Tool::call) (the coordinator validates every call in full).

use serde_json::Value;

/// Keys whose value is a map from names to schemas (not a schema itself).
const SCHEMA_MAPS: [&str; 4] = ["properties", "$defs", "definitions", "patternProperties"];

/// Formats that only restate a Rust number type.
const NUMERIC_FORMATS: [&str; 12] = [
    "int", "int8", "int16", "int32", "int64", "uint", "uint8", "uint16", "uint32", "uint64",
    "float", "double",
];

/// The JSON Schema of `A`, cleaned of noise (see the module header).
pub fn schema_of<A: schemars::JsonSchema>() -> Value {
    let mut value = serde_json::to_value(schemars::schema_for!(A)).unwrap_or(Value::Null);
    if let Some(obj) = value.as_object_mut() {
        obj.remove("$schema");
    }
    clean(&mut value);
    value
}

/// The input schema of arguments of type `A`: [`schema_of`], and an object schema that
/// names its properties refuses others unless `allow_unknown`.
pub fn input_schema_of<A: schemars::JsonSchema>(allow_unknown: bool) -> Value {
    let mut value = schema_of::<A>();
    if let Some(obj) = value.as_object_mut() {
        let is_object = obj.get("type") == Some(&Value::String("object".into()));
        if !allow_unknown && is_object && !obj.contains_key("additionalProperties") {
            obj.insert("additionalProperties".into(), Value::Bool(false));
        }
    }
    value
}

/// Whether `schema` is the schema of `()` (`{"type": "null"}`): a tool without arguments.
pub(crate) fn is_unit(schema: &Value) -> bool {
    schema.get("type").and_then(Value::as_str) == Some("null")
        && schema.as_object().is_some_and(|o| o.len() == 1)
}

/// The input schema of a tool without arguments: the empty object (`{}` and a call
/// without arguments pass, any named argument is refused unless `allow_unknown`).
pub(crate) fn no_arguments(allow_unknown: bool) -> Value {
    let mut schema = serde_json::json!({"type": "object", "properties": {}});
    if !allow_unknown {
        schema["additionalProperties"] = Value::Bool(false);
    }
    schema
}

/// The JSON type named in an input schema's `type` when it is not `object`: arguments
/// are always a JSON object, so such a tool could never be called.
pub fn non_object_type(schema: &Value) -> Option<&str> {
    schema
        .get("type")
        .and_then(Value::as_str)
        .filter(|t| *t != "object")
}

/// Checks `value` against `schema` for what the coordinator's validator refuses most:
/// `type`, `required`, `properties` and `additionalProperties: false`, `enum` and
/// `const`, numeric ranges, string lengths, `items`, `anyOf`/`oneOf`/`allOf` and local
/// `$ref`s (`#/$defs/..`). `pattern` and `format` are left to the coordinator. The
/// reason names the first failing place.
pub fn check_arguments(schema: &Value, value: &Value) -> Result<(), String> {
    check(schema, schema, value, "").map_err(|reason| {
        if reason.starts_with('/') || reason.is_empty() {
            format!("arguments{reason}")
        } else {
            format!("arguments: {reason}")
        }
    })
}

fn type_matches(name: &str, value: &Value) -> bool {
    match name {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        "number" => value.is_number(),
        "integer" => {
            value.is_i64() || value.is_u64() || value.as_f64().is_some_and(|f| f.fract() == 0.0)
        }
        _ => true,
    }
}

fn check(root: &Value, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    let Some(obj) = schema.as_object() else {
        return match schema {
            Value::Bool(false) => Err(format!("{at}: not allowed")),
            _ => Ok(()),
        };
    };
    if let Some(reference) = obj.get("$ref").and_then(Value::as_str) {
        let target = reference
            .strip_prefix('#')
            .and_then(|pointer| root.pointer(pointer))
            .ok_or_else(|| format!("{at}: unresolved $ref {reference}"))?;
        check(root, target, value, at)?;
    }
    match obj.get("type") {
        Some(Value::String(t)) if !type_matches(t, value) => {
            return Err(format!("{at}: {value} is not of type {t:?}"));
        }
        Some(Value::Array(types))
            if !types
                .iter()
                .filter_map(Value::as_str)
                .any(|t| type_matches(t, value)) =>
        {
            return Err(format!(
                "{at}: {value} is not of the types {}",
                Value::Array(types.clone())
            ));
        }
        _ => {}
    }
    if let Some(Value::Array(allowed)) = obj.get("enum") {
        if !allowed.contains(value) {
            return Err(format!(
                "{at}: {value} is not one of {}",
                Value::Array(allowed.clone())
            ));
        }
    }
    if let Some(constant) = obj.get("const") {
        if constant != value {
            return Err(format!("{at}: {value} is not {constant}"));
        }
    }
    if let Some(n) = value.as_f64() {
        let bound = |key: &str| obj.get(key).and_then(Value::as_f64);
        let out = bound("minimum").is_some_and(|m| n < m)
            || bound("maximum").is_some_and(|m| n > m)
            || bound("exclusiveMinimum").is_some_and(|m| n <= m)
            || bound("exclusiveMaximum").is_some_and(|m| n >= m);
        if out {
            return Err(format!("{at}: {value} is out of range"));
        }
    }
    if let Some(text) = value.as_str() {
        let chars = u64::try_from(text.chars().count()).unwrap_or(u64::MAX);
        let len = |key: &str| obj.get(key).and_then(Value::as_u64);
        if len("minLength").is_some_and(|m| chars < m)
            || len("maxLength").is_some_and(|m| chars > m)
        {
            return Err(format!("{at}: {value} has a length out of range"));
        }
    }
    if let (Some(items), Some(list)) = (obj.get("items"), value.as_array()) {
        for (i, item) in list.iter().enumerate() {
            check(root, items, item, &format!("{at}/{i}"))?;
        }
    }
    if let Some(map) = value.as_object() {
        let properties = obj.get("properties").and_then(Value::as_object);
        if let Some(Value::Array(required)) = obj.get("required") {
            if let Some(missing) = required
                .iter()
                .filter_map(Value::as_str)
                .find(|name| !map.contains_key(*name))
            {
                return Err(format!("{at}: {missing:?} is a required property"));
            }
        }
        for (name, item) in map {
            let path = format!("{at}/{name}");
            match properties.and_then(|p| p.get(name)) {
                Some(property) => check(root, property, item, &path)?,
                None => match obj.get("additionalProperties") {
                    Some(Value::Bool(false)) => {
                        return Err(format!("{at}: unknown argument {name:?}"));
                    }
                    Some(extra) => check(root, extra, item, &path)?,
                    None => {}
                },
            }
        }
    }
    if let Some(Value::Array(all)) = obj.get("allOf") {
        for sub in all {
            check(root, sub, value, at)?;
        }
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(any)) = obj.get(key) {
            if !any.iter().any(|sub| check(root, sub, value, at).is_ok()) {
                return Err(format!("{at}: {value} matches none of {key}"));
            }
        }
    }
    Ok(())
}

/// Removes `title` and numeric `format` from `schema` and every schema inside it.
fn clean(schema: &mut Value) {
    match schema {
        Value::Object(obj) => {
            obj.remove("title");
            let numeric = obj
                .get("format")
                .and_then(Value::as_str)
                .is_some_and(|f| NUMERIC_FORMATS.contains(&f));
            if numeric {
                obj.remove("format");
            }
            for (key, value) in obj.iter_mut() {
                match value {
                    Value::Object(map) if SCHEMA_MAPS.contains(&key.as_str()) => {
                        map.values_mut().for_each(clean);
                    }
                    _ => clean(value),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(clean),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(schemars::JsonSchema)]
    #[allow(dead_code)]
    struct Inner {
        /// A property named like a keyword stays.
        title: String,
        at: Option<f32>,
    }

    #[derive(schemars::JsonSchema)]
    #[allow(dead_code)]
    struct Args {
        celsius: f64,
        count: u32,
        inner: Inner,
        list: Vec<Inner>,
    }

    #[test]
    fn schemas_carry_no_titles_nor_numeric_formats() {
        let schema = input_schema_of::<Args>(false);
        let text = schema.to_string();
        assert!(!text.contains("\"format\""), "{text}");
        assert!(schema.get("title").is_none(), "{text}");
        assert_eq!(schema["properties"]["celsius"], json!({"type": "number"}));
        assert_eq!(
            schema["$defs"]["Inner"]["properties"]["title"]["type"],
            json!("string"),
            "a property named title is kept: {text}"
        );
        assert!(schema["$defs"]["Inner"].get("title").is_none(), "{text}");
    }

    #[test]
    fn unknown_arguments_are_refused_unless_allowed() {
        assert_eq!(
            input_schema_of::<Args>(false)["additionalProperties"],
            json!(false)
        );
        assert!(input_schema_of::<Args>(true)
            .get("additionalProperties")
            .is_none());
    }
}
