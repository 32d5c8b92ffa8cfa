//! Live text (V26, V30): the pieces of a running attempt's text, written by its worker (a
//! round of pieces of all its streaming attempts in one statement) and read by the followers
//! that (re)connect mid-answer, and how an attempt's stream ended when it did not end in a
//! reply. A hint for followers, never state: no claim, completion or check reads it.

use replyd_core::domain::{StreamEnd, TaskId};
use replyd_core::provider::Usage;

use super::{Store, StoreError};

/// The channel a piece written by a worker of the previous release is announced on, one
/// piece a notification (V26); listened to while such workers may still run.
pub const LIVE_TEXT_CHANNEL: &str = "replyd_live";

/// The channel a round's written pieces are announced on, packed (V30).
pub const LIVE_PIECES_CHANNEL: &str = "replyd_live_pieces";

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

/// Parses a notification of [`LIVE_PIECES_CHANNEL`]: pieces, each a header line
/// `<task_id> <assignment_version> <seq> <bytes>` and then exactly `<bytes>` bytes of text.
/// What follows a malformed piece is not trusted (its length is unknown): the pieces before it
/// are kept, and the stream's next read fills the gap.
pub fn parse_live_pieces(payload: &str) -> Vec<LivePiece> {
    let mut pieces = Vec::new();
    let mut rest = payload;
    while !rest.is_empty() {
        let Some((piece, after)) = next_piece(rest) else {
            break;
        };
        pieces.push(piece);
        rest = after;
    }
    pieces
}

fn next_piece(payload: &str) -> Option<(LivePiece, &str)> {
    let (header, body) = payload.split_once('\n')?;
    let mut parts = header.split(' ');
    let task_id = TaskId::parse(parts.next()?).ok()?;
    let assignment_version = parts.next()?.parse().ok()?;
    let seq = parts.next()?.parse().ok()?;
    let bytes: usize = parts.next()?.parse().ok()?;
    if parts.next().is_some() || !body.is_char_boundary(bytes.min(body.len())) {
        return None;
    }
    let text = body.get(..bytes)?;
    Some((
        LivePiece {
            task_id,
            assignment_version,
            seq,
            text: text.to_owned(),
        },
        &body[bytes..],
    ))
}

/// One piece of a round, as a worker sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PieceToWrite<'a> {
    pub task_id: TaskId,
    pub assignment_version: i64,
    pub seq: i32,
    pub text: &'a str,
}

impl Store {
    /// Writes and announces a round of pieces (one statement): for each, in order, whether it
    /// is written (now, or by an earlier sending of the same round), false when its attempt is
    /// no longer the task's running one.
    pub async fn append_live_pieces(
        &self,
        pieces: &[PieceToWrite<'_>],
    ) -> Result<Vec<bool>, StoreError> {
        let ids: Vec<uuid::Uuid> = pieces.iter().map(|p| p.task_id.as_uuid()).collect();
        let versions: Vec<i64> = pieces.iter().map(|p| p.assignment_version).collect();
        let seqs: Vec<i32> = pieces.iter().map(|p| p.seq).collect();
        let texts: Vec<&str> = pieces.iter().map(|p| p.text).collect();
        let row = self
            .row(
                "SELECT replyd_live_append_batch($1, $2, $3, $4)",
                &[&ids, &versions, &seqs, &texts],
            )
            .await?;
        let written: Vec<bool> = row.get(0);
        if written.len() != pieces.len() {
            return Err(StoreError::Batch(format!(
                "replyd_live_append_batch answered {} of {} pieces",
                written.len(),
                pieces.len()
            )));
        }
        Ok(written)
    }

    /// The pieces of `task_id`'s attempt `version` after piece `after`, in order.
    pub async fn live_text_after(
        &self,
        task_id: TaskId,
        version: i64,
        after: i32,
    ) -> Result<Vec<LivePiece>, StoreError> {
        let rows = self
            .rows(
                "SELECT seq, text FROM reply_live_text \
                 WHERE task_id = $1 AND assignment_version = $2 AND seq > $3 ORDER BY seq",
                &[&task_id.as_uuid(), &version, &after],
            )
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

    #[test]
    fn a_packed_notification_carries_each_piece_whole_whatever_its_text_holds() {
        let a = TaskId::parse("6f1c2d3e-4b5a-4c7d-8e9f-0a1b2c3d4e5f").unwrap();
        let b = TaskId::parse("7f1c2d3e-4b5a-4c7d-8e9f-0a1b2c3d4e5f").unwrap();
        let tricky = format!("é\n{b} 9 9 3\nxyz");
        let payload = format!(
            "{a} 7 3 {}\n{tricky}{b} 2 1 0\n{a} 7 4 5\nhello",
            tricky.len()
        );
        let pieces = parse_live_pieces(&payload);
        assert_eq!(pieces.len(), 3, "{pieces:#?}");
        assert_eq!((pieces[0].task_id, pieces[0].seq), (a, 3));
        assert_eq!(pieces[0].text, tricky);
        assert_eq!((pieces[1].task_id, pieces[1].assignment_version), (b, 2));
        assert_eq!(pieces[1].text, "");
        assert_eq!(pieces[2].text, "hello");
    }

    #[test]
    fn a_malformed_piece_keeps_those_before_it_and_trusts_nothing_after() {
        let a = TaskId::parse("6f1c2d3e-4b5a-4c7d-8e9f-0a1b2c3d4e5f").unwrap();
        // A length past the end, one inside a character, a header without a length.
        for bad in ["{a} 7 4 99\nshort", "{a} 7 4 1\né", "{a} 7 4\nx"] {
            let bad = bad.replace("{a}", &a.to_string());
            let pieces = parse_live_pieces(&format!("{a} 7 3 2\nok{bad}{a} 7 5 1\nz"));
            assert_eq!(pieces.len(), 1, "{bad}: {pieces:#?}");
            assert_eq!(pieces[0].text, "ok");
        }
        assert!(parse_live_pieces("").is_empty());
        assert!(parse_live_pieces("garbage").is_empty());
    }
}
