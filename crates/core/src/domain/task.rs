//! A task as it is stored and how its pieces end: the task's lifecycle ([`TaskStatus`]), the
//! row as read ([`StoredTask`]), one attempt's history row and outcome ([`AttemptRecord`],
//! [`AttemptOutcome`]), and how a record's processing ended ([`RecordEnd`]). Closed sets
//! ([`ClosedSet`](crate::closed_set::ClosedSet)) are enums with `as_str()` for SQL and metric
//! labels, so every place that writes or reads them is kept in step by the compiler.

use chrono::{DateTime, Utc};
use serde::Serialize;
use strum::{EnumString, IntoStaticStr, VariantArray};

use super::record::TaskSpec;

/// Lifecycle of a task row (`reply_tasks.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, IntoStaticStr, EnumString, VariantArray)]
#[strum(serialize_all = "snake_case")]
pub enum TaskStatus {
    Pending,
    Running,
    Completed,
    Failed,
    /// The user stopped it (`POST /v1/replies/{id}/cancel`, migration V23): no call starts
    /// after it, a running call's write is fenced, its reservation is released.
    Cancelled,
}

impl TaskStatus {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskStatus::Completed | TaskStatus::Failed | TaskStatus::Cancelled
        )
    }
}

/// Whether a provider call may have done (and billed) work whose answer replyd never got: a
/// request sent whose answer was lost or broken, a server error after the provider took it, an
/// operation it accepted, a call cut short by cancellation. Kept on the task for good
/// (`reply_tasks.provider_may_have_run`): a task that fails with it set does not release its
/// quota reservation as if nothing ran (I8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderRan {
    /// Surely not: the request never left, or the provider refused it without doing it.
    No,
    /// Maybe: nobody can tell from here.
    Maybe,
}

impl ProviderRan {
    pub fn may_have(self) -> bool {
        self == ProviderRan::Maybe
    }
}

/// The outcome written on an attempt row (`reply_attempts.outcome`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, IntoStaticStr, EnumString, VariantArray,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum AttemptOutcome {
    /// This attempt's reply was saved (I1).
    Accepted,
    /// This attempt's write was refused: it was no longer the current assignment with a live
    /// lease (I2).
    Fenced,
    /// The provider call failed and may not have run (or was refused).
    ProviderError,
    /// The provider call ended without a complete answer: it may have run.
    Ambiguous,
    /// The provider's operation had not ended within the longest wait replyd allows: it may
    /// still finish.
    Timeout,
    /// The provider refused the call without doing it (a 429, a 503 that says so, a refused
    /// connection): the attempt was given back, since it cost nothing (I7).
    Refused,
    /// The attempt ended without an outcome of its own: cancelled (revoked, stopping), or its
    /// lease ran out and the task was taken over. Its worker may still report later.
    Abandoned,
    /// The user stopped the task while this attempt held it: the call was cut short and any
    /// answer is refused.
    Cancelled,
}

/// How the processing of one record ended with a durable outcome (its offset may then be
/// committed past, I3); the label of `replyd_records_done_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordEnd {
    /// This record's processing saved the reply.
    Completed,
    /// This record's processing failed the task for good (or found it out of budget).
    Failed,
    /// The record could not become a task; its copy is in the dead-letter topic.
    DeadLettered,
    /// The task already had its reply.
    AlreadyCompleted,
    /// The task had already failed for good.
    AlreadyFailed,
    /// The task was forgotten (retention or an erasure): nothing is left to do for it.
    Forgotten,
    /// The user stopped the task: nothing is left to do for it.
    Cancelled,
}

impl RecordEnd {
    pub fn as_str(self) -> &'static str {
        match self {
            RecordEnd::Completed => "completed",
            RecordEnd::Failed => "failed",
            RecordEnd::DeadLettered => "dead_lettered",
            RecordEnd::AlreadyCompleted => "already_completed",
            RecordEnd::AlreadyFailed => "already_failed",
            RecordEnd::Forgotten => "forgotten",
            RecordEnd::Cancelled => "cancelled",
        }
    }
}

/// Where the record a claim is made for sits in its source: a topic's partition and the
/// record's offset there. Written on the task and the attempt a claim starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RecordSource {
    pub partition: i32,
    pub offset: i64,
    /// Whether the source gives the partition to one consumer at a time (a Kafka partition in
    /// a consumer group; not an SQS queue, whose one "partition" every worker reads). A claim
    /// for such a record may take over a live lease taken for the same partition by another
    /// holder (`lease::Claimer::may_take_over`). Not stored: an attempt read back says false.
    #[serde(skip)]
    pub held_alone: bool,
}

impl RecordSource {
    /// The partition this claimer holds alone, if it does.
    pub fn partition_held(&self) -> Option<i32> {
        self.held_alone.then_some(self.partition)
    }
}

/// A task row as stored, for `read` and operators.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredTask {
    pub spec: TaskSpec,
    pub status: TaskStatus,
    pub assignment_version: i64,
    pub lease_owner: Option<String>,
    pub lease_until: Option<DateTime<Utc>>,
    pub attempt_count: i32,
    pub provider_operation_id: Option<String>,
    pub saved_response: Option<String>,
    pub failure: Option<String>,
    /// No claim before this instant (backoff after a failed attempt).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// Class of the last attempt's failure (`ProviderError::kind`), and its message.
    pub last_error_class: Option<String>,
    pub last_error: Option<String>,
    /// Calls the provider refused without doing them; none of them spent an attempt.
    pub refusals: i32,
    /// Set by the first refusal (`retry.refusal_budget_ms` later): no retry after a refusal is
    /// planned past it.
    pub refusal_deadline: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// One row of a task's attempt history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AttemptRecord {
    pub attempt_no: i32,
    pub assignment_version: i64,
    pub worker: String,
    pub claimed_at: DateTime<Utc>,
    pub lease_until: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub outcome: Option<AttemptOutcome>,
    pub detail: Option<String>,
    /// The tokens the provider reported for this attempt's call; None: not reported (the call
    /// ended without an answer, or the answer said nothing), which is never the same as 0.
    pub usage: Option<TokenUsage>,
    /// The record this attempt's claim was made for; None for a claim made without one (an
    /// operator's, or a row written before V21).
    pub source: Option<RecordSource>,
    /// How its streamed answer ended without a reply, and the characters of text it had
    /// received (V26); None when it ended in a reply, was not streamed, or died with its
    /// worker.
    pub stream_end: Option<(StreamEnd, i32)>,
    /// How long its call waited for the provider's capacity, and behind what (V34); recorded
    /// for waits of a second or more, None for shorter ones and for rows before V34.
    pub capacity_wait: Option<CapacityWait>,
}

/// An attempt's wait for the provider's capacity (I9, I10): how long, and what waited in the
/// worker when its call joined the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CapacityWait {
    pub waited_ms: i32,
    /// Calls of this worker waiting for the same model before it.
    pub calls_ahead: i32,
    /// How many of them were of its own workspace: the rest were ahead only for their turn.
    pub own_ahead: i32,
    /// Workspaces with calls waiting then, its own included.
    pub workspaces: i32,
}

/// How an attempt's streamed answer ended without a reply (`reply_attempts.stream_end`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamEnd {
    /// Ended or stalled without the provider's final event: an ambiguous call.
    Cut,
    /// An error event after the first tokens.
    Error,
    /// Dropped by the worker: a Stop, a revoked partition, a stopping worker.
    Cancelled,
    /// Its lease was lost while it streamed.
    Fenced,
}

impl StreamEnd {
    pub const ALL: [StreamEnd; 4] = [
        StreamEnd::Cut,
        StreamEnd::Error,
        StreamEnd::Cancelled,
        StreamEnd::Fenced,
    ];

    /// The column's value.
    pub fn as_str(self) -> &'static str {
        match self {
            StreamEnd::Cut => "cut",
            StreamEnd::Error => "error",
            StreamEnd::Cancelled => "cancelled",
            StreamEnd::Fenced => "fenced",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.as_str() == text)
    }
}

impl AttemptRecord {
    /// Whether this attempt ended having possibly reached the provider and reported no usage
    /// (an answer lost or refused by the lease, a timeout, an error, or an answer without a
    /// usage block): whatever it cost is in no total. A refused call did no work; an open one
    /// has not ended.
    pub fn reported_nothing(&self) -> bool {
        self.usage.is_none() && self.outcome.is_some_and(|o| o != AttemptOutcome::Refused)
    }
}

/// Tokens a provider reported for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenUsage {
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
}

impl TokenUsage {
    /// The sum of what was reported; None when nothing was.
    pub fn total_of(reported: impl IntoIterator<Item = Option<TokenUsage>>) -> Option<TokenUsage> {
        reported.into_iter().flatten().reduce(|a, b| TokenUsage {
            prompt_tokens: a.prompt_tokens + b.prompt_tokens,
            completion_tokens: a.completion_tokens + b.completion_tokens,
        })
    }
}
