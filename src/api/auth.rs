//! Authentication: every API call carries `Authorization: Bearer <API key>`; the workspace
//! comes from the key, never from the request body. Unknown, revoked and wrong keys all get
//! the same `401`, so the answer does not tell which part was wrong.

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;

use super::ApiState;
use super::problem::Problem;
use crate::api_key::{AuthError, parse_bearer};

/// The caller's workspace, from its key.
#[derive(Debug, Clone)]
pub struct Workspace(pub String);

fn unauthorized(error: AuthError) -> Problem {
    Problem::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "Unauthorized",
        error.to_string(),
    )
}

impl FromRequestParts<ApiState> for Workspace {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, Problem> {
        let header = parts.headers.get(AUTHORIZATION).map(|v| v.as_bytes());
        let presented = parse_bearer(header).map_err(unauthorized)?;
        match state.store.authenticate(&presented).await {
            Ok(Some(workspace)) => Ok(Workspace(workspace)),
            Ok(None) => Err(unauthorized(AuthError::Unknown)),
            Err(e) => Err(Problem::unavailable(format!(
                "cannot check the API key now: {}",
                crate::telemetry::chain(&e)
            ))),
        }
    }
}
