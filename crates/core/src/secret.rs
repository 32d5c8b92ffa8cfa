//! [`Secret`]: a value that must never be logged (database URLs with passwords, API keys).
//! Its `Debug`, `Display` and `Serialize` never show the value, so a settings dump, an error
//! message or `replyd config show` cannot leak it. A leaf module: settings and adapters both
//! use it, and it uses neither.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A value that must never be logged (database URLs with passwords, API keys).
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

/// Shown redacted: `replyd config show` prints the effective settings without their secrets.
impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("***")
    }
}

/// In the settings' schema: a string that is only ever written.
impl schemars::JsonSchema for Secret {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Secret".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({"type": "string", "writeOnly": true})
    }
}

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself, for the one place that needs it (a connection, a request header).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}
