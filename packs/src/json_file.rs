//! The JSON settings files of the packs (the `http` pack's tools file, the `mcp` pack's
//! servers file): read whole and parsed into the pack's own declaration type.
//!
//! Owns reading and parsing, and the errors that name the file; what the declarations
//! mean, and their checks, stay with each pack.

use std::path::Path;

use serde::de::DeserializeOwned;

/// Why a settings file could not be read as JSON of the expected shape.
#[derive(Debug, thiserror::Error)]
pub enum JsonFileError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid JSON of the expected shape.
    #[error("parsing {path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
}

/// The file at `path`, parsed as a `T`.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T, JsonFileError> {
    let display = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| JsonFileError::Read {
        path: display.clone(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| JsonFileError::Parse {
        path: display,
        source,
    })
}
