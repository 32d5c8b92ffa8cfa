//! What the mock reads of a client's asks about background responses: a create's body (the
//! fields it serves, the problem named when it serves none) and a retrieve's resume query
//! (`stream`, `starting_after`). Apart from the book because these are parsing only.

use std::collections::HashMap;

use serde::Deserialize;

/// The part of a `POST /v1/responses` body the mock reads; other fields (`store`, ...) are
/// accepted and ignored, as OpenAI-compatible servers do.
#[derive(Debug, Clone, Deserialize)]
pub struct CreateRequest {
    pub model: Option<String>,
    pub input: Vec<InputMessage>,
    pub background: Option<bool>,
    /// Whether the create is answered with the response's event stream.
    pub stream: Option<bool>,
    /// Counted against a token limit (the reply itself is not cut to it).
    pub max_output_tokens: Option<u32>,
}

impl CreateRequest {
    pub fn streamed(&self) -> bool {
        self.stream == Some(true)
    }
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

/// Where a resumed stream starts: the `stream` and `starting_after` query parameters of
/// `GET /v1/responses/{id}`. `None` for a plain retrieve; else the first sequence number to
/// send. A value that is not one the API takes is named.
pub fn parse_resume(query: &HashMap<String, String>) -> Result<Option<u64>, String> {
    let streamed = match query.get("stream").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(format!(
                "Invalid value for 'stream': expected a boolean, got '{other}'."
            ));
        }
    };
    if !streamed {
        return Ok(None);
    }
    match query.get("starting_after") {
        None => Ok(Some(0)),
        Some(after) => after
            .parse::<u64>()
            .map(|after| Some(after.saturating_add(1)))
            .map_err(|_| {
                format!("Invalid value for 'starting_after': expected an integer, got '{after}'.")
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock_provider::background::object::not_streamable_body;

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
        assert!(!ok.streamed());
        let streamed = parse_create(
            br#"{"input":[{"role":"user","content":"hi"}],"background":true,"stream":true}"#,
        )
        .unwrap();
        assert!(streamed.streamed());
    }

    #[test]
    fn a_resume_is_asked_with_stream_and_starting_after() {
        let query = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        assert_eq!(parse_resume(&query(&[])), Ok(None));
        assert_eq!(parse_resume(&query(&[("stream", "false")])), Ok(None));
        assert_eq!(parse_resume(&query(&[("stream", "true")])), Ok(Some(0)));
        assert_eq!(
            parse_resume(&query(&[("stream", "true"), ("starting_after", "7")])),
            Ok(Some(8))
        );
        assert!(
            parse_resume(&query(&[("stream", "true"), ("starting_after", "-1")]))
                .unwrap_err()
                .contains("starting_after")
        );
        assert!(
            parse_resume(&query(&[("stream", "yes")]))
                .unwrap_err()
                .contains("'stream'")
        );
        assert_eq!(
            not_streamable_body()["error"]["type"],
            "invalid_request_error"
        );
    }
}
