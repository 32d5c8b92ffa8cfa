//! Errors of the HTTP API as problem details (RFC 9457, `application/problem+json`): a stable
//! `type` per kind of problem, a human `title`, the status, and a `detail` that names what is
//! wrong. Every refusal is counted by its kind in `replyd_api_refusals_total`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::telemetry;

/// Every kind of problem the API answers with, a closed set: its name is the last segment of
/// a problem's `type`, the `kind` label of `replyd_api_refusals_total`, and a value of the
/// OpenAPI document's `ProblemKind`, from which the TypeScript client's type is generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ProblemKind {
    /// A body (declared or read) over `api.max_body_bytes` (413).
    BodyTooLarge,
    /// More header fields than `api.max_headers`, or headers over `api.max_header_bytes` (431).
    HeadersTooLarge,
    /// New work in a conversation (or workspace) that was erased (410).
    ConversationErased,
    /// An `Idempotency-Key` used before with other inputs (422).
    IdempotencyKeyReused,
    /// An end user's token on a route only the workspace's key may call (403).
    Forbidden,
    /// `Authorization` that is not one bearer key (400).
    InvalidAuthorization,
    /// A body, or the task it makes, the API will not take (422).
    InvalidBody,
    /// An `Idempotency-Key` that breaks its rules, or more than one (400).
    InvalidIdempotencyKey,
    /// A path segment that is not UTF-8 once percent-decoded, or holds a NUL (400).
    InvalidPath,
    /// A query parameter out of its bounds, or a cursor this API did not give (400).
    InvalidQuery,
    /// A task id in the path that is not a UUID (400).
    InvalidTaskId,
    /// A body that is not JSON (400).
    MalformedJson,
    /// A request head the server cannot parse (400).
    MalformedRequest,
    /// A route that does not take the method (405).
    MethodNotAllowed,
    /// No such route, or no such task in the caller's workspace (404).
    NotFound,
    /// New work outside the workspace's policy: a model not allowed, output over the cap (422).
    OutsideWorkspacePolicy,
    /// New work over the workspace's quota (429).
    QuotaExceeded,
    /// An API key over its request rate (429).
    RateLimited,
    /// A task whose Kafka record would be over `kafka.max_record_bytes` (422).
    RecordTooLarge,
    /// A cancel of a task that had already ended with its reply or a failure (409).
    TaskFinished,
    /// No API key, or an unknown or revoked one (401).
    Unauthorized,
    /// The database cannot be reached (503).
    Unavailable,
    /// A body that is not `application/json` (415).
    UnsupportedMediaType,
    /// A request target over the server's limit (414).
    UriTooLong,
}

impl ProblemKind {
    /// Every kind, in the order of the enum.
    pub const ALL: [ProblemKind; 24] = [
        ProblemKind::BodyTooLarge,
        ProblemKind::HeadersTooLarge,
        ProblemKind::ConversationErased,
        ProblemKind::IdempotencyKeyReused,
        ProblemKind::Forbidden,
        ProblemKind::InvalidAuthorization,
        ProblemKind::InvalidBody,
        ProblemKind::InvalidIdempotencyKey,
        ProblemKind::InvalidPath,
        ProblemKind::InvalidQuery,
        ProblemKind::InvalidTaskId,
        ProblemKind::MalformedJson,
        ProblemKind::MalformedRequest,
        ProblemKind::MethodNotAllowed,
        ProblemKind::NotFound,
        ProblemKind::OutsideWorkspacePolicy,
        ProblemKind::QuotaExceeded,
        ProblemKind::RateLimited,
        ProblemKind::RecordTooLarge,
        ProblemKind::TaskFinished,
        ProblemKind::Unauthorized,
        ProblemKind::Unavailable,
        ProblemKind::UnsupportedMediaType,
        ProblemKind::UriTooLong,
    ];

    /// The kind's stable name (`quota_exceeded`).
    pub fn as_str(self) -> &'static str {
        match self {
            ProblemKind::BodyTooLarge => "body_too_large",
            ProblemKind::HeadersTooLarge => "headers_too_large",
            ProblemKind::ConversationErased => "conversation_erased",
            ProblemKind::IdempotencyKeyReused => "idempotency_key_reused",
            ProblemKind::Forbidden => "forbidden",
            ProblemKind::InvalidAuthorization => "invalid_authorization",
            ProblemKind::InvalidBody => "invalid_body",
            ProblemKind::InvalidIdempotencyKey => "invalid_idempotency_key",
            ProblemKind::InvalidPath => "invalid_path",
            ProblemKind::InvalidQuery => "invalid_query",
            ProblemKind::InvalidTaskId => "invalid_task_id",
            ProblemKind::MalformedJson => "malformed_json",
            ProblemKind::MalformedRequest => "malformed_request",
            ProblemKind::MethodNotAllowed => "method_not_allowed",
            ProblemKind::NotFound => "not_found",
            ProblemKind::OutsideWorkspacePolicy => "outside_workspace_policy",
            ProblemKind::QuotaExceeded => "quota_exceeded",
            ProblemKind::RateLimited => "rate_limited",
            ProblemKind::RecordTooLarge => "record_too_large",
            ProblemKind::TaskFinished => "task_finished",
            ProblemKind::Unauthorized => "unauthorized",
            ProblemKind::Unavailable => "unavailable",
            ProblemKind::UnsupportedMediaType => "unsupported_media_type",
            ProblemKind::UriTooLong => "uri_too_long",
        }
    }
}

// A kind added to the enum but not to `ALL` fails to build here.
const _: () = {
    const fn listed(kind: ProblemKind) -> usize {
        match kind {
            ProblemKind::BodyTooLarge => 0,
            ProblemKind::HeadersTooLarge => 1,
            ProblemKind::ConversationErased => 2,
            ProblemKind::IdempotencyKeyReused => 3,
            ProblemKind::Forbidden => 4,
            ProblemKind::InvalidAuthorization => 5,
            ProblemKind::InvalidBody => 6,
            ProblemKind::InvalidIdempotencyKey => 7,
            ProblemKind::InvalidPath => 8,
            ProblemKind::InvalidQuery => 9,
            ProblemKind::InvalidTaskId => 10,
            ProblemKind::MalformedJson => 11,
            ProblemKind::MalformedRequest => 12,
            ProblemKind::MethodNotAllowed => 13,
            ProblemKind::NotFound => 14,
            ProblemKind::OutsideWorkspacePolicy => 15,
            ProblemKind::QuotaExceeded => 16,
            ProblemKind::RateLimited => 17,
            ProblemKind::RecordTooLarge => 18,
            ProblemKind::TaskFinished => 19,
            ProblemKind::Unauthorized => 20,
            ProblemKind::Unavailable => 21,
            ProblemKind::UnsupportedMediaType => 22,
            ProblemKind::UriTooLong => 23,
        }
    }
    let mut i = 0;
    while i < ProblemKind::ALL.len() {
        assert!(listed(ProblemKind::ALL[i]) == i);
        i += 1;
    }
};

/// One problem; `kind` names it in its `type` URI and the metric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub status: StatusCode,
    pub kind: ProblemKind,
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
    /// A URI naming the kind of problem; its last segment is a `ProblemKind` (e.g.
    /// `invalid_body`).
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
        kind: ProblemKind,
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

    /// A credential that is missing, unknown, revoked or expired (`401 unauthorized`).
    pub fn unauthorized(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            ProblemKind::Unauthorized,
            "Unauthorized",
            detail,
        )
    }

    /// A credential that is good but may not do this (`403 forbidden`).
    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            ProblemKind::Forbidden,
            "Forbidden",
            detail,
        )
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            ProblemKind::NotFound,
            "Not found",
            detail,
        )
    }

    pub fn bad_request(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, kind, "Bad request", detail)
    }

    /// A body (or what it makes) the API will not take (`422 invalid_body`).
    pub fn invalid_body(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::InvalidBody,
            "Invalid body",
            detail,
        )
    }

    pub fn unavailable(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ProblemKind::Unavailable,
            "Service unavailable",
            detail,
        )
    }

    /// The `503` of a store call that failed: the error and its causes are the detail.
    pub fn store_unavailable(error: crate::store::StoreError) -> Self {
        Self::unavailable(telemetry::chain(&error))
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
            kind: format!("https://replyd.dev/problems/{}", self.kind.as_str()),
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
        telemetry::api_refused(self.kind.as_str(), self.status.as_u16());
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
