//! The workspace's rules for the system turn at the intake (`replyd_core::prompt_policy`):
//! the verdict on who may send `context` and on the prompt's size once the workspace's prompt
//! is counted, and how the policy is shown to the workspace's key (`GET /v1/quota`).
//!
//! Both refusals are part of the policy's verdict on new work, not checks before it: a replay
//! of a key admitted earlier is answered whatever the policy says now, as it is for the
//! models and the output cap (I6).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::state::ApiState;
use replyd_core::idempotency::BoundInputs;
use replyd_core::prompt_policy::{self, EndUserContext, Sender};
use replyd_core::workspace_policy::{PolicyRefusal, WorkspacePolicy};

/// Whether the workspace's end users' tokens may send `context` (`replyd workspace policy
/// --end-user-context`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum EndUserContextView {
    /// A token's `context` is refused (`422 outside_workspace_policy`, `fields`: `context`).
    Deny,
    /// A token may send `context`; it follows the workspace's system prompt.
    Allow,
}

impl From<EndUserContext> for EndUserContextView {
    fn from(rule: EndUserContext) -> Self {
        match rule {
            EndUserContext::Deny => EndUserContextView::Deny,
            EndUserContext::Allow => EndUserContextView::Allow,
        }
    }
}

/// The policy's verdict on a request's system turn: whether its sender may send its
/// `context`, and whether its message and context fit `worker.max_prompt_bytes` beside the
/// workspace's prompt.
pub fn judge_turn(
    state: &ApiState,
    policy: &WorkspacePolicy,
    from_end_user: bool,
    inputs: &BoundInputs,
) -> Result<(), PolicyRefusal> {
    let sender = if from_end_user {
        Sender::EndUser
    } else {
        Sender::Key
    };
    let context = inputs.context.as_deref();
    prompt_policy::judge_context(policy, sender, context)?;
    let limit = state.limits.max_prompt_bytes;
    prompt_policy::check_prompt_bytes(policy, &inputs.message, context, limit)
}
