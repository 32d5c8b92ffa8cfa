//! What a failed call means for a background operation: gone (only a new `start` can bring a
//! reply), or a question still open that a poll may ask again. Shared by the calls and by the
//! reading of a response object, so it is a leaf of its own.

use replyd_core::provider::{OperationId, ProviderError};

/// Whether a failed poll leaves the question open, so asking again is right: everything but
/// the operation's own end (gone, failed: status 200 or a 4xx the provider meant).
pub(super) fn poll_may_be_retried(error: &ProviderError) -> bool {
    match error {
        ProviderError::OperationGone { .. } | ProviderError::Fatal { .. } => false,
        // Status 200: the poll worked and reported the operation's own server-side failure.
        ProviderError::MaybeExecuted { status, .. } => *status != 200,
        _ => true,
    }
}

/// The documented "operation is gone" error: only a new `start` can produce a reply.
pub(super) fn gone(operation: &OperationId, why: &str) -> ProviderError {
    ProviderError::OperationGone {
        operation: operation.to_string(),
        why: why.to_owned(),
    }
}
