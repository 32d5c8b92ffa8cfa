//! `[retention]`: how long finished tasks are kept, and how long a forgotten task is
//! remembered. The settings tree (`crate::config`) holds it; the relay's housekeeping
//! ([`super`]) applies it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Retention of the tasks' history.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionSettings {
    /// Finished tasks (completed or failed) are deleted this long after they finished, with
    /// their attempts, reservation, outbox row, idempotency records and message. 0 keeps them
    /// forever. A task whose idempotency record is still remembered, or whose reservation is
    /// still open, waits for them. At least `api.idempotency_retention_ms`.
    pub tasks_ms: u64,
    /// How long the id of a task deleted by retention or an erasure (and an erased scope) is
    /// remembered, so that a record of it still in the topic, or replayed from the dead
    /// letters, is refused instead of running the task again. Must outlast both topics'
    /// `retention.ms`, which `replyd config check --connect` compares.
    pub forgotten_ms: u64,
    /// How often the relay runs a round of retention (each round forgets at most 2,000 tasks,
    /// in transactions of 200).
    pub interval_ms: u64,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self {
            tasks_ms: 0,
            forgotten_ms: 30 * 24 * 60 * 60 * 1000,
            interval_ms: 60_000,
        }
    }
}

impl RetentionSettings {
    /// What is wrong with `[retention]` against the idempotency records' own retention.
    pub fn problems(&self, idempotency_retention_ms: u64) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if self.tasks_ms > 0 && self.tasks_ms < idempotency_retention_ms {
            out.push((
                "retention.tasks_ms",
                format!(
                    "{} must be 0 (keep forever) or at least api.idempotency_retention_ms ({idempotency_retention_ms}): a client's retry within that time must still find its task",
                    self.tasks_ms
                ),
            ));
        }
        if self.interval_ms == 0 {
            out.push(("retention.interval_ms", "must be positive".into()));
        }
        if self.forgotten_ms == 0 {
            out.push((
                "retention.forgotten_ms",
                "must be positive: a forgotten task's records may still be in the topic".into(),
            ));
        }
        out
    }

    /// Why a topic that keeps its records `topic_retention_ms` (`retention.ms`; -1: forever)
    /// outlives the memory of forgotten tasks, if it does: a record of a task forgotten then
    /// could come back (a consumer group reset, a replay) after its id was let go, and run the
    /// task again.
    pub fn outlived_by(&self, topic: &str, topic_retention_ms: i64) -> Option<String> {
        let kept = u64::try_from(topic_retention_ms).ok();
        match kept {
            Some(ms) if ms <= self.forgotten_ms => None,
            _ => Some(format!(
                "topic {topic} keeps records {} but retention.forgotten_ms is {} ms: a record of a task forgotten (by retention or an erasure) could come back after its id is let go and run the task again; lower the topic's retention.ms to at most retention.forgotten_ms, or raise retention.forgotten_ms",
                kept.map_or_else(
                    || "forever (retention.ms -1)".to_owned(),
                    |ms| format!("{ms} ms (retention.ms)")
                ),
                self.forgotten_ms
            )),
        }
    }

    /// How long finished tasks are kept; `None`: forever.
    pub fn tasks(&self) -> Option<Duration> {
        (self.tasks_ms > 0).then(|| Duration::from_millis(self.tasks_ms))
    }

    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }

    pub fn forgotten(&self) -> Duration {
        Duration::from_millis(self.forgotten_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_topic_that_keeps_records_longer_than_forgotten_ids_are_remembered_is_named() {
        let settings = RetentionSettings {
            forgotten_ms: 1_000,
            ..RetentionSettings::default()
        };
        assert_eq!(settings.outlived_by("tasks", 1_000), None);
        assert_eq!(settings.outlived_by("tasks", 999), None);
        let longer = settings.outlived_by("tasks", 1_001).unwrap();
        assert!(
            longer.starts_with("topic tasks keeps records 1001 ms (retention.ms)"),
            "{longer}"
        );
        let forever = settings.outlived_by("tasks", -1).unwrap();
        assert!(forever.contains("forever (retention.ms -1)"), "{forever}");
    }
}
