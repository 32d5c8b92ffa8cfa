//! A conversation's messages in order, with their tasks (V22): what a client lists to show a
//! conversation again (another device, a reload). Keyset pages over the message's number in
//! its conversation, which is given in commit order, so paging while others write neither
//! skips nor repeats a message.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use replyd_core::domain::{StoredTask, TaskId};
use replyd_core::history::{EarlierMessage, EarlierReply};

use super::Store;
use super::error::StoreError;
use super::rows::{TASK_COLUMNS, task_from};

/// One message of a conversation, with its tasks (its reply, and any regenerated ones),
/// oldest first.
#[derive(Debug, Clone)]
pub struct ListedMessage {
    pub message_id: Uuid,
    pub seq: i64,
    pub content: String,
    pub created_at: DateTime<Utc>,
    pub tasks: Vec<StoredTask>,
}

/// One page: up to the limit, and whether more followed it when it was read.
#[derive(Debug, Clone)]
pub struct MessagePage {
    pub messages: Vec<ListedMessage>,
    pub more: bool,
}

impl Store {
    /// Whether the workspace has (or had, until an erasure still remembered) the conversation:
    /// its messages' row, a task of it (one a producer sent has no message), or its erasure.
    pub async fn conversation_known(
        &self,
        workspace: &str,
        conversation: &str,
    ) -> Result<bool, StoreError> {
        Ok(self
            .row(
                "SELECT EXISTS (SELECT 1 FROM conversations \
                                WHERE workspace_id = $1 AND conversation_id = $2) \
                     OR EXISTS (SELECT 1 FROM erasures \
                                WHERE workspace_id = $1 AND conversation_id = $2) \
                     OR EXISTS (SELECT 1 FROM reply_tasks WHERE status IN ('pending', 'running') \
                                AND workspace_id = $1 AND conversation_id = $2) \
                     OR EXISTS (SELECT 1 FROM reply_tasks WHERE status IN ('completed', 'failed', 'cancelled') \
                                AND workspace_id = $1 AND conversation_id = $2)",
                &[&workspace, &conversation],
            )
            .await?
            .get(0))
    }

    /// The messages of `conversation` numbered after `after`, at most `limit`, with their
    /// tasks; `None` when the workspace has no such conversation.
    pub async fn conversation_page(
        &self,
        workspace: &str,
        conversation: &str,
        after: i64,
        limit: i64,
    ) -> Result<Option<MessagePage>, StoreError> {
        let client = self.client().await?;
        let exists: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM conversations \
                 WHERE workspace_id = $1 AND conversation_id = $2)",
                &[&workspace, &conversation],
            )
            .await?
            .get(0);
        if !exists {
            return Ok(None);
        }
        // One more than asked, to know whether a next page exists.
        let rows = client
            .query(
                "SELECT message_id, seq, content, created_at FROM messages \
                 WHERE workspace_id = $1 AND conversation_id = $2 AND seq > $3 \
                 ORDER BY seq LIMIT $4",
                &[&workspace, &conversation, &after, &(limit + 1)],
            )
            .await?;
        let more = rows.len() as i64 > limit;
        let mut messages: Vec<ListedMessage> = rows
            .iter()
            .take(limit as usize)
            .map(|r| ListedMessage {
                message_id: r.get(0),
                seq: r.get(1),
                content: r.get(2),
                created_at: r.get(3),
                tasks: Vec::new(),
            })
            .collect();
        let ids: Vec<String> = messages.iter().map(|m| m.message_id.to_string()).collect();
        // Finished and open tasks apart, each through its own partial index.
        let tasks = client
            .query(
                &format!(
                    "SELECT {TASK_COLUMNS} FROM reply_tasks WHERE status IN ('completed', 'failed', 'cancelled') \
                       AND workspace_id = $1 AND conversation_id = $2 AND message_id = ANY($3) \
                     UNION ALL \
                     SELECT {TASK_COLUMNS} FROM reply_tasks WHERE status IN ('pending', 'running') \
                       AND workspace_id = $1 AND conversation_id = $2 AND message_id = ANY($3) \
                     ORDER BY created_at, task_id"
                ),
                &[&workspace, &conversation, &ids],
            )
            .await?;
        // The message a task belongs to, by the id the page asked for.
        let index: std::collections::HashMap<&str, usize> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.as_str(), i))
            .collect();
        for row in &tasks {
            let task = task_from(row)?;
            if let Some(&i) = index.get(task.spec.message_id.as_str()) {
                messages[i].tasks.push(task);
            }
        }
        Ok(Some(MessagePage { messages, more }))
    }
}

/// Earlier messages the history of a new one reads at most: the newest ones, since the budget
/// drops the oldest first.
pub const HISTORY_MESSAGES: i64 = 200;

impl Store {
    /// The newest [`HISTORY_MESSAGES`] messages of `conversation`, oldest first, each with its
    /// completed replies, oldest first: what the history of a new message is composed from
    /// (`replyd_core::history`). One statement; read before the intake's transaction, so the
    /// history is what the conversation held when the request was read.
    pub async fn earlier_messages(
        &self,
        workspace: &str,
        conversation: &str,
    ) -> Result<Vec<EarlierMessage>, StoreError> {
        let rows = self
            .rows(
                "SELECT m.seq, m.content, t.task_id, t.saved_response, t.document_version \
                 FROM (SELECT seq, message_id, content FROM messages \
                       WHERE workspace_id = $1 AND conversation_id = $2 \
                       ORDER BY seq DESC LIMIT $3) m \
                 LEFT JOIN reply_tasks t ON t.workspace_id = $1 AND t.conversation_id = $2 \
                      AND t.message_id = m.message_id::text AND t.status = 'completed' \
                 ORDER BY m.seq, t.created_at, t.task_id",
                &[&workspace, &conversation, &HISTORY_MESSAGES],
            )
            .await?;
        let mut earlier: Vec<(i64, EarlierMessage)> = Vec::new();
        for row in &rows {
            let seq: i64 = row.get(0);
            if earlier.last().is_none_or(|(last, _)| *last != seq) {
                earlier.push((
                    seq,
                    EarlierMessage {
                        content: row.get(1),
                        replies: Vec::new(),
                    },
                ));
            }
            let task: Option<Uuid> = row.get(2);
            let text: Option<String> = row.get(3);
            if let (Some(task), Some(text), Some((_, message))) = (task, text, earlier.last_mut()) {
                message.replies.push(EarlierReply {
                    task_id: TaskId::from(task),
                    text,
                    document_version: row.get(4),
                });
            }
        }
        Ok(earlier.into_iter().map(|(_, m)| m).collect())
    }
}
