//! What the lease state machine is made of: where a run starts from, what it does when another
//! worker holds the task, how a run, an attempt and a guarded call end, and the runner itself.
//! A leaf: the machine's rooms (`super`, `attempt`, `guard`) all name these.

use std::sync::Arc;
use std::time::Duration;

use super::super::live::LiveWriter;
use super::super::parking::ParkedTasks;
use crate::capacity::Capacity;
use crate::provider::Provider;
use crate::store::Store;
use crate::telemetry::CallEnd;
use crate::transport::source::WindowSlot;
use replyd_core::domain::{RecordEnd, RecordSource, TaskSpec};
use replyd_core::lease::Refusal;
use replyd_core::retry::RetrySettings;

/// The record a run starts from: its task, inserted by the first claim if absent, and where
/// it sits, written by each claim that takes the lease and named in the report when the
/// stored task disagrees with it.
#[derive(Debug, Clone, Copy)]
pub struct FromRecord<'a> {
    pub spec: &'a TaskSpec,
    pub source: RecordSource,
    /// Given back while the record only waits for the provider's capacity.
    pub slot: &'a WindowSlot,
}

/// Where a record's attempt waits for capacity: its lane (the record's partition, -1 without
/// a record) and its window slot, given back if it must wait.
#[derive(Clone, Copy)]
pub(super) struct Place<'a> {
    pub(super) lane: i32,
    pub(super) slot: &'a WindowSlot,
}

/// What a run does when another worker holds the task's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenHeld {
    /// Wait in memory until the lease ends or the task changes: a Kafka record's offset holds
    /// its partition's commit point whether it waits here or not.
    Park,
    /// Give the record back to its source, to be delivered again when the lease ends: an SQS
    /// message waits hidden in its queue instead of in this worker's memory. A lease held by
    /// this worker's own name is still waited for here: its twin wakes it at once.
    HandBack,
}

/// How a run ended, when it was not cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    /// The task is terminal, saying how.
    Terminal(RecordEnd),
    /// Another worker holds the task (under [`WhenHeld::HandBack`]): look again after this.
    HandBack { after: Duration },
}

/// How often a background create whose answer was lost is sent again within one attempt.
pub(super) const CREATE_RESENDS: u32 = 2;

/// Settings of the lease state machine.
#[derive(Debug, Clone)]
pub struct RunnerSettings {
    /// The lease owner of this process: `<worker_id>#<incarnation>`
    /// ([`crate::worker::settings::WorkerSettings::lease_owner`]), written by its claims and compared
    /// by them: a live lease of this owner is never taken over by this process.
    pub lease_owner: String,
    pub lease: Duration,
    pub renew_interval: Duration,
    /// Wait before retrying a failed database write, and the shortest wait before claiming
    /// again.
    pub io_retry: Duration,
    pub default_model: String,
    /// Output tokens counted against a tokens-per-minute limit for a task that names no
    /// `max_output_tokens` (`capacity.default_output_tokens`).
    pub default_output_tokens: u32,
    /// Characters of prompt counted as a token (`capacity.chars_per_token`).
    pub chars_per_token: u32,
    pub retry: RetrySettings,
    /// Whether an ambiguous call can be recovered by the provider (it honours
    /// Idempotency-Key, or looks operations up by id) instead of generating again.
    pub recoverable: bool,
    /// Whether calls ask for a streamed answer (`provider.stream`).
    pub stream: bool,
}

/// Drives tasks to a terminal state through their leases.
pub struct TaskRunner {
    pub(super) store: Store,
    pub(super) provider: Arc<dyn Provider>,
    pub(super) parked: ParkedTasks,
    /// The provider's capacity, shared by the deployment (I9): a claimed task waits for a
    /// permit before its call.
    pub(super) capacity: Capacity,
    /// The forwarding of this process's streaming attempts' text.
    pub(super) live: LiveWriter,
    pub(super) settings: RunnerSettings,
}

/// How a provider future raced against cancellation and the lease ended.
pub(super) enum Guarded<T> {
    Done(T),
    Cancelled,
    /// The lease is gone (a renewal or a fenced write was refused).
    Refused(Refusal),
}

impl<T> Guarded<T> {
    /// Stable label for traces, as [`CallEnd`] names the interrupted ends.
    pub(super) fn label(&self) -> &'static str {
        match self {
            Guarded::Done(_) => "done",
            Guarded::Cancelled => CallEnd::Cancelled.label(),
            Guarded::Refused(_) => CallEnd::LeaseLost.label(),
        }
    }
}

/// How one attempt (one claim) ended.
pub(super) enum AttemptEnd {
    /// The task is terminal.
    Terminal(RecordEnd),
    /// The lease is gone (taken over, expired, released after a retryable error): go back to
    /// reading the task.
    Again {
        wait: Duration,
    },
    Cancelled,
}

/// What [`TaskRunner::guarded`] runs, which says what becomes of a result already in hand when
/// the lease's news comes with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Guarding {
    /// A provider call: its answer is handed on to the fenced write, which refuses it.
    Call,
    /// A step before a call (a capacity permit, an operation's start): not taken with a lost
    /// lease, since no call follows it.
    Step,
}
