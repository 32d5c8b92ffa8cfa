//! A workspace's rules for the system turn, pure: its own system prompt, which every task it
//! makes is asked with, and whether its end users' tokens may send `context` (a system turn
//! of their own). Both are set by an operator (`replyd workspace policy`) and read with the
//! rest of the [`WorkspacePolicy`].
//!
//! The prompt is part of what a task is created with, as its history is
//! ([`crate::history`]): it is written into the task's request, so every retry, takeover and
//! replay asks with the prompt the task was made with, whatever the operator sets later. It
//! counts wherever the request's text counts: in `worker.max_prompt_bytes`, in the token
//! ceiling its reservation holds (its bytes and framing, like any message) and in the size of
//! its Kafka record.
//!
//! A token is an end user's browser's credential; the system turn is the workspace's. So an
//! end user may send `context` only where the workspace allows it ([`EndUserContext`]; by
//! default not), and a request that sends one anyway is refused (`422`), never quietly
//! stripped: a client whose text would be dropped should know. The workspace's key, held by
//! the product's own server, may always send it.

use crate::domain::{ChatMessage, Role};
use crate::workspace_policy::{PolicyRefusal, WorkspacePolicy};

/// The longest system prompt an operator may set: a long brief, far from any prompt limit a
/// deployment would set, short enough that a pasted file by mistake is refused.
pub const MAX_SYSTEM_PROMPT_BYTES: usize = 32 * 1024;

/// Whether a workspace's end users may send `context` (one of the workspace's rules, kept
/// with the others in [`crate::workspace_policy`]).
pub use crate::workspace_policy::EndUserContext;

/// Who sends a request: the side of the product that holds its key, or one of its end users.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sender {
    Key,
    EndUser,
}

/// The system turns the workspace puts before every task's history: its prompt, if it has one.
pub fn system_turns(policy: &WorkspacePolicy) -> Vec<ChatMessage> {
    policy
        .system_prompt
        .iter()
        .map(|prompt| ChatMessage {
            role: Role::System,
            content: prompt.clone(),
        })
        .collect()
}

/// Whether `sender` may send `context` in this workspace: the key always; an end user only
/// where the workspace allows it. An empty `context` adds no system turn and is no refusal.
pub fn judge_context(
    policy: &WorkspacePolicy,
    sender: Sender,
    context: Option<&str>,
) -> Result<(), PolicyRefusal> {
    match (sender, context, policy.end_user_context) {
        (Sender::EndUser, Some(context), EndUserContext::Deny) if !context.is_empty() => {
            Err(PolicyRefusal {
                fields: vec!["context"],
                detail: "`context` (a system turn) may not be sent with an end user's token in this workspace (its end_user_context is deny): the system turn is the workspace's; send it from the product's server with the workspace's key, or have an operator allow it (`replyd workspace policy <workspace> --end-user-context allow`)".to_owned(),
            })
        }
        _ => Ok(()),
    }
}

/// Bytes of prompt a request takes before its history: its message, its context and the
/// workspace's prompt.
pub fn prompt_bytes(policy: &WorkspacePolicy, message: &str, context: Option<&str>) -> usize {
    message.len()
        + context.map_or(0, str::len)
        + policy.system_prompt.as_ref().map_or(0, String::len)
}

/// Why a request's prompt is over `max_prompt_bytes` once the workspace's prompt is counted,
/// if it is.
pub fn check_prompt_bytes(
    policy: &WorkspacePolicy,
    message: &str,
    context: Option<&str>,
    max_prompt_bytes: usize,
) -> Result<(), PolicyRefusal> {
    let Some(system) = &policy.system_prompt else {
        return Ok(());
    };
    let total = prompt_bytes(policy, message, context);
    if total <= max_prompt_bytes {
        return Ok(());
    }
    Err(PolicyRefusal {
        fields: vec!["message", "context"],
        detail: format!(
            "`message` and `context` are {} bytes and this workspace's system prompt {}: {total} bytes, over the limit of {max_prompt_bytes} (worker.max_prompt_bytes)",
            total - system.len(),
            system.len()
        ),
    })
}

/// Parses an operator's system prompt: `none` removes it; otherwise the text, which may not be
/// blank, hold a NUL, or be over [`MAX_SYSTEM_PROMPT_BYTES`] or `max_prompt_bytes` (a
/// message must still fit beside it).
pub fn parse_system_prompt(text: &str, max_prompt_bytes: usize) -> Result<Option<String>, String> {
    if text.trim() == "none" {
        return Ok(None);
    }
    if text.trim().is_empty() {
        return Err("the system prompt is blank: give its text, or `none` to remove it".into());
    }
    if text.contains('\0') {
        return Err("the system prompt contains a NUL character (U+0000)".into());
    }
    if text.len() > MAX_SYSTEM_PROMPT_BYTES {
        return Err(format!(
            "the system prompt is {} bytes, over the limit of {MAX_SYSTEM_PROMPT_BYTES} bytes",
            text.len()
        ));
    }
    if text.len() >= max_prompt_bytes {
        return Err(format!(
            "the system prompt is {} bytes; with a message beside it every request would be over worker.max_prompt_bytes ({max_prompt_bytes})",
            text.len()
        ));
    }
    Ok(Some(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(prompt: Option<&str>, end_users: EndUserContext) -> WorkspacePolicy {
        WorkspacePolicy {
            system_prompt: prompt.map(str::to_owned),
            end_user_context: end_users,
            ..WorkspacePolicy::default()
        }
    }

    #[test]
    fn an_end_users_context_is_refused_by_default_naming_the_field_and_the_setting() {
        let default = WorkspacePolicy::default();
        assert_eq!(default.end_user_context, EndUserContext::Deny);
        let refusal = judge_context(&default, Sender::EndUser, Some("Be rude.")).unwrap_err();
        assert_eq!(refusal.fields, ["context"]);
        assert!(
            refusal.detail.contains("end_user_context is deny"),
            "{}",
            refusal.detail
        );
        assert_eq!(judge_context(&default, Sender::EndUser, None), Ok(()));
        assert_eq!(judge_context(&default, Sender::EndUser, Some("")), Ok(()));
        assert_eq!(
            judge_context(&default, Sender::Key, Some("Be brief.")),
            Ok(())
        );
        let allowed = policy(None, EndUserContext::Allow);
        assert_eq!(
            judge_context(&allowed, Sender::EndUser, Some("Be brief.")),
            Ok(())
        );
    }

    #[test]
    fn the_workspaces_prompt_is_one_system_turn_or_none() {
        assert_eq!(system_turns(&WorkspacePolicy::default()), []);
        assert_eq!(
            system_turns(&policy(
                Some("You are the help desk."),
                EndUserContext::Deny
            )),
            [ChatMessage {
                role: Role::System,
                content: "You are the help desk.".into()
            }]
        );
    }

    #[test]
    fn the_prompt_limit_counts_the_workspaces_prompt() {
        let p = policy(Some("0123456789"), EndUserContext::Deny);
        assert_eq!(prompt_bytes(&p, "q?", Some("ctx")), 15);
        assert_eq!(check_prompt_bytes(&p, "q?", Some("ctx"), 15), Ok(()));
        let refusal = check_prompt_bytes(&p, "q?", Some("ctx"), 14).unwrap_err();
        assert_eq!(refusal.fields, ["message", "context"]);
        assert!(
            refusal.detail.contains(
                "5 bytes and this workspace's system prompt 10: 15 bytes, over the limit of 14"
            ),
            "{}",
            refusal.detail
        );
        assert_eq!(
            check_prompt_bytes(&WorkspacePolicy::default(), "q?", None, 1),
            Ok(()),
            "without a prompt the request's own check is the one"
        );
    }

    #[test]
    fn an_operators_prompt_is_text_within_its_bounds_or_none() {
        assert_eq!(parse_system_prompt("none", 1000), Ok(None));
        assert_eq!(
            parse_system_prompt("Be brief.", 1000),
            Ok(Some("Be brief.".to_owned()))
        );
        for (bad, max, words) in [
            (" \n".to_owned(), 1000, "blank"),
            ("a\0b".to_owned(), 1000, "NUL"),
            (
                "x".repeat(MAX_SYSTEM_PROMPT_BYTES + 1),
                1 << 20,
                "over the limit of 32768",
            ),
            ("x".repeat(1000), 1000, "worker.max_prompt_bytes (1000)"),
        ] {
            let refused = parse_system_prompt(&bad, max).unwrap_err();
            assert!(refused.contains(words), "{refused}");
        }
        assert!(parse_system_prompt(&"x".repeat(MAX_SYSTEM_PROMPT_BYTES), 1 << 20).is_ok());
    }
}
