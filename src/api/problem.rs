//! Errors of the HTTP API as problem details (RFC 9457, `application/problem+json`): a stable
//! `type` per kind of problem, a human `title`, the status, and a `detail` that names what is
//! wrong. Every refusal is counted by its kind in `replyd_api_refusals_total`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::telemetry;

/// One problem; `kind` is also the last segment of its `type` URI and the metric label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub status: StatusCode,
    pub kind: &'static str,
    pub title: &'static str,
    pub detail: String,
    /// The fields at fault (a field over its bound, the fields of a mismatch).
    pub fields: Vec<&'static str>,
    /// Seconds for a `Retry-After` header (a `429`).
    pub retry_after: Option<u64>,
}

/// A problem as it goes over the wire (RFC 9457).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ProblemDetails {
    /// A URI naming the kind of problem; its last segment is stable (e.g. `invalid_body`).
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    /// The HTTP status code.
    pub status: u16,
    /// What is wrong, for a person.
    pub detail: String,
    /// The fields at fault: the body's fields an `invalid_body` names (one over its bound,
    /// say), or the inputs that differ when an `Idempotency-Key` was reused with other inputs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<String>,
}

impl Problem {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            title,
            detail: detail.into(),
            fields: Vec::new(),
            retry_after: None,
        }
    }

    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    pub fn with_fields(mut self, fields: Vec<&'static str>) -> Self {
        self.fields = fields;
        self
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "Not found", detail)
    }

    pub fn bad_request(kind: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, kind, "Bad request", detail)
    }

    /// A body (or what it makes) the API will not take (`422 invalid_body`).
    pub fn invalid_body(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
            "Invalid body",
            detail,
        )
    }

    pub fn unavailable(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "Service unavailable",
            detail,
        )
    }
}

/// `Retry-After` in whole seconds, rounded up and never 0 (a client would ask again at once).
pub fn retry_after_seconds(wait: std::time::Duration) -> u64 {
    wait.as_secs_f64().ceil().max(1.0) as u64
}

impl Problem {
    /// The problem's body, as JSON.
    pub fn body(&self) -> Vec<u8> {
        let body = ProblemDetails {
            kind: format!("https://replyd.dev/problems/{}", self.kind),
            title: self.title.to_owned(),
            status: self.status.as_u16(),
            detail: self.detail.clone(),
            fields: self.fields.iter().map(|f| (*f).to_owned()).collect(),
        };
        // Serializing strings and numbers cannot fail.
        serde_json::to_vec(&body).expect("a problem serializes")
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        telemetry::api_refused(self.kind, self.status.as_u16());
        let mut response = (self.status, self.body()).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(seconds) = self.retry_after {
            // Digits are a valid header value.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_whole_seconds_and_never_zero() {
        assert_eq!(retry_after_seconds(std::time::Duration::from_millis(1)), 1);
        assert_eq!(
            retry_after_seconds(std::time::Duration::from_millis(1_001)),
            2
        );
        assert_eq!(retry_after_seconds(std::time::Duration::from_secs(3)), 3);
    }
}
