//! The history a new message of a conversation is asked with, pure: its earlier messages and
//! the replies the user kept, oldest first, within a budget. The intake reads the earlier
//! messages, asks [`compose`], and writes the result into the task's request, so the history
//! is fixed when the task is created: every retry and takeover generates from the same inputs.
//!
//! Which reply of an earlier message is kept: the one the client names in `kept_replies`
//! (after a Regenerate the user may keep either answer), else its newest completed one (what
//! a page that shows the last answer shows). A message with no completed reply is sent as the
//! user's turn alone (chat APIs join two user turns in a row).
//!
//! The budget drops the oldest messages first, each with its reply, never half of one: the
//! newest turns are the ones a reply depends on most. It counts as the token quota does (a
//! message's bytes and its framing, [`FRAMING_TOKENS_PER_MESSAGE`]), so a history never
//! costs more tokens than the budget says, whatever the tokenizer.

use std::collections::{BTreeMap, BTreeSet};

use crate::domain::{ChatMessage, Role, TaskId};
use crate::workspace_policy::FRAMING_TOKENS_PER_MESSAGE;

/// Most replies a request may name in `kept_replies`.
pub const MAX_KEPT_REPLIES: usize = 100;

/// One earlier message of the conversation, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EarlierMessage {
    pub content: String,
    /// Its completed replies, oldest first.
    pub replies: Vec<EarlierReply>,
}

/// A completed reply to an earlier message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EarlierReply {
    pub task_id: TaskId,
    pub text: String,
    /// The document version its message asked about.
    pub document_version: String,
}

/// How much history a request may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Tokens, counted as the token quota counts them (`api.history_max_tokens`).
    pub tokens: i64,
    /// Bytes of text: what is left of `worker.max_prompt_bytes` after the new message and its
    /// context.
    pub bytes: usize,
}

/// The turns to send before the new message, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct History {
    pub turns: Vec<ChatMessage>,
    /// Earlier messages left out by the budget.
    pub dropped: usize,
}

/// Why `kept_replies` cannot be used; a `422` naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeptError {
    #[error(
        "kept_replies names {0}, which is not a completed reply to an earlier message of this conversation"
    )]
    NotAnEarlierReply(TaskId),
    #[error("kept_replies names {0} and {1}, two replies to one message: keep one")]
    TwoForOneMessage(TaskId, TaskId),
    #[error("kept_replies names {0} more than once")]
    Repeated(TaskId),
    #[error("kept_replies names {0} replies, over the limit of {MAX_KEPT_REPLIES}")]
    TooMany(usize),
}

/// The history of a new message about `document_version` after `earlier` (oldest first),
/// keeping the replies `kept` names, within `budget`. An earlier message about another
/// document version says which, so the model does not take an answer about an older version
/// for one about this.
pub fn compose(
    earlier: &[EarlierMessage],
    kept: &[TaskId],
    document_version: &str,
    budget: Budget,
) -> Result<History, KeptError> {
    let chosen = choose(earlier, kept)?;
    // From the newest back, whole turns while they fit.
    let mut turns: Vec<[Option<ChatMessage>; 2]> = Vec::new();
    let (mut tokens, mut bytes) = (0i64, 0usize);
    for (message, reply) in earlier.iter().zip(&chosen).rev() {
        let version = reply.map(|r| r.document_version.as_str());
        let question = match version {
            Some(v) if v != document_version && !v.is_empty() => {
                format!("[about document version {v}] {}", message.content)
            }
            _ => message.content.clone(),
        };
        // An empty reply is no turn: a chat API (and the task record) takes no empty message.
        let answer = reply.map(|r| r.text.clone()).filter(|t| !t.is_empty());
        let turn_bytes = question.len() + answer.as_ref().map_or(0, String::len);
        let turn_tokens = i64::try_from(turn_bytes)
            .unwrap_or(i64::MAX)
            .saturating_add(FRAMING_TOKENS_PER_MESSAGE * (1 + i64::from(answer.is_some())));
        if tokens.saturating_add(turn_tokens) > budget.tokens || bytes + turn_bytes > budget.bytes {
            break;
        }
        tokens += turn_tokens;
        bytes += turn_bytes;
        turns.push([
            Some(ChatMessage {
                role: Role::User,
                content: question,
            }),
            answer.map(|content| ChatMessage {
                role: Role::Assistant,
                content,
            }),
        ]);
    }
    let dropped = earlier.len() - turns.len();
    Ok(History {
        turns: turns.into_iter().rev().flatten().flatten().collect(),
        dropped,
    })
}

/// The reply kept for each earlier message: the named one, else the newest completed one.
fn choose<'a>(
    earlier: &'a [EarlierMessage],
    kept: &[TaskId],
) -> Result<Vec<Option<&'a EarlierReply>>, KeptError> {
    if kept.len() > MAX_KEPT_REPLIES {
        return Err(KeptError::TooMany(kept.len()));
    }
    let mut named = BTreeSet::new();
    for id in kept {
        if !named.insert(*id) {
            return Err(KeptError::Repeated(*id));
        }
    }
    let mut chosen: Vec<Option<&EarlierReply>> = earlier.iter().map(|m| m.replies.last()).collect();
    let mut by_message: BTreeMap<usize, TaskId> = BTreeMap::new();
    for id in kept {
        let found = earlier.iter().enumerate().find_map(|(i, m)| {
            m.replies
                .iter()
                .find(|r| r.task_id == *id)
                .map(|reply| (i, reply))
        });
        let Some((i, reply)) = found else {
            return Err(KeptError::NotAnEarlierReply(*id));
        };
        if let Some(other) = by_message.insert(i, *id) {
            return Err(KeptError::TwoForOneMessage(other, *id));
        }
        chosen[i] = Some(reply);
    }
    Ok(chosen)
}

/// What a Regenerate asks again, from its source task's messages: the source's first system
/// turn as its `context`, the turns after it up to the source's question (the workspace's
/// system prompt as it was, then the history) and the question. Put back together (context
/// first, then the turns, then the question, as the intake builds a request) they are the
/// source's messages as they were sent, so the new answer is asked exactly as the old one was,
/// in the same conversation.
pub fn regenerate_parts(messages: &[ChatMessage]) -> (Option<String>, Vec<ChatMessage>, String) {
    let question = messages.iter().rposition(|m| m.role == Role::User);
    let before = &messages[..question.unwrap_or(messages.len())];
    let (context, turns) = match before.first() {
        Some(first) if first.role == Role::System => (Some(first.content.clone()), &before[1..]),
        _ => (None, before),
    };
    let question = question
        .map(|at| messages[at].content.clone())
        .unwrap_or_default();
    (context, turns.to_vec(), question)
}

/// Drops the oldest turn of a history: a user message and the reply after it, if any. The
/// system turns before it (the workspace's prompt) stay.
pub fn drop_oldest_turn(turns: &mut Vec<ChatMessage>) {
    let at = turns.iter().take_while(|m| m.role == Role::System).count();
    let len = if turns.get(at + 1).is_some_and(|m| m.role == Role::Assistant) {
        2
    } else {
        1
    };
    turns.drain(at..(at + len).min(turns.len()));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(n: u128, text: &str, version: &str) -> EarlierReply {
        EarlierReply {
            task_id: TaskId::from(uuid::Uuid::from_u128(n)),
            text: text.into(),
            document_version: version.into(),
        }
    }

    fn message(content: &str, replies: Vec<EarlierReply>) -> EarlierMessage {
        EarlierMessage {
            content: content.into(),
            replies,
        }
    }

    const WIDE: Budget = Budget {
        tokens: 1_000_000,
        bytes: 1_000_000,
    };

    fn texts(history: &History) -> Vec<(Role, &str)> {
        history
            .turns
            .iter()
            .map(|m| (m.role, m.content.as_str()))
            .collect()
    }

    fn id(n: u128) -> TaskId {
        TaskId::from(uuid::Uuid::from_u128(n))
    }

    #[test]
    fn each_earlier_message_comes_with_its_newest_reply_unless_another_is_kept() {
        let earlier = [
            message(
                "one?",
                vec![reply(1, "first", "v1"), reply(2, "again", "v1")],
            ),
            message("two?", vec![reply(3, "second", "v1")]),
        ];
        let history = compose(&earlier, &[], "v1", WIDE).unwrap();
        assert_eq!(
            texts(&history),
            [
                (Role::User, "one?"),
                (Role::Assistant, "again"),
                (Role::User, "two?"),
                (Role::Assistant, "second"),
            ]
        );
        assert_eq!(history.dropped, 0);
        let kept = compose(&earlier, &[id(1)], "v1", WIDE).unwrap();
        assert_eq!(kept.turns[1].content, "first");
    }

    #[test]
    fn a_message_without_a_reply_is_the_users_turn_alone() {
        let earlier = [message("unanswered?", vec![]), message("next?", vec![])];
        let history = compose(&earlier, &[], "", WIDE).unwrap();
        assert_eq!(
            texts(&history),
            [(Role::User, "unanswered?"), (Role::User, "next?")]
        );
    }

    #[test]
    fn a_turn_about_another_document_version_says_which() {
        let earlier = [message("what changed?", vec![reply(1, "a lot", "v6")])];
        let history = compose(&earlier, &[], "v7", WIDE).unwrap();
        assert_eq!(
            history.turns[0].content,
            "[about document version v6] what changed?"
        );
        let same = compose(&earlier, &[], "v6", WIDE).unwrap();
        assert_eq!(same.turns[0].content, "what changed?");
    }

    #[test]
    fn the_budget_drops_the_oldest_whole_turns_first() {
        let earlier = [
            message("aaaa", vec![reply(1, "AAAA", "")]),
            message("bbbb", vec![reply(2, "BBBB", "")]),
            message("cccc", vec![reply(3, "CCCC", "")]),
        ];
        // A turn: 8 bytes and two messages' framing, 24 tokens.
        let two_turns = Budget {
            tokens: 48,
            bytes: 1_000,
        };
        let history = compose(&earlier, &[], "", two_turns).unwrap();
        assert_eq!(history.dropped, 1);
        assert_eq!(history.turns[0].content, "bbbb");
        assert_eq!(history.turns.len(), 4);
        let one_byte_short = Budget {
            tokens: 1_000,
            bytes: 15,
        };
        let history = compose(&earlier, &[], "", one_byte_short).unwrap();
        assert_eq!((history.dropped, history.turns.len()), (2, 2));
        assert_eq!(history.turns[0].content, "cccc");
        let none = Budget {
            tokens: 0,
            bytes: 1_000,
        };
        assert_eq!(
            compose(&earlier, &[], "", none).unwrap(),
            History {
                turns: vec![],
                dropped: 3
            }
        );
    }

    #[test]
    fn kept_replies_must_be_earlier_replies_one_per_message_each_once() {
        let earlier = [message("one?", vec![reply(1, "a", ""), reply(2, "b", "")])];
        assert_eq!(
            compose(&earlier, &[id(9)], "", WIDE),
            Err(KeptError::NotAnEarlierReply(id(9)))
        );
        assert_eq!(
            compose(&earlier, &[id(1), id(2)], "", WIDE),
            Err(KeptError::TwoForOneMessage(id(1), id(2)))
        );
        assert_eq!(
            compose(&earlier, &[id(1), id(1)], "", WIDE),
            Err(KeptError::Repeated(id(1)))
        );
        let many: Vec<TaskId> = (0..=MAX_KEPT_REPLIES as u128).map(id).collect();
        assert_eq!(
            compose(&earlier, &many, "", WIDE),
            Err(KeptError::TooMany(MAX_KEPT_REPLIES + 1))
        );
    }

    fn turn(role: Role, content: &str) -> ChatMessage {
        ChatMessage {
            role,
            content: content.into(),
        }
    }

    #[test]
    fn a_regenerate_put_back_together_is_its_source_as_sent() {
        let rebuilt = |messages: &[ChatMessage]| {
            let (context, turns, question) = regenerate_parts(messages);
            let mut again: Vec<ChatMessage> =
                context.iter().map(|c| turn(Role::System, c)).collect();
            again.extend(turns);
            again.push(turn(Role::User, &question));
            again
        };
        let sources = [
            vec![turn(Role::User, "q")],
            vec![turn(Role::System, "Be brief."), turn(Role::User, "q")],
            vec![
                turn(Role::System, "Be brief."),
                turn(Role::System, "the workspace's prompt"),
                turn(Role::User, "one?"),
                turn(Role::Assistant, "first"),
                turn(Role::User, "q"),
            ],
            vec![
                turn(Role::System, "the workspace's prompt"),
                turn(Role::User, "one?"),
                turn(Role::User, "q"),
            ],
            // From a producer: a system turn anywhere stays where it was.
            vec![
                turn(Role::User, "one?"),
                turn(Role::System, "midway"),
                turn(Role::User, "q"),
            ],
        ];
        for source in sources {
            assert_eq!(rebuilt(&source), source);
        }
        let (context, turns, question) = regenerate_parts(&[
            turn(Role::System, "Be brief."),
            turn(Role::System, "the workspace's prompt"),
            turn(Role::User, "one?"),
            turn(Role::Assistant, "first"),
            turn(Role::User, "two?"),
        ]);
        assert_eq!(context.as_deref(), Some("Be brief."));
        assert_eq!(
            turns,
            [
                turn(Role::System, "the workspace's prompt"),
                turn(Role::User, "one?"),
                turn(Role::Assistant, "first")
            ]
        );
        assert_eq!(question, "two?");
    }

    #[test]
    fn the_oldest_turn_goes_whole_and_the_system_turns_stay() {
        let mut turns = vec![
            turn(Role::System, "the workspace's prompt"),
            turn(Role::User, "one?"),
            turn(Role::Assistant, "first"),
            turn(Role::User, "unanswered?"),
            turn(Role::User, "three?"),
            turn(Role::Assistant, "third"),
        ];
        drop_oldest_turn(&mut turns);
        assert_eq!(turns[1].content, "unanswered?");
        drop_oldest_turn(&mut turns);
        assert_eq!(turns[1].content, "three?");
        drop_oldest_turn(&mut turns);
        assert_eq!(turns, [turn(Role::System, "the workspace's prompt")]);
        drop_oldest_turn(&mut turns);
        assert_eq!(turns.len(), 1, "nothing but system turns: nothing to drop");
    }
}
