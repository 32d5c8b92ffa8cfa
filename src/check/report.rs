//! What `replyd check` found, as a table, a JSON document or one summary line.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::transport::Transport;

/// Percentiles of attempts (claims, each one provider call at most) per task.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Percentiles {
    pub p50: i64,
    pub p99: i64,
    pub max: i64,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Report {
    /// Where the records came from: `kafka` (a topic) or `sqs` (a queue). The table's rows of
    /// the records and of I3 are the transport's words, matched here so a new transport must
    /// say its own.
    pub source: Transport,
    pub tasks: i64,
    pub completed: i64,
    pub failed: i64,
    /// Stopped by their users (`POST /v1/replies/{id}/cancel`).
    pub cancelled: i64,
    pub pending: i64,
    pub dead_lettered: i64,
    /// Records in the topic (all partitions), good and bad.
    pub records: i64,
    pub bad_records: i64,
    /// Records at or above their partition's committed offset (not yet committed past).
    pub uncommitted_records: i64,
    pub duplicate_replies: i64,
    pub lost: i64,
    pub fenced_rejections: i64,
    /// Attempt rows but refusals: one per claim whose call may have cost money. An attempt
    /// makes at most one provider call (a claim refused later, or cancelled before its call,
    /// makes none).
    pub attempts: i64,
    /// Calls the provider refused without doing them (attempt rows `refused`): they spend no
    /// attempt of a task's budget (I7).
    pub refused_calls: i64,
    pub attempts_per_task: Percentiles,
    pub max_attempts_exceeded: i64,
    /// Messages submitted once through the API with more than one task for that submission
    /// (a retried key that made new work; must be 0).
    pub duplicate_tasks: i64,
    /// API-created tasks (those with an idempotency record) with no outbox row, or more than
    /// one (must be 0 within the outbox's retention).
    pub tasks_without_one_outbox_row: i64,
    /// Outbox rows not yet published (0 after a drain).
    pub outbox_unpublished: i64,
    /// Quota reservations by state (I8).
    pub reservations_open: i64,
    pub reservations_charged: i64,
    pub reservations_released: i64,
    pub reservations_expired: i64,
    /// Open reservations past their TTL that the reconciler has not settled (0 after it ran).
    pub reservations_unsettled: i64,
    /// Open reservations held for tasks that failed while the provider may have done their
    /// work, until the reconciler can settle them (I8: not released as if nothing ran).
    pub reservations_unresolved: i64,
    /// Completed tasks whose reservation is not charged (must be 0).
    pub completed_without_charge: i64,
    /// Cancelled tasks whose reservation was not charged though a call may have run, or not
    /// released though none can have started (must be 0).
    pub cancelled_misettled: i64,
    /// Charged reservations whose task neither completed nor failed under a policy that
    /// charges failures, nor failed while the provider may have done its work (must be 0).
    pub charges_without_reply: i64,
    /// Workspaces whose counter of open reservations (or of the tokens they hold) differs from
    /// the reservations (must be 0).
    pub quota_counter_mismatches: i64,
    /// Settled reservations whose tokens are not what their settlement charges: a charge the
    /// saved reply's reported usage, else the ceiling; anything else none (must be 0).
    pub token_charge_mismatches: i64,
    /// Accepted replies per worker id: how the work was shared.
    pub replies_by_worker: BTreeMap<String, i64>,
    /// HTTP requests the mock provider received (when `--mock-url` is given).
    pub mock_requests: Option<i64>,
    /// Generations the mock ran. A mock started with `--honour-idempotency-key true` answers a
    /// resent request for work already done without generating again (a request but not a
    /// generation: compare the two); by default, like the real chat APIs, it generates anew.
    pub mock_generations: Option<i64>,
    /// `mock_requests / tasks`.
    pub mock_requests_per_task: Option<f64>,
    /// Names of the broken invariants; empty when all hold.
    pub violations: Vec<String>,
}

impl Report {
    /// The headline figures as one `key=value` line.
    pub fn summary_line(&self) -> String {
        let workers: Vec<String> = self
            .replies_by_worker
            .iter()
            .map(|(w, n)| format!("{w}:{n}"))
            .collect();
        format!(
            "tasks={} completed={} failed={} cancelled={} dead_lettered={} duplicate_tasks={} duplicate_replies={} lost={} charged={} released={} unsettled={} provider_requests={} generations={} replies_by_worker={}",
            self.tasks,
            self.completed,
            self.failed,
            self.cancelled,
            self.dead_lettered,
            self.duplicate_tasks,
            self.duplicate_replies,
            self.lost,
            self.reservations_charged,
            self.reservations_released,
            self.reservations_unsettled,
            self.mock_requests
                .map_or_else(|| "unknown".to_string(), |n| n.to_string()),
            self.mock_generations
                .map_or_else(|| "unknown".to_string(), |n| n.to_string()),
            if workers.is_empty() {
                "none".to_string()
            } else {
                workers.join(",")
            },
        )
    }

    /// The report as a table for operators.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let mut row = |name: &str, value: String, note: &str| {
            // Writing to a String cannot fail.
            let _ = writeln!(out, "{name:<26} {value:>10}  {note}");
        };
        row("tasks", self.tasks.to_string(), "");
        row("  completed", self.completed.to_string(), "");
        row("  failed", self.failed.to_string(), "");
        row("  cancelled", self.cancelled.to_string(), "");
        row("  pending or running", self.pending.to_string(), "");
        // The records' rows and I3's, in the transport's words: a queue keeps no history, so
        // its rows are what it and its dead-letter queue still hold.
        let (records, lost) = match self.source {
            Transport::Kafka => (
                vec![
                    ("records in the topic", self.records, ""),
                    ("  bad records", self.bad_records, ""),
                    ("  dead-lettered", self.dead_lettered, ""),
                    ("  not yet committed past", self.uncommitted_records, ""),
                ],
                (
                    "lost records",
                    "I3: committed past without an outcome; must be 0",
                ),
            ),
            Transport::Sqs => (
                vec![
                    (
                        "messages held",
                        self.records,
                        "the queue's and its dead-letter queue's",
                    ),
                    ("  dead-lettered", self.dead_lettered, ""),
                    (
                        "  in the queue",
                        self.uncommitted_records,
                        "not deleted yet",
                    ),
                ],
                (
                    "lost tasks",
                    "I3: open, with no message left in the queue; must be 0",
                ),
            ),
        };
        for (name, value, note) in records {
            row(name, value.to_string(), note);
        }
        row(
            "duplicate replies",
            self.duplicate_replies.to_string(),
            "I1: must be 0",
        );
        row(lost.0, self.lost.to_string(), lost.1);
        row(
            "fenced rejections",
            self.fenced_rejections.to_string(),
            "I2: zombie writes refused",
        );
        row(
            "attempts",
            self.attempts.to_string(),
            "one per claim whose call may have cost money",
        );
        row(
            "refused calls",
            self.refused_calls.to_string(),
            "the provider did no work; no attempt spent",
        );
        row(
            "attempts per task",
            format!(
                "{}/{}/{}",
                self.attempts_per_task.p50, self.attempts_per_task.p99, self.attempts_per_task.max
            ),
            "p50/p99/max",
        );
        row(
            "over their budget",
            self.max_attempts_exceeded.to_string(),
            "I7: must be 0",
        );
        row(
            "duplicate tasks",
            self.duplicate_tasks.to_string(),
            "I6: a retried key that made new work; must be 0",
        );
        row(
            "API tasks, outbox rows ≠ 1",
            self.tasks_without_one_outbox_row.to_string(),
            "I6: must be 0",
        );
        row(
            "outbox unpublished",
            self.outbox_unpublished.to_string(),
            "0 once the relay has drained",
        );
        row(
            "reservations open / charged / released / expired",
            format!(
                "{} / {} / {} / {}",
                self.reservations_open,
                self.reservations_charged,
                self.reservations_released,
                self.reservations_expired
            ),
            "",
        );
        row(
            "reservations past TTL, unsettled",
            self.reservations_unsettled.to_string(),
            "I8: must be 0 once the reconciler ran",
        );
        row(
            "reservations held unresolved",
            self.reservations_unresolved.to_string(),
            "failed tasks whose work may exist; settled by the reconciler after their TTL",
        );
        row(
            "completed without charge",
            self.completed_without_charge.to_string(),
            "I8: must be 0",
        );
        row(
            "cancelled, settled against the Stop's rule",
            self.cancelled_misettled.to_string(),
            "I8: must be 0",
        );
        row(
            "charges without reply",
            self.charges_without_reply.to_string(),
            "I8: must be 0",
        );
        row(
            "quota counters off",
            self.quota_counter_mismatches.to_string(),
            "I8: must be 0",
        );
        row(
            "token charges off",
            self.token_charge_mismatches.to_string(),
            "I8: must be 0 (the reply's reported usage, else the ceiling)",
        );
        for (worker, replies) in &self.replies_by_worker {
            row(&format!("replies by {worker}"), replies.to_string(), "");
        }
        if let (Some(requests), Some(generations)) = (self.mock_requests, self.mock_generations) {
            row(
                "mock: requests",
                requests.to_string(),
                &format!(
                    "{:.3} per task",
                    self.mock_requests_per_task.unwrap_or_default()
                ),
            );
            row(
                "mock: generations",
                generations.to_string(),
                "a resent Idempotency-Key is a request, not a generation",
            );
        }
        if self.violations.is_empty() {
            let _ = writeln!(out, "\nevery invariant holds");
        } else {
            let _ = writeln!(out, "\nBROKEN:");
            for v in &self.violations {
                let _ = writeln!(out, "  {v}");
            }
        }
        out
    }
}
