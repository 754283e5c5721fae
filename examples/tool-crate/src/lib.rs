//! Three tools as a tool author writes them, outside the fleet's packs: each is one
//! annotated async fn with typed arguments, output and error (the error derives its
//! codes); `main.rs` serves them with `#[toolfleet_worker::main]`. This crate holds tools only, never serving code.

use std::fmt;

use toolfleet_worker::prelude::*;

/// Every tool of this crate.
pub fn tools() -> Vec<Tool> {
    vec![convert_tool(), add_tool(), greet_tool()]
}

#[derive(Deserialize, JsonSchema)]
pub struct Celsius {
    /// Degrees Celsius.
    pub celsius: f64,
}

#[derive(Serialize, JsonSchema)]
pub struct Fahrenheit {
    pub fahrenheit: f64,
}

impl fmt::Display for Fahrenheit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "That is {:.1} degrees Fahrenheit.", self.fahrenheit)
    }
}

/// Why a conversion fails: each variant is a stable code (`ToolError` derive).
#[derive(Debug, ToolError)]
pub enum ConvertError {
    /// below -273.15 °C
    #[tool_error(
        code = "below_absolute_zero",
        user_message = "That is colder than anything can be."
    )]
    TooCold,
}

/// Converts a temperature from Celsius to Fahrenheit.
#[tool(name = "units.celsius_to_fahrenheit", idempotent = 3)]
pub async fn convert(args: Celsius) -> Result<Fahrenheit, ConvertError> {
    if args.celsius < -273.15 {
        return Err(ConvertError::TooCold);
    }
    Ok(Fahrenheit {
        fahrenheit: args.celsius * 9.0 / 5.0 + 32.0,
    })
}

#[derive(Deserialize, JsonSchema)]
pub struct Terms {
    pub a: i64,
    pub b: i64,
}

#[derive(Serialize, JsonSchema)]
pub struct Sum {
    pub sum: i64,
}

impl fmt::Display for Sum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "The sum is {}.", self.sum)
    }
}

/// Adds two whole numbers.
#[tool(name = "math.add", timeout_ms = 1000)]
pub async fn add(args: Terms) -> Result<Sum, ToolError> {
    args.a
        .checked_add(args.b)
        .map(|sum| Sum { sum })
        .ok_or_else(|| ToolError::fatal("overflow", "the sum does not fit in 64 bits"))
}

#[derive(Deserialize, JsonSchema)]
pub struct Person {
    pub name: String,
}

#[derive(Serialize, JsonSchema)]
pub struct Greeting {
    pub text: String,
}

impl fmt::Display for Greeting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Greets a person on behalf of the caller's tenant.
#[tool(name = "hello.greet", waiting_hint = "thinking of something nice")]
pub async fn greet(args: Person, ctx: &ToolContext) -> Result<Greeting, ToolError> {
    Ok(Greeting {
        text: format!("Hello {}, from {}.", args.name, ctx.tenant_id),
    })
}
