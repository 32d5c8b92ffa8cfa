//! The views of a reply task the API answers with: where a task is ([`ReplyStatus`]), the
//! answer to a submission ([`Accepted`]), the task as the API shows it ([`ReplyView`]) and
//! the tokens its attempts reported ([`UsageView`]). Apart from the handlers because the event
//! stream and the conversation pages show the same views.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::{AttemptRecord, StoredTask, TaskId, TaskStatus, TokenUsage};

/// Where a task is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReplyStatus {
    /// Waiting for a worker.
    Pending,
    /// A worker is asking the provider.
    Running,
    /// The reply is saved (terminal).
    Completed,
    /// No reply will come (terminal); `failure` says why.
    Failed,
    /// Stopped by `POST /v1/replies/{task_id}/cancel` (terminal): no reply will come, and the
    /// task is not charged.
    Cancelled,
}

impl From<TaskStatus> for ReplyStatus {
    fn from(status: TaskStatus) -> Self {
        match status {
            TaskStatus::Pending => ReplyStatus::Pending,
            TaskStatus::Running => ReplyStatus::Running,
            TaskStatus::Completed => ReplyStatus::Completed,
            TaskStatus::Failed => ReplyStatus::Failed,
            TaskStatus::Cancelled => ReplyStatus::Cancelled,
        }
    }
}

/// The answer to a submission: where to follow the task.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct Accepted {
    #[schema(value_type = uuid::Uuid)]
    pub task_id: TaskId,
    /// New work is `pending`; a replay shows the task's current status.
    pub status: ReplyStatus,
    pub status_url: String,
    pub events_url: String,
    /// True when this answer is for an earlier request with the same key.
    pub replayed: bool,
}

/// A task as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct ReplyView {
    #[schema(value_type = uuid::Uuid)]
    pub task_id: TaskId,
    pub status: ReplyStatus,
    /// The saved reply, once `completed`.
    pub reply: Option<String>,
    /// Why no reply will come, once `failed`.
    pub failure: Option<String>,
    /// Provider attempts so far.
    pub attempts: i32,
    pub max_attempts: u32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Tokens the provider reported, per attempt and in all (in `GET /v1/replies/{task_id}`;
    /// absent from the event stream's snapshots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageView>,
}

/// Tokens the provider reported for a task. A number is what the provider said; `null` is
/// "not reported" (no answer came, or it carried no usage), never 0.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct UsageView {
    /// Prompt tokens over the attempts that reported usage; `null` when none did.
    pub prompt_tokens: Option<i64>,
    /// Completion tokens over the attempts that reported usage; `null` when none did.
    pub completion_tokens: Option<i64>,
    /// Finished attempts that may have reached the provider and reported nothing (an answer
    /// lost or refused by the lease, a timeout, an error): whatever they cost is not in the
    /// totals. Refused calls (`refused`), which the provider did not run, are not counted.
    pub unreported_attempts: u32,
    /// Every attempt, oldest first.
    pub attempts: Vec<AttemptUsageView>,
}

/// One attempt's usage.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct AttemptUsageView {
    /// 1 for the first claim of the task.
    pub attempt: i32,
    /// How the attempt ended (`accepted`, `timeout`, `refused`, ...); `null` while it runs.
    pub outcome: Option<String>,
    /// `null`: not reported.
    pub prompt_tokens: Option<i64>,
    /// `null`: not reported.
    pub completion_tokens: Option<i64>,
    /// How its streamed answer ended without a reply: `cut` (no final event: an ambiguous
    /// call), `error` (an error event after the first tokens), `cancelled`, `fenced` (its lease
    /// was lost); absent when it ended in a reply, was not streamed, or its worker died.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_end: Option<String>,
    /// Characters of text the attempt had received when its stream so ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streamed_chars: Option<i32>,
}

impl UsageView {
    pub fn of(attempts: &[AttemptRecord]) -> Self {
        let total = TokenUsage::total_of(attempts.iter().map(|a| a.usage));
        let unreported = attempts.iter().filter(|a| a.reported_nothing()).count();
        Self {
            prompt_tokens: total.map(|t| t.prompt_tokens),
            completion_tokens: total.map(|t| t.completion_tokens),
            unreported_attempts: u32::try_from(unreported).unwrap_or(u32::MAX),
            attempts: attempts
                .iter()
                .map(|a| AttemptUsageView {
                    attempt: a.attempt_no,
                    outcome: a.outcome.map(|o| o.as_str().to_owned()),
                    prompt_tokens: a.usage.map(|u| u.prompt_tokens),
                    completion_tokens: a.usage.map(|u| u.completion_tokens),
                    stream_end: a.stream_end.map(|(end, _)| end.as_str().to_owned()),
                    streamed_chars: a.stream_end.map(|(_, chars)| chars),
                })
                .collect(),
        }
    }
}

impl ReplyView {
    pub fn of(task: &StoredTask) -> Self {
        Self {
            task_id: task.spec.task_id,
            status: task.status.into(),
            reply: task.saved_response.clone(),
            failure: task.failure.clone(),
            attempts: task.attempt_count,
            max_attempts: task.spec.max_attempts,
            created_at: task.created_at,
            updated_at: task.updated_at,
            finished_at: task.finished_at,
            usage: None,
        }
    }
}
