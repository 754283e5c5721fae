//! Reading typed settings from environment variables. Malformed values are errors,
//! never silently replaced by defaults.

use std::str::FromStr;
use std::time::Duration;

/// Default NATS URL.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
/// Default Redis URL.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379/";

/// A setting that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{name}={value:?}: {reason}")]
pub struct ConfigError {
    /// The variable's name.
    pub name: String,
    /// The value it held.
    pub value: String,
    /// Why it was rejected.
    pub reason: String,
}

/// Reads `name` from the environment, `default` when unset or empty.
pub fn env_or<T>(name: &str, default: T) -> Result<T, ConfigError>
where
    T: FromStr,
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().map_err(|e: T::Err| ConfigError {
            name: name.to_string(),
            value: v.clone(),
            reason: e.to_string(),
        }),
        _ => Ok(default),
    }
}

/// Reads a millisecond duration from `name`.
pub fn env_ms(name: &str, default: Duration) -> Result<Duration, ConfigError> {
    let ms = env_or(name, u64::try_from(default.as_millis()).unwrap_or(u64::MAX))?;
    Ok(Duration::from_millis(ms))
}

/// Reads a string from `name`.
pub fn env_string(name: &str, default: &str) -> String {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.trim().to_string(),
        _ => default.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_values_are_errors() {
        // Names unique to this test so parallel tests do not interfere.
        std::env::set_var("TOOLFLEET_TEST_CONFIG_BAD", "twelve");
        let err = env_or::<u64>("TOOLFLEET_TEST_CONFIG_BAD", 1);
        assert!(err.is_err());
        assert_eq!(
            env_or::<u64>("TOOLFLEET_TEST_CONFIG_UNSET", 7).ok(),
            Some(7)
        );
    }
}
