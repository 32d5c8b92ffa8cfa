//! Authentication: every API call carries `Authorization: Bearer <API key>` or `Bearer <end
//! user's token>` ([`Caller`]); the workspace comes from the key or the token, never from the
//! request body. Unknown, revoked and wrong keys all get
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
use replyd_core::end_user::{self, TokenError};

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

/// Who calls: the workspace, with its key, or one of its end users, with a token the
/// workspace's backend asked for (`replyd_core::end_user`). The routes an end user may call
/// take a `Caller` and show it only its own conversations; the others take a [`Workspace`].
#[derive(Debug, Clone)]
pub struct Caller {
    pub workspace: String,
    /// The end user whose token this is; `None` for the workspace's key.
    pub end_user: Option<EndUser>,
}

/// An end user, as their token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndUser {
    pub id: String,
    /// The user's token generation the token carries: a revocation moves it on.
    pub generation: i64,
    /// When the token ends, seconds since the epoch.
    pub expires_at: i64,
}

impl Caller {
    /// Whether this caller may see a conversation whose owner is `owner` (`None`: it has no
    /// row; `Some(None)`: begun with the workspace's key): the key sees every one, an end user
    /// only theirs.
    pub fn sees(&self, owner: Option<&Option<String>>) -> bool {
        match &self.end_user {
            None => true,
            Some(user) => owner.is_some_and(|o| o.as_deref() == Some(user.id.as_str())),
        }
    }
}

impl FromRequestParts<ApiState> for Workspace {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, Problem> {
        let caller = Caller::from_request_parts(parts, state).await?;
        match caller.end_user {
            None => Ok(Workspace(caller.workspace)),
            Some(_) => Err(Problem::new(
                StatusCode::FORBIDDEN,
                ProblemKind::Forbidden,
                "Forbidden",
                "an end user's token may create, read, follow and stop replies in its user's conversations; this route takes the workspace's API key",
            )),
        }
    }
}

impl FromRequestParts<ApiState> for Caller {
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
        if let Some(token) = bearer_token(header.map(|v| v.as_bytes())) {
            return end_user(state, token).await;
        }
        let presented = parse_bearer(header.map(|v| v.as_bytes())).map_err(unauthorized)?;
        match state.store.authenticate(&presented).await {
            Ok(Some(workspace)) => {
                rate_limited(state, &presented.key_id, "this API key")?;
                Ok(Caller {
                    workspace,
                    end_user: None,
                })
            }
            Ok(None) => Err(unauthorized(AuthError::Unknown)),
            Err(e) => Err(Problem::unavailable(format!(
                "cannot check the API key now: {}",
                crate::telemetry::chain(&e)
            ))),
        }
    }
}

/// The bearer credential, when it is an end user's token rather than an API key.
fn bearer_token(header: Option<&[u8]>) -> Option<&str> {
    let header = std::str::from_utf8(header?).ok()?;
    let (scheme, credential) = header.trim().split_once(' ')?;
    let credential = credential.trim();
    (scheme.eq_ignore_ascii_case("bearer") && end_user::looks_like_token(credential))
        .then_some(credential)
}

/// The end user of a token: signed by its workspace's secret, not expired, not revoked.
async fn end_user(state: &ApiState, token: &str) -> Result<Caller, Problem> {
    let refused = |e: TokenError| {
        Problem::new(
            StatusCode::UNAUTHORIZED,
            ProblemKind::Unauthorized,
            "Unauthorized",
            e.to_string(),
        )
    };
    let (workspace, user) = end_user::named(token).map_err(refused)?;
    let check = state
        .store
        .token_check(&workspace, &user)
        .await
        .map_err(|e| {
            Problem::unavailable(format!(
                "cannot check the end-user token now: {}",
                crate::telemetry::chain(&e)
            ))
        })?
        // A workspace that never signed a token (or was erased) signed none of this one.
        .ok_or(TokenError::BadSignature)
        .map_err(refused)?;
    let now = chrono::Utc::now().timestamp();
    let claims = end_user::verify(token, &check.key(), now, check.generation).map_err(refused)?;
    rate_limited(
        state,
        &format!("user:{}:{}", claims.ws, claims.sub),
        "this end user",
    )?;
    Ok(Caller {
        workspace: claims.ws,
        end_user: Some(EndUser {
            id: claims.sub,
            generation: claims.generation,
            expires_at: claims.exp,
        }),
    })
}

/// A `429` when `who` (an API key, or an end user: each has its own bucket) is over its rate.
fn rate_limited(state: &ApiState, bucket: &str, who: &str) -> Result<(), Problem> {
    state.limiter.check(bucket).map_err(|wait| {
        let seconds = super::problem::retry_after_seconds(wait);
        Problem::new(
            StatusCode::TOO_MANY_REQUESTS,
            ProblemKind::RateLimited,
            "Too many requests",
            format!(
                "{who} is over api.rate_limit_per_second ({} a second, bursts of {}); ask again in {seconds} s",
                state.settings.rate_limit_per_second, state.settings.rate_limit_burst
            ),
        )
        .with_retry_after(seconds)
    })
}
