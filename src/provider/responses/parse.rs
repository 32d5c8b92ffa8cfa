//! Reading a response object, pure: the answer to a create (the new response's id) and a
//! polled response (not yet, a generation, or the error its status means), with the wire
//! types they read. Apart from the calls so each status is tested without a server.

use reqwest::StatusCode;
use serde::Deserialize;

use super::errors::gone;
use crate::provider::generation::{Reply, content_refused, malformed, read_body, token_usage};
use replyd_core::provider::{Generation, OperationId, ProviderError};

/// What one poll found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Polled {
    /// `queued` or `in_progress`: poll again.
    Pending,
    /// Done with a reply (boxed: a generation with its rate signals is large, and most polls
    /// are `Pending`).
    Done(Box<Generation>),
}

/// Reads the answer to a create: the new response's id. Pure.
pub(crate) fn parse_created(bytes: &[u8]) -> Result<OperationId, ProviderError> {
    let response: WireResponse = read_body(bytes, "a response object")?;
    match response.id {
        Some(id) if !id.is_empty() => Ok(OperationId(id)),
        _ => Err(malformed("created response has no id")),
    }
}

/// Reads a polled response object into "not yet", a generation, or the error its status means
/// (see [`crate::provider::BackgroundProvider`] for the classes). `http_status` is the poll's status, carried by
/// the errors of the operation's own failure. Pure.
pub(crate) fn parse_response(
    http_status: StatusCode,
    bytes: &[u8],
    asked_model: &str,
) -> Result<Polled, ProviderError> {
    let response: WireResponse = read_body(bytes, "a response object")?;
    let id = OperationId(response.id.clone().unwrap_or_default());
    let status = response
        .status
        .as_deref()
        .ok_or_else(|| malformed("response object has no status"))?;
    let code = http_status.as_u16();
    match status {
        "queued" | "in_progress" => Ok(Polled::Pending),
        "completed" => {
            let text = reply_text(&response, code)?
                .ok_or_else(|| malformed("completed response has no output_text"))?;
            Ok(Polled::Done(Box::new(generation(
                response,
                text,
                asked_model,
            ))))
        }
        // Cut short (say, at max_output_tokens): the chat adapter keeps a reply cut by
        // `finish_reason: length`, and so does this one.
        "incomplete" => match reply_text(&response, code)? {
            Some(text) => Ok(Polled::Done(Box::new(generation(
                response,
                text,
                asked_model,
            )))),
            None => Err(ProviderError::Fatal {
                status: code,
                message: format!(
                    "response incomplete without output: {}",
                    response
                        .incomplete_details
                        .and_then(|d| d.reason)
                        .unwrap_or_else(|| "no reason given".into())
                ),
            }),
        },
        "failed" => {
            let error = response.error.unwrap_or_default();
            let message = format!(
                "operation {id} failed: {}",
                error.message.as_deref().unwrap_or("no message given")
            );
            if error.code.as_deref() == Some("server_error") {
                Err(ProviderError::MaybeExecuted {
                    status: code,
                    message,
                })
            } else {
                Err(ProviderError::Fatal {
                    status: code,
                    message,
                })
            }
        }
        "cancelled" | "expired" => Err(gone(&id, &format!("it was {status}"))),
        other => Err(malformed(format!("unknown response status `{other}`"))),
    }
}

/// The text of every `output_text` part of every message, in order; `None` when there is none.
/// A refusal part is a content refusal, as in the chat adapter.
fn reply_text(response: &WireResponse, http_status: u16) -> Result<Option<String>, ProviderError> {
    let mut text: Option<String> = None;
    let parts = response
        .output
        .iter()
        .filter(|item| item.kind == "message")
        .flat_map(|item| &item.content);
    for part in parts {
        match part.kind.as_str() {
            "output_text" => text
                .get_or_insert_with(String::new)
                .push_str(part.text.as_deref().unwrap_or("")),
            "refusal" => {
                return Err(content_refused(
                    http_status,
                    part.refusal.as_deref().unwrap_or("no reason given"),
                ));
            }
            _ => {}
        }
    }
    Ok(text)
}

fn generation(response: WireResponse, text: String, asked_model: &str) -> Generation {
    let reply = Reply {
        text,
        id: response.id,
        model: response.model,
        usage: response
            .usage
            .map(|u| token_usage(u.input_tokens, u.output_tokens)),
    };
    reply.generation(asked_model)
}

#[derive(Debug, Deserialize)]
struct WireResponse {
    id: Option<String>,
    status: Option<String>,
    model: Option<String>,
    // `null` and absent both mean no output yet.
    #[serde(default, deserialize_with = "null_as_empty")]
    output: Vec<WireOutputItem>,
    usage: Option<WireUsage>,
    error: Option<WireError>,
    incomplete_details: Option<WireIncomplete>,
}

#[derive(Debug, Deserialize)]
struct WireOutputItem {
    #[serde(rename = "type")]
    kind: String,
    // Items other than messages (reasoning, tool calls) may have no content.
    #[serde(default, deserialize_with = "null_as_empty")]
    content: Vec<WireContent>,
}

#[derive(Debug, Deserialize)]
struct WireContent {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    refusal: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireUsage {
    input_tokens: u32,
    output_tokens: u32,
}

#[derive(Debug, Default, Deserialize)]
struct WireError {
    code: Option<String>,
    message: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireIncomplete {
    reason: Option<String>,
}

fn null_as_empty<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Option::<Vec<T>>::deserialize(deserializer)?.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use replyd_core::provider::{RateSignals, Usage};

    fn parse(body: &str) -> Result<Polled, ProviderError> {
        parse_response(StatusCode::OK, body.as_bytes(), "asked")
    }

    #[test]
    fn a_completed_response_becomes_a_generation() {
        let body = r#"{"id":"resp_1","object":"response","status":"completed","model":"m-2025",
            "output":[{"type":"reasoning","summary":[]},
                      {"type":"message","role":"assistant","content":[
                          {"type":"output_text","text":"hel","annotations":[]},
                          {"type":"output_text","text":"lo"}]}],
            "usage":{"input_tokens":3,"output_tokens":1,"total_tokens":4},"error":null}"#;
        assert_eq!(
            parse(body).unwrap(),
            Polled::Done(Box::new(Generation {
                text: "hello".into(),
                model: "m-2025".into(),
                usage: Some(Usage {
                    prompt_tokens: 3,
                    completion_tokens: 1
                }),
                provider_response_id: Some("resp_1".into()),
                rate_signals: RateSignals::default(),
            }))
        );
    }

    #[test]
    fn queued_and_in_progress_responses_are_pending() {
        for status in ["queued", "in_progress"] {
            let body = format!(r#"{{"id":"resp_1","status":"{status}","output":null}}"#);
            assert_eq!(parse(&body).unwrap(), Polled::Pending, "{status}");
        }
    }

    /// What a `failed` response reads as, failed with the provider's `code` and `message`.
    fn failed(code: &str, message: &str) -> ProviderError {
        let error = serde_json::json!({"code": code, "message": message});
        parse(&format!(
            r#"{{"id":"resp_7","status":"failed","error":{error}}}"#
        ))
        .unwrap_err()
    }

    #[test]
    fn a_failed_response_is_fatal_with_the_providers_message() {
        let message = "operation resp_7 failed: prompt flagged".into();
        assert_eq!(
            failed("invalid_prompt", "prompt flagged"),
            ProviderError::Fatal {
                status: 200,
                message
            }
        );
    }

    #[test]
    fn a_response_failed_by_a_server_error_may_have_executed() {
        let message = "operation resp_7 failed: boom".into();
        let error = failed("server_error", "boom");
        assert_eq!(
            error,
            ProviderError::MaybeExecuted {
                status: 200,
                message
            }
        );
    }

    #[test]
    fn cancelled_and_expired_operations_are_gone() {
        for status in ["cancelled", "expired"] {
            let body = format!(r#"{{"id":"resp_2","status":"{status}"}}"#);
            let error = parse(&body).unwrap_err();
            let ProviderError::OperationGone { .. } = &error else {
                panic!("{status}: {error:?}");
            };
            assert!(
                error.to_string().contains("operation resp_2 is gone"),
                "{error}"
            );
        }
    }

    #[test]
    fn an_incomplete_response_keeps_its_text_or_is_fatal_without_it() {
        let cut = r#"{"id":"r","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},
            "output":[{"type":"message","content":[{"type":"output_text","text":"half"}]}]}"#;
        let Polled::Done(generation) = parse(cut).unwrap() else {
            panic!("a cut reply is a reply");
        };
        assert_eq!(generation.text, "half");
        assert_eq!(generation.model, "asked");
        let empty = r#"{"id":"r","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"}}"#;
        let error = parse(empty).unwrap_err();
        assert_eq!(error.kind(), "fatal");
        assert!(error.to_string().contains("max_output_tokens"), "{error}");
    }

    #[test]
    fn a_refusal_is_fatal() {
        let body = r#"{"id":"r","status":"completed",
            "output":[{"type":"message","content":[{"type":"refusal","refusal":"I can't"}]}]}"#;
        let error = parse(body).unwrap_err();
        assert_eq!(error.kind(), "fatal");
        assert!(error.to_string().contains("I can't"), "{error}");
    }

    #[test]
    fn objects_without_a_usable_status_or_output_are_malformed() {
        for body in [
            "not json",
            "{}",
            r#"{"id":"r","status":"thinking"}"#,
            r#"{"id":"r","status":"completed","output":[]}"#,
            r#"{"id":"r","status":"completed","output":[{"type":"reasoning"}]}"#,
        ] {
            let error = parse(body).unwrap_err();
            assert_eq!(error.kind(), "malformed_response", "{body}: {error}");
        }
    }

    #[test]
    fn a_create_answer_yields_the_operation_id() {
        assert_eq!(
            parse_created(br#"{"id":"resp_3","status":"queued"}"#).unwrap(),
            OperationId("resp_3".into())
        );
        for body in [&b"{}"[..], br#"{"id":""}"#, b"<html>"] {
            assert_eq!(
                parse_created(body).unwrap_err().kind(),
                "malformed_response"
            );
        }
    }
}
