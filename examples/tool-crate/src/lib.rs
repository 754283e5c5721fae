//! Tools as a tool author writes them, outside the fleet's packs: each is one annotated
//! async fn with typed arguments, output and error (the error derives its codes), one
//! without arguments and one that waits on the worker's Tokio; `main.rs` serves them with
//! `#[toolfleet_worker::main]`, beside the SDK's conformance probe. This crate holds
//! tools only, never serving code.

use std::fmt;
use std::time::Duration;

use toolfleet_worker::prelude::*;

/// Every tool of this crate.
pub fn tools() -> Vec<Tool> {
    vec![
        convert_tool(),
        add_tool(),
        greet_tool(),
        tenant_tool(),
        pause_tool(),
    ]
}

/// What `main` serves: [`tools`] and the conformance probe (PROTOCOL §7.11), so
/// `toolfleet conformance --tool conformance.probe --pid PID` checks this binary.
pub fn served() -> Vec<Tool> {
    let mut tools = tools();
    tools.push(toolfleet_worker::conformance::probe_tool(
        toolfleet_worker::conformance::CONFORMANCE_TOOL,
    ));
    tools
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

#[derive(Serialize, JsonSchema)]
pub struct Tenant {
    pub tenant: String,
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "You are calling for {}.", self.tenant)
    }
}

/// Names the tenant the call is made for; takes no arguments.
#[tool(name = "whoami.tenant")]
pub async fn tenant(ctx: &ToolContext) -> Result<Tenant, ToolError> {
    Ok(Tenant {
        tenant: ctx.tenant_id.clone(),
    })
}

#[derive(Deserialize, JsonSchema)]
pub struct Pause {
    /// How long to wait, in milliseconds.
    #[schemars(range(max = 5000))]
    pub ms: u64,
}

#[derive(Serialize, JsonSchema)]
pub struct Paused {
    pub waited_ms: u64,
}

impl fmt::Display for Paused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "I waited {} milliseconds.", self.waited_ms)
    }
}

/// Waits a while (at most 5 s) without holding a runtime thread, then answers.
#[tool(name = "timer.pause", timeout_ms = 6000)]
pub async fn pause(args: Pause) -> Result<Paused, ToolError> {
    toolfleet_worker::tokio::time::sleep(Duration::from_millis(args.ms)).await;
    Ok(Paused { waited_ms: args.ms })
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolfleet_worker::tokio;

    fn ctx() -> ToolContext {
        ToolContext::new("acme", Default::default())
    }

    // `Tool::call` checks the arguments as the coordinator would.
    #[tokio::test]
    async fn calls_are_checked_against_the_input_schema() {
        let pause = pause_tool();
        let too_long = pause.call(ctx(), json!({"ms": 6000})).await.err();
        assert_eq!(too_long.map(|e| e.code), Some("invalid_arguments".into()));
        let unknown = pause.call(ctx(), json!({"ms": 1, "s": 1})).await.err();
        assert_eq!(unknown.map(|e| e.code), Some("invalid_arguments".into()));
        let tenant = tenant_tool().call(ctx(), json!({})).await.ok();
        assert_eq!(
            tenant.and_then(|o| o.summary),
            Some("You are calling for acme.".into())
        );
    }
}
