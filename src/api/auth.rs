//! Authentication: every API call carries `Authorization: Bearer <API key>`; the workspace
//! comes from the key, never from the request body. Unknown, revoked and wrong keys all get
//! the same `401`, so the answer does not tell which part was wrong. An authenticated key over
//! its request rate gets `429` (`rate_limited`, [`super::rate_limit`]).
//!
//! `Authorization` sent more than once with different values is a `400`
//! (`invalid_authorization`), not a `401`: which credential was meant is ambiguous, and that
//! is a fault of the request's shape, found before any key is looked up (so the answer says
//! nothing about either key). The same value repeated is that value.

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;

use super::problem::{Problem, ProblemKind};
use super::state::ApiState;
use replyd_core::api_key::{AuthError, parse_bearer};

/// The caller's workspace, from its key.
#[derive(Debug, Clone)]
pub struct Workspace(pub String);

fn unauthorized(error: AuthError) -> Problem {
    Problem::new(
        StatusCode::UNAUTHORIZED,
        ProblemKind::Unauthorized,
        "Unauthorized",
        error.to_string(),
    )
}

impl FromRequestParts<ApiState> for Workspace {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, Problem> {
        let header = super::headers::one_value(&parts.headers, AUTHORIZATION.as_str()).map_err(|distinct| {
            Problem::bad_request(
                ProblemKind::InvalidAuthorization,
                format!(
                    "the Authorization header is sent with {distinct} different values; send one credential"
                ),
            )
        })?;
        let presented = parse_bearer(header.map(|v| v.as_bytes())).map_err(unauthorized)?;
        match state.store.authenticate(&presented).await {
            Ok(Some(workspace)) => match state.limiter.check(&presented.key_id) {
                Ok(()) => Ok(Workspace(workspace)),
                Err(wait) => {
                    let seconds = super::problem::retry_after_seconds(wait);
                    Err(Problem::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        ProblemKind::RateLimited,
                        "Too many requests",
                        format!(
                            "this API key is over api.rate_limit_per_second ({} a second, bursts of {}); ask again in {seconds} s",
                            state.settings.rate_limit_per_second, state.settings.rate_limit_burst
                        ),
                    )
                    .with_retry_after(seconds))
                }
            },
            Ok(None) => Err(unauthorized(AuthError::Unknown)),
            Err(e) => Err(Problem::unavailable(format!(
                "cannot check the API key now: {}",
                crate::telemetry::chain(&e)
            ))),
        }
    }
}
