//! How telemetry writes a line: an error with its causes, a failure logged once until it
//! changes, and a repeating condition logged once a minute.

use std::time::Duration;

/// An error with its causes, `outer: inner: innermost`: tokio-postgres, for one, says only
/// "db error" at the top and puts PostgreSQL's message in the source.
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.ends_with(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

/// Logs a failure that may repeat many times (a connection retried every few hundred
/// milliseconds) once per distinct message, and the recovery once, with how many it hid.
pub struct RepeatedFailure {
    what: &'static str,
    last: Option<String>,
    count: u64,
}

impl RepeatedFailure {
    pub fn new(what: &'static str) -> Self {
        Self {
            what,
            last: None,
            count: 0,
        }
    }

    /// Failures since the last success.
    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn failed(&mut self, error: &str) {
        self.count += 1;
        if self.last.as_deref() != Some(error) {
            tracing::warn!(
                what = self.what,
                error,
                "{} failed; retrying (logged once until it changes)",
                self.what
            );
            self.last = Some(error.to_owned());
        }
    }

    pub fn recovered(&mut self) {
        if self.count > 0 {
            tracing::info!(
                what = self.what,
                failures = self.count,
                "{} succeeded after {} failed attempts",
                self.what,
                self.count
            );
        }
        self.count = 0;
        self.last = None;
    }
}

/// True at most once a minute per `key`: for conditions that repeat while they last.
pub(super) fn once_a_minute(key: &str) -> bool {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    use std::time::Instant;
    static LAST: OnceLock<Mutex<HashMap<String, Instant>>> = OnceLock::new();
    let mut last = LAST
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    match last.get(key) {
        Some(at) if now.duration_since(*at) < Duration::from_secs(60) => false,
        _ => {
            last.insert(key.to_owned(), now);
            true
        }
    }
}

/// A log line's shape: numbers and librdkafka's own "(after 3ms in state CONNECT, 2 identical
/// error(s) suppressed)" tail taken out, so repeats of one condition share a key.
pub(super) fn shape_of(message: &str) -> String {
    let head = message.split(" (after ").next().unwrap_or(message);
    head.chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_of_one_condition_share_a_shape() {
        let first = "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 0ms in state CONNECT)";
        let again = "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 12ms in state CONNECT, 3 identical error(s) suppressed)";
        assert_eq!(shape_of(first), shape_of(again));
        assert_eq!(
            shape_of("1/1 brokers are down"),
            shape_of("0/1 brokers are down")
        );
        assert_ne!(
            shape_of("Connect to ipv4#127.0.0.1:1 failed"),
            shape_of("Failed to resolve 'kafka.internal:9092'")
        );
    }

    #[test]
    fn a_repeated_line_passes_once_a_minute() {
        let key = format!("test-{}", uuid::Uuid::new_v4());
        assert!(once_a_minute(&key));
        assert!(!once_a_minute(&key));
    }

    #[test]
    fn the_chain_says_each_cause_once() {
        let inner = std::io::Error::other("Connection refused (os error 111)");
        #[derive(Debug, thiserror::Error)]
        #[error("error connecting to server: {0}")]
        struct Outer(#[source] std::io::Error);
        assert_eq!(
            chain(&Outer(inner)),
            "error connecting to server: Connection refused (os error 111)"
        );
    }
}
