//! Live text (V26): the pieces of a running attempt's text, written by its worker and read by
//! the followers that (re)connect mid-answer, and how an attempt's stream ended when it did
//! not end in a reply. A hint for followers, never state: no claim, completion or check reads
//! it.

use replyd_core::domain::{StreamEnd, TaskId};
use replyd_core::provider::Usage;

use super::{Store, StoreError};

/// The channel a written piece is announced on.
pub const LIVE_TEXT_CHANNEL: &str = "replyd_live";

/// Most bytes of text in one piece: its notification carries it, under NOTIFY's 8,000-byte
/// payload with room for the task id, version and number.
pub const MAX_PIECE_BYTES: usize = 7_000;

/// One piece of an attempt's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LivePiece {
    pub task_id: TaskId,
    pub assignment_version: i64,
    /// 1 for an attempt's first piece, then one more for each.
    pub seq: i32,
    pub text: String,
}

/// Parses a notification payload, `<task_id> <assignment_version> <seq> <text>` (the text may
/// hold spaces and newlines, and be empty).
pub fn parse_live_payload(payload: &str) -> Option<LivePiece> {
    let mut parts = payload.splitn(4, ' ');
    let task_id = TaskId::parse(parts.next()?).ok()?;
    let assignment_version = parts.next()?.parse().ok()?;
    let seq = parts.next()?.parse().ok()?;
    Some(LivePiece {
        task_id,
        assignment_version,
        seq,
        text: parts.next().unwrap_or("").to_owned(),
    })
}

impl Store {
    /// Writes and announces piece `seq` of `task_id`'s attempt `version` (one statement);
    /// false when that attempt is no longer the task's running one.
    pub async fn append_live_text(
        &self,
        task_id: TaskId,
        version: i64,
        seq: i32,
        text: &str,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached("SELECT replyd_live_append($1, $2, $3, $4)")
            .await?;
        let row = client
            .query_one(&statement, &[&task_id.as_uuid(), &version, &seq, &text])
            .await?;
        Ok(row.get(0))
    }

    /// The pieces of `task_id`'s attempt `version` after piece `after`, in order.
    pub async fn live_text_after(
        &self,
        task_id: TaskId,
        version: i64,
        after: i32,
    ) -> Result<Vec<LivePiece>, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "SELECT seq, text FROM reply_live_text \
                 WHERE task_id = $1 AND assignment_version = $2 AND seq > $3 ORDER BY seq",
            )
            .await?;
        let rows = client
            .query(&statement, &[&task_id.as_uuid(), &version, &after])
            .await?;
        Ok(rows
            .iter()
            .map(|row| LivePiece {
                task_id,
                assignment_version: version,
                seq: row.get(0),
                text: row.get(1),
            })
            .collect())
    }

    /// Records how attempt `version`'s stream ended without a reply: the characters it had,
    /// and the usage the provider last reported (kept null when it reported none).
    pub async fn record_stream_end(
        &self,
        task_id: TaskId,
        version: i64,
        end: StreamEnd,
        chars: usize,
        usage: Option<Usage>,
    ) -> Result<(), StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "UPDATE reply_attempts SET stream_end = $3, streamed_chars = $4, \
                 prompt_tokens = coalesce($5, prompt_tokens), \
                 completion_tokens = coalesce($6, completion_tokens) \
                 WHERE task_id = $1 AND assignment_version = $2",
            )
            .await?;
        let chars = i32::try_from(chars).unwrap_or(i32::MAX);
        let prompt = usage.map(|u| i64::from(u.prompt_tokens));
        let completion = usage.map(|u| i64::from(u.completion_tokens));
        client
            .execute(
                &statement,
                &[
                    &task_id.as_uuid(),
                    &version,
                    &end.as_str(),
                    &chars,
                    &prompt,
                    &completion,
                ],
            )
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_keeps_the_spaces_and_newlines_of_its_text() {
        let id = TaskId::parse("6f1c2d3e-4b5a-4c7d-8e9f-0a1b2c3d4e5f").unwrap();
        let piece = parse_live_payload(&format!("{id} 7 3 Hello, world\n and  more")).unwrap();
        assert_eq!(piece.task_id, id);
        assert_eq!(piece.assignment_version, 7);
        assert_eq!(piece.seq, 3);
        assert_eq!(piece.text, "Hello, world\n and  more");
        assert_eq!(parse_live_payload(&format!("{id} 7 4 ")).unwrap().text, "");
        assert_eq!(parse_live_payload(&format!("{id} 7 4")).unwrap().text, "");
        assert!(parse_live_payload("not-a-task 7 4 x").is_none());
        assert!(parse_live_payload(&format!("{id} seven 4 x")).is_none());
    }
}
