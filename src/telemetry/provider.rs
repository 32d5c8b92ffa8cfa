//! Events of the provider: each call and how it ended, the tokens answers reported, and the
//! deployment's shared capacity (waits, refusals, the rate applied).

use std::sync::Arc;
use std::time::Duration;

use metrics::{Counter, Histogram, counter, gauge, histogram};

use super::catalogue::names::*;
use super::kept::Kept;
use super::lines::once_a_minute;

/// How one provider call ended, for its metric label.
#[derive(Debug, Clone, Copy)]
pub enum CallEnd<'a> {
    Replied,
    Failed(&'a replyd_core::provider::ProviderError),
    /// Cut short: the partition was revoked or the worker is stopping.
    Cancelled,
    /// Cut short: a renewal was refused, so the lease is gone.
    LeaseLost,
}

impl CallEnd<'_> {
    pub fn label(self) -> &'static str {
        match self {
            CallEnd::Replied => "ok",
            CallEnd::Failed(error) => error.kind(),
            CallEnd::Cancelled => "cancelled",
            CallEnd::LeaseLost => "lease_lost",
        }
    }
}

pub fn provider_call(task_id: &str, version: i64, end: CallEnd<'_>, took: Duration) {
    tracing::debug!(
        task_id,
        assignment_version = version,
        outcome = end.label(),
        took_ms = took.as_millis() as u64,
        "provider call"
    );
    static CALLS: Kept<&'static str, Counter> = Kept::new();
    static SECONDS: Kept<(), Histogram> = Kept::new();
    let outcome = end.label();
    CALLS
        .get(&outcome, || counter!(PROVIDER_CALLS, "outcome" => outcome))
        .increment(1);
    SECONDS
        .one(|| histogram!(PROVIDER_SECONDS))
        .record(took.as_secs_f64());
}

/// How many records of this worker wait for `bucket`'s capacity now.
pub fn capacity_waiting(bucket: &str, records: usize) {
    gauge!(CAPACITY_WAITING, "model" => bucket.to_owned()).set(records as f64);
}

/// A record of `workspace` got its capacity permit after `waited`: by model, and by model and
/// workspace (bounded, [`workspace_label`]), so a workspace that waits far longer than the
/// others is seen (I10).
pub fn capacity_waited(bucket: &str, workspace: &str, waited: Duration) {
    static BY_MODEL: Kept<String, Histogram> = Kept::new();
    // By model, then by the workspace's label: at most `WORKSPACE_LABELS` + 1 a model.
    static BY_WORKSPACE: Kept<String, Arc<Kept<String, Histogram>>> = Kept::new();
    let seconds = waited.as_secs_f64();
    BY_MODEL
        .get(
            bucket,
            || histogram!(CAPACITY_WAIT_SECONDS, "model" => bucket.to_owned()),
        )
        .record(seconds);
    let label = workspace_label(workspace);
    BY_WORKSPACE
        .get(bucket, || Arc::new(Kept::new()))
        .get(&label, || {
            histogram!(
                CAPACITY_WORKSPACE_WAIT_SECONDS,
                "model" => bucket.to_owned(),
                "workspace" => label.clone(),
            )
        })
        .record(seconds);
}

/// Workspaces a process labels by name; the rest are `other`.
pub const WORKSPACE_LABELS: usize = 50;

/// The label of `workspace` in a per-workspace series: its name if it is one of the first
/// [`WORKSPACE_LABELS`] this process labelled, else `other`. A deployment with thousands of
/// workspaces then exports at most that many series a model from each process, never one a
/// workspace.
pub fn workspace_label(workspace: &str) -> String {
    static LABELLED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut labelled = LABELLED.lock().unwrap_or_else(|p| p.into_inner());
    label_within(&mut labelled, workspace, WORKSPACE_LABELS)
}

fn label_within(labelled: &mut Vec<String>, workspace: &str, limit: usize) -> String {
    if labelled.iter().any(|w| w == workspace) {
        return workspace.to_owned();
    }
    if labelled.len() < limit && workspace != "other" {
        labelled.push(workspace.to_owned());
        return workspace.to_owned();
    }
    "other".to_owned()
}

/// The provider refused a call for capacity (a 429 or an overload): the deployment pauses.
pub fn capacity_refused(bucket: &str) {
    if once_a_minute(&format!("capacity-refused:{bucket}")) {
        tracing::warn!(
            model = bucket,
            "the provider refused a call for capacity; every worker pauses as it asked (repeats are held back for a minute)"
        );
    }
    counter!(CAPACITY_REFUSALS, "model" => bucket.to_owned()).increment(1);
}

/// The tokens a provider's answer reported, by the model asked and the kind (`prompt`,
/// `completion`); an answer that reported none is counted apart, never as 0 tokens.
pub fn provider_usage(model: &str, usage: Option<(u32, u32)>) {
    static TOKENS: Kept<String, (Counter, Counter)> = Kept::new();
    static UNREPORTED: Kept<String, Counter> = Kept::new();
    match usage {
        Some((prompt, completion)) => {
            let (prompt_tokens, completion_tokens) = TOKENS.get(model, || {
                (
                    counter!(PROVIDER_TOKENS, "model" => model.to_owned(), "kind" => "prompt"),
                    counter!(PROVIDER_TOKENS, "model" => model.to_owned(), "kind" => "completion"),
                )
            });
            prompt_tokens.increment(u64::from(prompt));
            completion_tokens.increment(u64::from(completion));
        }
        None => UNREPORTED
            .get(
                model,
                || counter!(PROVIDER_USAGE_UNREPORTED, "model" => model.to_owned()),
            )
            .increment(1),
    }
}

/// The request rate the budget applies to `bucket` now: configured, or learned.
pub fn capacity_limit(bucket: &str, per_second: f64) {
    gauge!(CAPACITY_LIMIT, "model" => bucket.to_owned()).set(per_second);
}

/// How a streamed provider answer ended: `completed`, `cut`, `error`, `cancelled`, `fenced`.
pub fn provider_stream_ended(end: &'static str) {
    static KEPT: Kept<&'static str, Counter> = Kept::new();
    KEPT.get(&end, || counter!(PROVIDER_STREAMS, "end" => end))
        .increment(1);
}

/// A piece of live text written (`written`), refused because its attempt is no longer the
/// task's running one (`fenced`), or lost to a database error (`error`).
pub fn live_text_piece(outcome: &'static str, bytes: usize) {
    counter!(LIVE_PIECES, "outcome" => outcome).increment(1);
    if outcome == "written" {
        counter!(LIVE_BYTES).increment(bytes as u64);
    }
}

/// A live event sent to a follower: `delta` or `withdrawn`.
pub fn api_live_event(event: &'static str) {
    counter!(API_LIVE_EVENTS, "event" => event).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_workspaces_keep_their_names_and_the_rest_are_other() {
        let mut labelled = Vec::new();
        let labels: Vec<String> = ["a", "b", "a", "c", "b", "other"]
            .iter()
            .map(|w| label_within(&mut labelled, w, 2))
            .collect();
        assert_eq!(labels, ["a", "b", "a", "other", "b", "other"]);
        assert_eq!(labelled, ["a", "b"]);
    }
}
