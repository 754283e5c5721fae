//! A tool's results checked against its output schema before they are published
//! (`invalid_result`), with the feature `output-schema` (on by default). Without it the
//! JSON Schema validator is not built and every result passes: the coordinator never
//! checks results, so a tool crate that drops the feature trusts its own types.
//! Owns compiling the schema and naming a violation; never builds a result.

use serde_json::Value;

/// A compiled output schema (or none).
pub(crate) struct OutputCheck {
    #[cfg(feature = "output-schema")]
    validator: Option<jsonschema::Validator>,
}

impl OutputCheck {
    /// Compiles `schema`; the compiler's complaint when it does not compile.
    #[cfg_attr(not(feature = "output-schema"), allow(clippy::unnecessary_wraps))]
    pub fn compile(schema: Option<&Value>) -> Result<Self, String> {
        #[cfg(feature = "output-schema")]
        return Ok(Self {
            validator: schema
                .map(jsonschema::validator_for)
                .transpose()
                .map_err(|e| e.to_string())?,
        });
        #[cfg(not(feature = "output-schema"))]
        {
            let _ = schema;
            Ok(Self {})
        }
    }

    /// The first way `value` fails the schema; `None` when it passes.
    pub fn violation(&self, value: &Value) -> Option<String> {
        #[cfg(feature = "output-schema")]
        return self
            .validator
            .as_ref()
            .and_then(|v| v.validate(value).err())
            .map(|e| e.to_string());
        #[cfg(not(feature = "output-schema"))]
        {
            let _ = value;
            None
        }
    }
}
