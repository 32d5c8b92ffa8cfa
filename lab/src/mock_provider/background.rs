//! The mock's background responses, kept pure: the book of responses and their states
//! (`queued` → `in_progress` → `completed` or `failed`), the `Idempotency-Key` → response id
//! map that makes a re-sent create find the first response instead of generating again (I6),
//! the validation of a create body, and the JSON of a response object. The server module does
//! the I/O (the spawned generation, the routes, the counters) around it.
//!
//! A response can be retrieved only within its retention after it ended (OpenAI keeps one
//! about ten minutes unless stored): after it, the book forgets the response and its key, so a
//! lookup is 404 and a client that waited too long has no recovery left. Time is a monotonic
//! offset supplied by the caller.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};

/// The part of a `POST /v1/responses` body the mock reads; other fields (`store`, ...) are
/// accepted and ignored, as OpenAI-compatible servers do.
#[derive(Debug, Clone, Deserialize)]
pub struct CreateRequest {
    pub model: Option<String>,
    pub input: Vec<InputMessage>,
    pub background: Option<bool>,
    /// Counted against a token limit (the reply itself is not cut to it).
    pub max_output_tokens: Option<u32>,
}

/// One message of `input`; only the plain-string `content` form is served.
#[derive(Debug, Clone, Deserialize)]
pub struct InputMessage {
    pub role: String,
    pub content: String,
}

/// Reads a create body, naming the problem when it is not one the mock serves.
pub fn parse_create(body: &[u8]) -> Result<CreateRequest, String> {
    let request: CreateRequest =
        serde_json::from_slice(body).map_err(|e| format!("invalid request body: {e}"))?;
    if request.input.is_empty() {
        return Err("'input' must contain at least one message".into());
    }
    if request.background != Some(true) {
        return Err("'background' must be true: the mock serves background responses only".into());
    }
    Ok(request)
}

/// What a finished generation produced, as the response object reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub text: String,
    pub model: String,
    pub input_tokens: u32,
    pub output_tokens: u32,
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

    fn is_terminal(&self) -> bool {
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
    /// earlier one still kept, which is then returned instead.
    pub fn create(
        &mut self,
        key: Option<&str>,
        honour_key: bool,
        model: &str,
        now: Duration,
    ) -> Creation {
        self.forget_expired(now);
        let key = key.filter(|_| honour_key);
        if let Some(id) = key.and_then(|k| self.by_key.get(k)) {
            return Creation::Existing(id.clone());
        }
        self.created += 1;
        let id = format!("resp_{}", self.created);
        self.by_id.insert(
            id.clone(),
            ResponseEntry {
                model: model.to_owned(),
                state: ResponseState::Queued,
                key: key.map(str::to_owned),
            },
        );
        if let Some(key) = key {
            self.by_key.insert(key.to_owned(), id.clone());
        }
        Creation::New(id)
    }

    /// `queued` → `in_progress`; false (and no change) from any other state or for an unknown id.
    pub fn begin(&mut self, id: &str) -> bool {
        self.advance(
            id,
            |state| *state == ResponseState::Queued,
            ResponseState::InProgress,
        )
    }

    /// Ends a response that has not ended yet at `now`, from which its retention counts;
    /// false (and no change) otherwise.
    pub fn finish(&mut self, id: &str, end: ResponseState, now: Duration) -> bool {
        debug_assert!(end.is_terminal(), "finish takes a terminal state");
        let ended = self.advance(id, |state| !state.is_terminal(), end);
        if ended && self.retention.is_some() {
            self.ended.push_back((now, id.to_owned()));
        }
        ended
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

/// The response object the API answers for `entry`.
pub fn response_object(id: &str, entry: &ResponseEntry) -> Value {
    let (model, output, usage, error) = match &entry.state {
        ResponseState::Completed(out) => (
            out.model.as_str(),
            json!([{
                "type": "message",
                "id": format!("msg_{id}"),
                "status": "completed",
                "role": "assistant",
                "content": [{ "type": "output_text", "text": out.text, "annotations": [] }],
            }]),
            json!({
                "input_tokens": out.input_tokens,
                "output_tokens": out.output_tokens,
                "total_tokens": out.input_tokens + out.output_tokens,
            }),
            Value::Null,
        ),
        ResponseState::Failed { message } => (
            entry.model.as_str(),
            json!([]),
            Value::Null,
            json!({ "code": "server_error", "message": message }),
        ),
        ResponseState::Queued | ResponseState::InProgress => {
            (entry.model.as_str(), json!([]), Value::Null, Value::Null)
        }
    };
    json!({
        "id": id,
        "object": "response",
        "status": entry.state.status(),
        "background": true,
        "model": model,
        "output": output,
        "usage": usage,
        "error": error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(text: &str) -> Output {
        Output {
            text: text.into(),
            model: "m".into(),
            input_tokens: 2,
            output_tokens: 1,
        }
    }

    #[test]
    fn a_response_goes_from_queued_through_in_progress_to_completed() {
        let mut book = ResponseBook::default();
        let t = Duration::ZERO;
        let Creation::New(id) = book.create(Some("k"), true, "m", t) else {
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
        let Creation::New(id) = book.create(Some("k"), true, "m", secs(0)) else {
            panic!("new");
        };
        book.begin(&id);
        // Still generating long past the retention: a response in progress is always found.
        assert!(book.get(&id, secs(5_000)).is_some());
        assert!(book.finish(&id, ResponseState::Completed(output("hi")), secs(5_000)));
        assert!(book.get(&id, secs(5_599)).is_some());
        assert_eq!(
            book.create(Some("k"), true, "m", secs(5_599)),
            Creation::Existing(id.clone())
        );
        assert!(
            book.get(&id, secs(5_600)).is_none(),
            "gone at its retention"
        );
        assert_eq!(book.forgotten(), 1);
        assert_eq!(
            book.create(Some("k"), true, "m", secs(5_600)),
            Creation::New("resp_2".into()),
            "the key is forgotten with it"
        );
    }

    #[test]
    fn a_repeated_key_finds_the_first_response_unless_keys_are_ignored() {
        let mut book = ResponseBook::default();
        let t = Duration::ZERO;
        assert_eq!(
            book.create(Some("k"), true, "m", t),
            Creation::New("resp_1".into())
        );
        assert_eq!(
            book.create(Some("k"), true, "m", t),
            Creation::Existing("resp_1".into())
        );
        assert_eq!(
            book.create(Some("other"), true, "m", t),
            Creation::New("resp_2".into())
        );
        assert_eq!(
            book.create(None, true, "m", t),
            Creation::New("resp_3".into())
        );
        assert_eq!(
            book.create(None, true, "m", t),
            Creation::New("resp_4".into())
        );
        assert_eq!(
            book.create(Some("k"), false, "m", t),
            Creation::New("resp_5".into())
        );
    }

    #[test]
    fn the_response_object_shows_output_only_when_completed() {
        let mut entry = ResponseEntry {
            model: "asked".into(),
            state: ResponseState::Queued,
            key: None,
        };
        let queued = response_object("resp_1", &entry);
        assert_eq!(queued["status"], "queued");
        assert_eq!(queued["output"], json!([]));
        assert_eq!(queued["usage"], Value::Null);

        entry.state = ResponseState::Completed(output("hello"));
        let done = response_object("resp_1", &entry);
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["content"][0]["text"], "hello");
        assert_eq!(done["usage"]["output_tokens"], 1);

        entry.state = ResponseState::Failed {
            message: "down".into(),
        };
        let failed = response_object("resp_1", &entry);
        assert_eq!(failed["status"], "failed");
        assert_eq!(failed["error"]["code"], "server_error");
    }

    #[test]
    fn create_bodies_are_refused_with_the_problem_named() {
        let cases = [
            ("{not json", "invalid request body"),
            (r#"{"background":true}"#, "missing field `input`"),
            (r#"{"input":[],"background":true}"#, "'input' must contain"),
            (
                r#"{"input":"hi","background":true}"#,
                "invalid type: string",
            ),
            (
                r#"{"input":[{"role":"user","content":"hi"}]}"#,
                "'background' must be true",
            ),
        ];
        for (body, problem) in cases {
            let error = parse_create(body.as_bytes()).unwrap_err();
            assert!(error.contains(problem), "{body}: {error}");
        }
        let ok = parse_create(
            br#"{"model":"m","input":[{"role":"user","content":"hi"}],"background":true,
                "max_output_tokens":5}"#,
        )
        .unwrap();
        assert_eq!(ok.input[0].content, "hi");
    }
}
