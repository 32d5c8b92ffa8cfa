//! A background response and where it is in its life (`queued` → `in_progress` →
//! `completed` or `failed`): the vocabulary the book, the response object and the server
//! share, kept in a leaf so each of them names it without the others.

use crate::mock_provider::stream::Event;

/// What a finished generation produced, as the response object reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub text: String,
    pub model: String,
    pub input_tokens: u32,
    pub output_tokens: u32,
}

/// A finished generation's output, for the book's and the object's tests.
#[cfg(test)]
pub(super) fn output(text: &str) -> Output {
    Output {
        text: text.into(),
        model: "m".into(),
        input_tokens: 2,
        output_tokens: 1,
    }
}

/// Where a response is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResponseState {
    /// Created; its generation has not begun.
    Queued,
    /// Generating.
    InProgress,
    /// Done with a reply.
    Completed(Output),
    /// Ended without a reply; `message` says why (a server-side failure, e.g. shutdown).
    Failed { message: String },
}

impl ResponseState {
    /// The status as the API spells it.
    pub fn status(&self) -> &'static str {
        match self {
            ResponseState::Queued => "queued",
            ResponseState::InProgress => "in_progress",
            ResponseState::Completed(_) => "completed",
            ResponseState::Failed { .. } => "failed",
        }
    }

    pub(super) fn is_terminal(&self) -> bool {
        matches!(
            self,
            ResponseState::Completed(_) | ResponseState::Failed { .. }
        )
    }
}

/// One response: the model asked for, and its state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseEntry {
    pub model: String,
    pub state: ResponseState,
    /// The idempotency key it was created under, when keys are honoured (forgotten with it).
    pub key: Option<String>,
    /// The events of a response created with `stream: true`, each at its `sequence_number`;
    /// `None` for one created without, which cannot be streamed.
    pub events: Option<Vec<Event>>,
}
