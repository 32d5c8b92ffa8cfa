//! Events of a task's work: claims, saved replies, fenced refusals, failures and retries,
//! lease renewals, parked tasks and their wake-ups, and store errors.

use std::time::Duration;

use metrics::{Counter, Gauge, counter, gauge};

use super::catalogue::names::*;
use super::kept::Kept;
use super::lines::chain;

/// What a claim found (`ClaimOutcome::label` is the metric label).
pub fn claim(task_id: &str, outcome: &replyd_core::lease::ClaimOutcome) {
    static KEPT: Kept<&'static str, Counter> = Kept::new();
    let label = outcome.label();
    tracing::debug!(
        task_id,
        assignment_version = outcome.version(),
        outcome = label,
        "claim"
    );
    KEPT.get(&label, || counter!(CLAIMS, "outcome" => label))
        .increment(1);
}

/// A reply saved by this assignment (refusals are [`write_refused`]).
pub fn reply_accepted(task_id: &str, version: i64) {
    tracing::debug!(task_id, assignment_version = version, "completion accepted");
    static KEPT: Kept<(), Counter> = Kept::new();
    KEPT.one(|| counter!(COMPLETIONS, "outcome" => "accepted"))
        .increment(1);
}

/// A fenced write was refused: one INFO line with the refusal's class and both versions.
/// `current_version` is the task's version when the refusal knows it (a takeover).
pub fn write_refused(
    task_id: &str,
    what: &'static str,
    version: i64,
    refusal: &'static str,
    current_version: Option<i64>,
) {
    tracing::info!(
        task_id,
        what,
        refusal,
        assignment_version = version,
        current_version,
        "fenced write refused"
    );
    counter!(COMPLETIONS, "outcome" => refusal).increment(1);
}

/// A claim found the task out of budget or past its deadline and failed it, before any call
/// of this attempt: a producer mistake (a deadline in seconds) shows here.
pub fn task_failed_at_claim(task_id: &str, why: &'static str, reason: &str) {
    tracing::warn!(
        task_id,
        why,
        reason,
        "task failed at claim, with no provider call"
    );
    counter!(TASKS_FAILED_AT_CLAIM, "why" => why).increment(1);
}

pub fn watched_tasks(tasks: usize) {
    static KEPT: Kept<(), Gauge> = Kept::new();
    KEPT.one(|| gauge!(WATCHED_TASKS)).set(tasks as f64);
}

/// `source` is where the wake-up came from (`parking::WakeSource`'s label).
pub fn wake_up(source: &'static str, records: usize) {
    if records > 0 {
        tracing::debug!(source, records, "parked records woken");
    }
    static KEPT: Kept<&'static str, Counter> = Kept::new();
    KEPT.get(&source, || counter!(WAKE_UPS, "source" => source))
        .increment(records as u64);
}

pub fn listener_connected() {
    tracing::info!("listening for task status notifications");
    counter!(LISTENER_CONNECTS).increment(1);
}

/// The listening session ended because nothing of the process needed it any more.
pub fn listener_idle() {
    tracing::debug!("no longer listening: nothing waits for notifications");
    counter!(LISTENER_IDLE_ENDS).increment(1);
}

pub fn listener_lost() {
    counter!(LISTENER_LOSSES).increment(1);
}

pub fn bad_notification(payload: &str) {
    tracing::warn!(payload, "task status notification not understood; ignored");
}

pub fn task_failed(task_id: &str, version: i64, reason: &str) {
    tracing::warn!(
        task_id,
        assignment_version = version,
        reason,
        "task failed for good"
    );
    counter!(COMPLETIONS, "outcome" => "failed").increment(1);
}

pub fn retry_planned(task_id: &str, version: i64, error_class: &'static str, after: Duration) {
    tracing::info!(
        task_id,
        assignment_version = version,
        error_class,
        after_ms = after.as_millis() as u64,
        "provider call failed; retrying after backoff"
    );
    counter!(RETRIES, "class" => error_class).increment(1);
}

pub fn lease_renewal_refused(task_id: &str, version: i64, why: &str) {
    tracing::warn!(
        task_id,
        assignment_version = version,
        why,
        "lease renewal refused; stopping the call"
    );
    counter!(LEASE_RENEWALS_REFUSED).increment(1);
}

pub fn store_error(operation: &'static str, error: &dyn std::error::Error) {
    tracing::warn!(operation, error = %chain(error), "database operation failed; will retry");
    counter!(STORE_ERRORS, "operation" => operation).increment(1);
}
