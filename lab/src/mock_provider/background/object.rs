//! The JSON the mock answers for a background response: the response object (as a retrieve
//! returns it and as the stream's events carry it), its one output item and text part, and
//! OpenAI's refusal to stream a response created without `stream`. Apart from the book so the
//! wire shapes read in one place.

use serde_json::{Value, json};

use super::state::{ResponseEntry, ResponseState};

/// The id of a response's one output item.
pub(super) fn item_id(id: &str) -> String {
    format!("msg_{id}")
}

/// The response's one output item: an assistant message.
pub(super) fn message_item(id: &str, status: &str, content: Value) -> Value {
    json!({
        "type": "message",
        "id": item_id(id),
        "status": status,
        "role": "assistant",
        "content": content,
    })
}

/// A text part of the output item.
pub(super) fn output_text(text: &str) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [] })
}

/// OpenAI's refusal to stream a response that was not created streaming.
pub fn not_streamable_body() -> Value {
    json!({
        "error": {
            "message": "This response cannot be streamed because it was not created with stream=true.",
            "type": "invalid_request_error",
            "param": "stream",
            "code": "invalid_request_error",
        }
    })
}

/// The response object the API answers for `entry`.
pub fn response_object(id: &str, entry: &ResponseEntry) -> Value {
    let (model, output, usage, error) = match &entry.state {
        ResponseState::Completed(out) => (
            out.model.as_str(),
            json!([message_item(
                id,
                "completed",
                json!([output_text(&out.text)])
            )]),
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
    use crate::mock_provider::background::state::output;

    #[test]
    fn the_response_object_shows_output_only_when_completed() {
        let mut entry = ResponseEntry {
            model: "asked".into(),
            state: ResponseState::Queued,
            key: None,
            events: None,
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
}
