//! Reading typed settings from environment variables. Malformed values are errors,
//! never silently replaced by defaults.
//!
//! Owns the `env_*` readers and [`ConfigError`]. A leaf: every module that reads a
//! variable (endpoints, credentials, TLS files, streams, the ops address) imports it,
//! and it imports none of them.

use std::str::FromStr;
use std::time::Duration;

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

/// Reads `name` (`default` when unset) and refuses a value outside `range`.
pub fn env_in<T>(
    name: &str,
    default: T,
    range: std::ops::RangeInclusive<T>,
) -> Result<T, ConfigError>
where
    T: FromStr + PartialOrd + std::fmt::Display,
    T::Err: std::fmt::Display,
{
    in_range(name, env_or(name, default)?, &range)
}

/// Reads a millisecond duration from `name` (`default` when unset) and refuses a value
/// outside `range_ms`.
pub fn env_ms_in(
    name: &str,
    default: Duration,
    range_ms: std::ops::RangeInclusive<u64>,
) -> Result<Duration, ConfigError> {
    let ms = env_in(
        name,
        u64::try_from(default.as_millis()).unwrap_or(u64::MAX),
        range_ms,
    )?;
    Ok(Duration::from_millis(ms))
}

/// `value` of `name` when inside `range`; else an error naming the variable, the value
/// and the allowed range.
pub fn in_range<T>(
    name: &str,
    value: T,
    range: &std::ops::RangeInclusive<T>,
) -> Result<T, ConfigError>
where
    T: PartialOrd + std::fmt::Display,
{
    match range.contains(&value) {
        true => Ok(value),
        false => Err(ConfigError {
            name: name.to_string(),
            value: value.to_string(),
            reason: format!("out of range: allowed {} to {}", range.start(), range.end()),
        }),
    }
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

    #[test]
    fn zero_and_huge_values_are_refused_with_name_value_and_range() {
        for value in [0u64, u64::MAX] {
            let err = in_range("TOOLFLEET_MAX_CALLS", value, &(1..=256)).err();
            let err = err.map(|e| (e.name, e.value, e.reason));
            assert_eq!(
                err,
                Some((
                    "TOOLFLEET_MAX_CALLS".to_string(),
                    value.to_string(),
                    "out of range: allowed 1 to 256".to_string()
                ))
            );
        }
        assert_eq!(in_range("X", 16u64, &(1..=256)).ok(), Some(16));
    }
}
