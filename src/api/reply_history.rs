//! The history a reply is asked with: for a new message, the conversation's earlier messages
//! and the replies kept, within the budgets; for a regenerate, the source task's own turns.
//! Apart from the handlers because composing it reads the store and weighs the policy's
//! budgets, a step of its own between the checks and the intake.

use super::problem::Problem;
use super::state::ApiState;
use replyd_core::domain::{ChatMessage, StoredTask, TaskId};
use replyd_core::history::{self, Budget, KeptError, regenerate_parts};
use replyd_core::idempotency::BoundInputs;
use replyd_core::prompt_policy::prompt_bytes;
use replyd_core::workspace_policy::{Admitted, WorkspacePolicy};

/// The history a new message is asked with (`replyd_core::history`): the conversation's
/// earlier messages and the replies kept, within `api.history_max_tokens`, what is left of
/// `worker.max_prompt_bytes`, and what is left of the workspace's whole token quota, so
/// history alone never makes a request the policy refuses. Or why `kept_replies` cannot be
/// used.
pub(super) async fn history_of(
    state: &ApiState,
    workspace: &str,
    inputs: &BoundInputs,
    kept: &[TaskId],
    policy: &WorkspacePolicy,
    alone: &Admitted,
) -> Result<Result<Vec<ChatMessage>, KeptError>, Problem> {
    let max_tokens = state.settings.history_max_tokens;
    if max_tokens == 0 && kept.is_empty() {
        return Ok(Ok(Vec::new()));
    }
    let earlier = state
        .store
        .earlier_messages(workspace, &inputs.conversation_id)
        .await
        .map_err(Problem::store_unavailable)?;
    let prompt = prompt_bytes(policy, &inputs.message, inputs.context.as_deref());
    let budget = Budget {
        tokens: i64::from(max_tokens).min(
            policy
                .token_limit
                .map_or(i64::MAX, |limit| limit - alone.token_ceiling),
        ),
        bytes: state.limits.max_prompt_bytes.saturating_sub(prompt),
    };
    let composed = history::compose(&earlier, kept, &inputs.document_version, budget);
    if let Ok(history) = &composed {
        crate::telemetry::history(history.turns.len(), history.dropped);
    }
    Ok(composed.map(|h| h.turns))
}

/// The inputs of a regenerate (the source task's question, bound to the source task) and the
/// turns before it: the source's, as it was asked (its system turns and history).
pub(super) fn regenerate_inputs(source: &StoredTask) -> (BoundInputs, Vec<ChatMessage>) {
    let request = &source.spec.request;
    let (context, turns, message) = regenerate_parts(&request.messages);
    let inputs = BoundInputs {
        conversation_id: source.spec.conversation_id.clone(),
        message,
        document_version: source.spec.document_version.clone(),
        model: request.model.clone(),
        context,
        max_output_tokens: request.max_output_tokens,
        source_task: Some(source.spec.task_id.to_string()),
        kept_replies: None,
    };
    (inputs, turns)
}
