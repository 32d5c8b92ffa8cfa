//! Settings. One typed tree; secrets live in [`Secret`], whose `Debug` and `Display` never show
//! the value, so a settings dump in a log line cannot leak a password.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;

/// A value that must never be logged (database URLs with passwords, API keys).
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

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

/// How replyd talks to PostgreSQL.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseSettings {
    /// libpq-style URL, e.g. `postgres://user:pass@127.0.0.1:5432/replyd`. A `?options=-c
    /// search_path=...` parameter is honoured (the tests use it to give each test a schema).
    pub url: Secret,
    /// Connections in the pool. Every in-flight record holds one only for the length of one
    /// short statement or transaction, never across a provider call (I4).
    pub pool_size: usize,
    /// `lock_timeout` of every session: a statement that waits longer on a row lock (say, one
    /// held by a stalled process) fails instead of hanging a worker.
    pub lock_timeout_ms: u64,
    /// `idle_in_transaction_session_timeout`: the server ends a session that sits inside a
    /// transaction this long, so a stopped (SIGSTOP) worker cannot keep row locks.
    pub idle_in_transaction_session_timeout_ms: u64,
    /// `statement_timeout` of every session.
    pub statement_timeout_ms: u64,
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: Secret::new("postgres://replyd:replyd@127.0.0.1:5432/replyd"),
            pool_size: 16,
            lock_timeout_ms: 5_000,
            idle_in_transaction_session_timeout_ms: 10_000,
            statement_timeout_ms: 30_000,
        }
    }
}

impl DatabaseSettings {
    pub fn lock_timeout(&self) -> Duration {
        Duration::from_millis(self.lock_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print_their_value() {
        let settings = DatabaseSettings {
            url: Secret::new("postgres://u:hunter2@db/replyd"),
            ..DatabaseSettings::default()
        };
        let shown = format!("{settings:?} {}", settings.url);
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
