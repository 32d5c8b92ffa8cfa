//! The book of background responses: every response created and not yet forgotten, the
//! `Idempotency-Key` → response id map that makes a re-sent create find the first response
//! (I6), the retention after which an ended response is forgotten with its key, and each
//! streamed response's numbered event log, recorded as each step of its life happens.
//! Apart from the response object it records, which a plain retrieve answers too.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use serde_json::{Value, json};

use super::object::{item_id, message_item, output_text, response_object};
use super::state::{ResponseEntry, ResponseState};
use crate::mock_provider::stream::{Event, Part, StreamEnd};

// The log's recording lives with the book that writes it; the entry itself is a leaf's.
impl ResponseEntry {
    /// Appends an event to a streamed response's log, numbered by its place in it.
    fn record(&mut self, mut data: Value, part: Part) {
        if let Some(events) = &mut self.events {
            data["sequence_number"] = json!(events.len());
            events.push(Event::typed(&data, part));
        }
    }

    /// Records `response.<kind>` with the response object as it is now.
    fn record_state(&mut self, id: &str, kind: &str, part: Part) {
        if self.events.is_some() {
            let object = response_object(id, self);
            self.record(
                json!({ "type": format!("response.{kind}"), "response": object }),
                part,
            );
        }
    }
}

/// What a streamed response's log holds from a point on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replay {
    /// No such response (never created, or forgotten).
    Unknown,
    /// Created without `stream: true`: there is no stream to replay.
    NotStreamed,
    /// Its events from that point on, and how a stream of it ends once they are sent, if the
    /// response has ended.
    Events {
        events: Vec<Event>,
        ended: Option<StreamEnd>,
    },
}

/// What a create did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Creation {
    /// A new response with this id, queued: the caller must run its generation.
    New(String),
    /// The key's earlier response, whatever its state: no new generation.
    Existing(String),
}

/// Every response the mock has created and not yet forgotten, by id, and the first response of
/// each idempotency key.
#[derive(Debug, Default)]
pub struct ResponseBook {
    created: u64,
    by_id: HashMap<String, ResponseEntry>,
    by_key: HashMap<String, String>,
    /// How long an ended response is kept; `None`: for ever.
    retention: Option<Duration>,
    /// Ended responses, in the order they ended, which is the order they are forgotten in.
    ended: VecDeque<(Duration, String)>,
    forgotten: u64,
}

impl ResponseBook {
    /// A book that forgets a response `retention` after it ended (`None`: never).
    pub fn with_retention(retention: Option<Duration>) -> Self {
        Self {
            retention,
            ..Self::default()
        }
    }

    /// Creates a response `resp_<n>` for `model`, unless `honour_key` and `key` names an
    /// earlier one still kept, which is then returned instead. A `streamed` one keeps its events
    /// from its `response.created` on.
    pub fn create(
        &mut self,
        key: Option<&str>,
        honour_key: bool,
        model: &str,
        streamed: bool,
        now: Duration,
    ) -> Creation {
        self.forget_expired(now);
        let key = key.filter(|_| honour_key);
        if let Some(id) = key.and_then(|k| self.by_key.get(k)) {
            return Creation::Existing(id.clone());
        }
        self.created += 1;
        let id = format!("resp_{}", self.created);
        let mut entry = ResponseEntry {
            model: model.to_owned(),
            state: ResponseState::Queued,
            key: key.map(str::to_owned),
            events: streamed.then(Vec::new),
        };
        entry.record_state(&id, "created", Part::Head);
        self.by_id.insert(id.clone(), entry);
        if let Some(key) = key {
            self.by_key.insert(key.to_owned(), id.clone());
        }
        Creation::New(id)
    }

    /// `queued` → `in_progress` (recording `response.in_progress`); false (and no change) from
    /// any other state or for an unknown id.
    pub fn begin(&mut self, id: &str) -> bool {
        let begun = self.advance(
            id,
            |state| *state == ResponseState::Queued,
            ResponseState::InProgress,
        );
        if begun && let Some(entry) = self.by_id.get_mut(id) {
            entry.record_state(id, "in_progress", Part::Head);
        }
        begun
    }

    /// Records the opening of a streamed response's text: its output item and its text part.
    pub fn open_text(&mut self, id: &str) {
        let Some(entry) = self.by_id.get_mut(id) else {
            return;
        };
        entry.record(
            json!({
                "type": "response.output_item.added",
                "output_index": 0,
                "item": message_item(id, "in_progress", json!([])),
            }),
            Part::Head,
        );
        entry.record(
            json!({
                "type": "response.content_part.added",
                "item_id": item_id(id),
                "output_index": 0,
                "content_index": 0,
                "part": output_text(""),
            }),
            Part::Head,
        );
    }

    /// Records a piece of a streamed response's text.
    pub fn delta(&mut self, id: &str, piece: &str) {
        if let Some(entry) = self.by_id.get_mut(id) {
            entry.record(
                json!({
                    "type": "response.output_text.delta",
                    "item_id": item_id(id),
                    "output_index": 0,
                    "content_index": 0,
                    "delta": piece,
                }),
                Part::Delta,
            );
        }
    }

    /// Ends a response that has not ended yet at `now`, from which its retention counts;
    /// false (and no change) otherwise. A streamed response records its text's close and
    /// `response.completed`, or `response.failed`.
    pub fn finish(&mut self, id: &str, end: ResponseState, now: Duration) -> bool {
        debug_assert!(end.is_terminal(), "finish takes a terminal state");
        let ended = self.advance(id, |state| !state.is_terminal(), end);
        if !ended {
            return false;
        }
        if self.retention.is_some() {
            self.ended.push_back((now, id.to_owned()));
        }
        if let Some(entry) = self.by_id.get_mut(id) {
            match &entry.state {
                ResponseState::Completed(out) => {
                    let text = out.text.clone();
                    close_text(entry, id, &text);
                    entry.record_state(id, "completed", Part::Tail);
                }
                _ => entry.record_state(id, "failed", Part::Tail),
            }
        }
        true
    }

    /// A streamed response's events from sequence number `from` on, by `now`.
    pub fn replay(&mut self, id: &str, from: u64, now: Duration) -> Replay {
        let Some(entry) = self.get(id, now) else {
            return Replay::Unknown;
        };
        let Some(events) = &entry.events else {
            return Replay::NotStreamed;
        };
        let from = usize::try_from(from)
            .unwrap_or(usize::MAX)
            .min(events.len());
        let ended = match entry.state {
            ResponseState::Completed(_) => Some(StreamEnd::Completed),
            ResponseState::Failed { .. } => Some(StreamEnd::Errored),
            ResponseState::Queued | ResponseState::InProgress => None,
        };
        Replay::Events {
            events: events[from..].to_vec(),
            ended,
        }
    }

    /// The response `id`, if the mock created it and has not forgotten it by `now`.
    pub fn get(&mut self, id: &str, now: Duration) -> Option<&ResponseEntry> {
        self.forget_expired(now);
        self.by_id.get(id)
    }

    /// Responses forgotten after their retention.
    pub fn forgotten(&self) -> u64 {
        self.forgotten
    }

    /// Forgets every response that ended a whole retention ago or earlier, with its key.
    fn forget_expired(&mut self, now: Duration) {
        let Some(retention) = self.retention else {
            return;
        };
        while let Some((ended_at, _)) = self.ended.front() {
            if *ended_at + retention > now {
                break;
            }
            // `front` was just seen under the same borrow of `self`.
            let (_, id) = self.ended.pop_front().expect("front exists");
            let Some(entry) = self.by_id.remove(&id) else {
                continue;
            };
            self.forgotten += 1;
            // The key now maps to nothing: a create with it starts a new response.
            if let Some(key) = entry.key
                && self.by_key.get(&key) == Some(&id)
            {
                self.by_key.remove(&key);
            }
        }
    }

    fn advance(
        &mut self,
        id: &str,
        allowed: impl FnOnce(&ResponseState) -> bool,
        next: ResponseState,
    ) -> bool {
        match self.by_id.get_mut(id) {
            Some(entry) if allowed(&entry.state) => {
                entry.state = next;
                true
            }
            _ => false,
        }
    }
}

/// Records the close of a streamed response's text: the text done, its part done, its item
/// done.
fn close_text(entry: &mut ResponseEntry, id: &str, text: &str) {
    entry.record(
        json!({
            "type": "response.output_text.done",
            "item_id": item_id(id),
            "output_index": 0,
            "content_index": 0,
            "text": text,
        }),
        Part::Tail,
    );
    entry.record(
        json!({
            "type": "response.content_part.done",
            "item_id": item_id(id),
            "output_index": 0,
            "content_index": 0,
            "part": output_text(text),
        }),
        Part::Tail,
    );
    entry.record(
        json!({
            "type": "response.output_item.done",
            "output_index": 0,
            "item": message_item(id, "completed", json!([output_text(text)])),
        }),
        Part::Tail,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock_provider::background::state::{Output, output};

    #[test]
    fn a_response_goes_from_queued_through_in_progress_to_completed() {
        let mut book = ResponseBook::default();
        let t = Duration::ZERO;
        let Creation::New(id) = book.create(Some("k"), true, "m", false, t) else {
            panic!("the first create is new");
        };
        assert_eq!(id, "resp_1");
        assert_eq!(book.get(&id, t).unwrap().state, ResponseState::Queued);

        assert!(book.begin(&id));
        assert!(!book.begin(&id), "begins once");
        assert_eq!(book.get(&id, t).unwrap().state.status(), "in_progress");

        assert!(book.finish(&id, ResponseState::Completed(output("hi")), t));
        assert!(
            !book.finish(
                &id,
                ResponseState::Failed {
                    message: "late".into()
                },
                t
            ),
            "an ended response stays as it ended"
        );
        assert_eq!(
            book.get(&id, t).unwrap().state,
            ResponseState::Completed(output("hi"))
        );
        assert!(!book.begin("resp_404"));
        assert!(book.get("resp_404", t).is_none());
        // Without a retention, a response is kept for ever.
        assert!(book.get(&id, Duration::from_secs(86_400 * 365)).is_some());
    }

    #[test]
    fn an_ended_response_is_forgotten_with_its_key_after_its_retention() {
        let secs = Duration::from_secs;
        let mut book = ResponseBook::with_retention(Some(secs(600)));
        let Creation::New(id) = book.create(Some("k"), true, "m", false, secs(0)) else {
            panic!("new");
        };
        book.begin(&id);
        // Still generating long past the retention: a response in progress is always found.
        assert!(book.get(&id, secs(5_000)).is_some());
        assert!(book.finish(&id, ResponseState::Completed(output("hi")), secs(5_000)));
        assert!(book.get(&id, secs(5_599)).is_some());
        assert_eq!(
            book.create(Some("k"), true, "m", false, secs(5_599)),
            Creation::Existing(id.clone())
        );
        assert!(
            book.get(&id, secs(5_600)).is_none(),
            "gone at its retention"
        );
        assert_eq!(book.forgotten(), 1);
        assert_eq!(
            book.create(Some("k"), true, "m", false, secs(5_600)),
            Creation::New("resp_2".into()),
            "the key is forgotten with it"
        );
    }

    #[test]
    fn a_repeated_key_finds_the_first_response_unless_keys_are_ignored() {
        let mut book = ResponseBook::default();
        let t = Duration::ZERO;
        assert_eq!(
            book.create(Some("k"), true, "m", false, t),
            Creation::New("resp_1".into())
        );
        assert_eq!(
            book.create(Some("k"), true, "m", false, t),
            Creation::Existing("resp_1".into())
        );
        assert_eq!(
            book.create(Some("other"), true, "m", false, t),
            Creation::New("resp_2".into())
        );
        assert_eq!(
            book.create(None, true, "m", false, t),
            Creation::New("resp_3".into())
        );
        assert_eq!(
            book.create(None, true, "m", false, t),
            Creation::New("resp_4".into())
        );
        assert_eq!(
            book.create(Some("k"), false, "m", false, t),
            Creation::New("resp_5".into())
        );
    }

    fn data(event: &Event) -> Value {
        serde_json::from_str(&event.data).expect("JSON")
    }

    #[test]
    fn a_streamed_response_keeps_its_events_in_openais_order_numbered_from_zero() {
        let mut book = ResponseBook::default();
        let t = Duration::ZERO;
        let Creation::New(id) = book.create(None, false, "m", true, t) else {
            panic!("new");
        };
        book.begin(&id);
        book.open_text(&id);
        book.delta(&id, "hel");
        book.delta(&id, "lo");
        let done = Output {
            text: "hello".into(),
            model: "m".into(),
            input_tokens: 2,
            output_tokens: 1,
        };
        assert!(book.finish(&id, ResponseState::Completed(done), t));

        let Replay::Events { events, ended } = book.replay(&id, 0, t) else {
            panic!("a streamed response replays");
        };
        assert_eq!(ended, Some(StreamEnd::Completed));
        let names: Vec<&str> = events.iter().map(|e| e.name.as_deref().unwrap()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (n, event) in events.iter().enumerate() {
            assert_eq!(data(event)["sequence_number"], n);
            assert_eq!(data(event)["type"], event.name.as_deref().unwrap());
        }
        assert_eq!(
            events.iter().map(|e| e.part).collect::<Vec<_>>()[3..7],
            [Part::Head, Part::Delta, Part::Delta, Part::Tail]
        );
        assert_eq!(data(&events[0])["response"]["status"], "queued");
        assert_eq!(data(&events[0])["response"]["id"], id);
        assert_eq!(data(&events[1])["response"]["status"], "in_progress");
        assert_eq!(
            data(&events[4]),
            json!({"type":"response.output_text.delta","item_id":"msg_resp_1","output_index":0,
                   "content_index":0,"delta":"hel","sequence_number":4})
        );
        assert_eq!(data(&events[6])["text"], "hello");
        assert_eq!(data(&events[8])["item"]["status"], "completed");
        let completed = data(&events[9])["response"].clone();
        assert_eq!(
            completed,
            response_object(&id, book.get(&id, t).unwrap()),
            "the object a plain retrieve answers"
        );
        assert_eq!(completed["usage"]["total_tokens"], 3);

        let Replay::Events { events: rest, .. } = book.replay(&id, 8, t) else {
            panic!("replays");
        };
        assert_eq!(rest, events[8..]);
        let Replay::Events { events: none, .. } = book.replay(&id, 99, t) else {
            panic!("replays");
        };
        assert!(none.is_empty());
    }

    #[test]
    fn a_failed_stream_ends_with_response_failed_and_a_plain_one_cannot_be_replayed() {
        let mut book = ResponseBook::default();
        let t = Duration::ZERO;
        let Creation::New(id) = book.create(None, false, "m", true, t) else {
            panic!("new");
        };
        book.begin(&id);
        let Replay::Events { ended: None, .. } = book.replay(&id, 0, t) else {
            panic!("still going");
        };
        book.finish(
            &id,
            ResponseState::Failed {
                message: "boom".into(),
            },
            t,
        );
        let Replay::Events { events, ended } = book.replay(&id, 2, t) else {
            panic!("replays");
        };
        assert_eq!(ended, Some(StreamEnd::Errored));
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].name.as_deref(), Some("response.failed"));
        assert_eq!(data(&events[0])["response"]["error"]["message"], "boom");
        assert_eq!(data(&events[0])["sequence_number"], 2);

        let Creation::New(plain) = book.create(None, false, "m", false, t) else {
            panic!("new");
        };
        book.begin(&plain);
        book.delta(&plain, "ignored");
        assert_eq!(book.get(&plain, t).unwrap().events, None);
        assert_eq!(book.replay(&plain, 0, t), Replay::NotStreamed);
        assert_eq!(book.replay("resp_404", 0, t), Replay::Unknown);
    }
}
