//! The JSON Schemas a tool shows the model, derived from its Rust argument and output
//! types: without the `$schema` meta key, without `title`s (type names the model does not
//! need) and without numeric `format`s (`double`, `uint32`, ...), and with unknown
//! arguments refused unless the tool opts out. Meaningful formats (`date-time`, `uri`,
//! ...) are kept. This module only shapes schemas; it never validates values.

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
