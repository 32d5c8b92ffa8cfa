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
use super::rate_limit::{Note, Standing};
use super::state::ApiState;
use crate::store::workspaces::KeyCheck;
use replyd_core::api_key::{AuthError, parse_bearer};
use replyd_core::end_user::{self, TokenError};

/// The caller's workspace, from its key.
#[derive(Debug, Clone)]
pub struct Workspace(pub String);

/// Writes `key_id`'s last use, at most once a [`super::key_uses::INTERVAL`] per process, on a task of
/// its own: the request waits for no statement, and a failed write costs only the time shown.
fn note_use(state: &ApiState, key_id: &str) {
    if !state.key_uses.due(key_id, std::time::Instant::now()) {
        return;
    }
    let (store, key_id) = (state.store.clone(), key_id.to_owned());
    tokio::spawn(async move {
        if let Err(e) = store.note_api_key_use(&key_id).await {
            tracing::debug!(key_id, error = %crate::telemetry::chain(&e), "the key's last use was not written");
        }
    });
}

fn unauthorized(error: AuthError) -> Problem {
    Problem::unauthorized(error.to_string())
}

/// Who calls: the workspace, with its key, or one of its end users, with a token the
/// workspace's backend asked for (`replyd_core::end_user`). The routes an end user may call
/// take a `Caller` and show it only its own conversations; the others take a [`Workspace`].
#[derive(Debug, Clone)]
pub struct Caller {
    pub workspace: String,
    /// The end user whose token this is; `None` for the workspace's key.
    pub end_user: Option<EndUser>,
    /// The id of the API key the request was made with, or that asked for the end user's
    /// token.
    pub key_id: String,
}

/// An end user, as their token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndUser {
    pub id: String,
    /// The user's token generation the token carries: a revocation moves it on.
    pub generation: i64,
    /// When the token ends, seconds since the epoch.
    pub expires_at: i64,
    /// The version of the workspace's signing secret that signed it: a rotation retires it.
    pub version: i32,
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

/// The caller of a route that takes the workspace's key: its workspace and the key's id.
#[derive(Debug, Clone)]
pub struct KeyCaller {
    pub workspace: String,
    pub key_id: String,
}

impl FromRequestParts<ApiState> for KeyCaller {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, Problem> {
        let caller = Caller::from_request_parts(parts, state).await?;
        match caller.end_user {
            None => Ok(KeyCaller {
                workspace: caller.workspace,
                key_id: caller.key_id,
            }),
            Some(_) => Err(Problem::forbidden(
                "an end user's token may create, read, follow and stop replies in its user's conversations; this route takes the workspace's API key",
            )),
        }
    }
}

impl FromRequestParts<ApiState> for Workspace {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Self, Problem> {
        KeyCaller::from_request_parts(parts, state)
            .await
            .map(|caller| Workspace(caller.workspace))
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
        let note = parts.extensions.get::<Note>().cloned();
        if let Some(token) = bearer_token(header.map(|v| v.as_bytes())) {
            return end_user(state, token, note.as_ref()).await;
        }
        let presented = parse_bearer(header.map(|v| v.as_bytes())).map_err(unauthorized)?;
        match state.store.authenticate(&presented).await {
            Ok(KeyCheck::Live(workspace)) => {
                rate_limited(state, &presented.key_id, "this API key", note.as_ref())?;
                note_use(state, &presented.key_id);
                Ok(Caller {
                    workspace,
                    end_user: None,
                    key_id: presented.key_id,
                })
            }
            Ok(KeyCheck::Expired(at)) => Err(unauthorized(AuthError::Expired(
                at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            ))),
            Ok(KeyCheck::Unknown) => Err(unauthorized(AuthError::Unknown)),
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

/// The end user of a token. In order, so that a bearer that is not a live token costs no
/// database read and an end user's requests are limited before theirs do: it names a live
/// signing secret of its workspace (the process's copy, [`super::signing`]), its signature
/// verifies under it, its times hold (`api.end_user_token_max_ttl_seconds`); then its user's
/// rate limit; then one read: the user's generation and the key that asked for it.
async fn end_user(state: &ApiState, token: &str, note: Option<&Note>) -> Result<Caller, Problem> {
    let refused = |e: TokenError| Problem::unauthorized(e.to_string());
    let unavailable = |e: crate::store::StoreError| {
        Problem::unavailable(format!(
            "cannot check the end-user token now: {}",
            crate::telemetry::chain(&e)
        ))
    };
    if state.signing.sealing().is_none() {
        return Err(refused(TokenError::Disabled));
    }
    let named = end_user::named(token).map_err(refused)?;
    let secret = state
        .signing
        .secret(&state.store, &named.workspace, named.version)
        .await
        .map_err(unavailable)?
        // No live secret of that version: never made, retired by a rotation, or the workspace
        // was erased; none of them signed this token.
        .ok_or(TokenError::BadSignature)
        .map_err(refused)?;
    let now = chrono::Utc::now().timestamp();
    let max_lifetime = i64::from(state.settings.end_user_token_max_ttl_seconds);
    let claims = end_user::verify(token, &secret, now, max_lifetime).map_err(refused)?;
    rate_limited(
        state,
        &format!("user:{}:{}", claims.ws, claims.sub),
        "this end user",
        note,
    )?;
    let standing = state
        .store
        .token_standing(&claims.ws, &claims.sub, &claims.key)
        .await
        .map_err(unavailable)?;
    claims
        .standing(standing.generation, standing.key)
        .map_err(refused)?;
    Ok(Caller {
        workspace: claims.ws,
        key_id: claims.key,
        end_user: Some(EndUser {
            id: claims.sub,
            generation: claims.generation,
            expires_at: claims.exp,
            version: named.version,
        }),
    })
}

/// A `429` when `who` (an API key, or an end user: each has its own bucket) is over its rate;
/// where it stands either way goes in the request's `note`, for the response's headers.
fn rate_limited(
    state: &ApiState,
    bucket: &str,
    who: &str,
    note: Option<&Note>,
) -> Result<(), Problem> {
    let checked = state.limiter.check(bucket);
    if let (Some(note), Ok(Some(standing))) = (note, &checked) {
        note.set(*standing);
    }
    checked.map(|_| ()).map_err(|wait| {
        let seconds = super::problem::retry_after_seconds(wait);
        if let Some(note) = note {
            note.set(Standing {
                remaining: 0,
                reset_seconds: seconds,
            });
        }
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
