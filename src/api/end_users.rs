//! End users' tokens: `POST /v1/end-user-tokens` (the product's backend, with the workspace's
//! key, asks for a short-lived token for one of its users, which the user's browser holds
//! instead of the key) and `POST /v1/end-users/{user_id}/revoke` (every token of the user stops
//! working). Both take the workspace's key only: a token cannot make or revoke tokens.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::auth::{KeyCaller, Workspace};
use super::path::PathParam;
use super::problem::Problem;
use super::state::ApiState;
use crate::store::end_users::SigningKey;
use replyd_core::end_user;

/// A `422` naming `user_id` when it is not one the API takes.
fn checked_user_id(user_id: &str) -> Result<(), Problem> {
    end_user::check_user_id(user_id)
        .map_err(|detail| Problem::invalid_body(detail).with_fields(vec!["user_id"]))
}

/// Seconds a token lives when the request names none.
pub const DEFAULT_TTL_SECONDS: u32 = 15 * 60;

/// The body of `POST /v1/end-user-tokens`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateToken {
    /// The product's id of its user (not blank, at most 256 bytes, no control characters).
    /// The token sees this user's conversations only: those whose first message it sent.
    #[schema(min_length = 1, max_length = 256)]
    pub user_id: String,
    /// How long the token lives: at most `api.end_user_token_max_ttl_seconds`; 900 when absent.
    #[schema(minimum = 1)]
    pub ttl_seconds: Option<u32>,
}

/// A token for one end user.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EndUserToken {
    /// Send as `Authorization: Bearer <token>`. It may create replies in the user's
    /// conversations, read them, list them, follow their events and stop them; nothing else.
    pub token: String,
    /// Always `Bearer`.
    pub token_type: String,
    pub user_id: String,
    /// When it stops working; ask for a new one before.
    pub expires_at: DateTime<Utc>,
    /// Seconds from now until `expires_at`.
    pub expires_in: u32,
}

/// Ask for a short-lived token for one end user.
#[utoipa::path(
    post,
    operation_id = "createEndUserToken",
    path = "/v1/end-user-tokens",
    tag = "end users",
    request_body(content = CreateToken, content_type = "application/json"),
    responses(
        (status = 201, description = "The token: hand it to the user's browser, never the API key", body = EndUserToken),
        (status = 400, description = "The body is not JSON (`malformed_json`)"),
        (status = 403, description = "An end user's token: only the workspace's key makes tokens; or end-user tokens are off on this deployment (`api.end_user_token_key` unset) (`forbidden`)"),
        (status = 415, description = "The body is not sent as JSON (`unsupported_media_type`)"),
        (status = 422, description = "A bad `user_id`, or `ttl_seconds` outside 1 to `api.end_user_token_max_ttl_seconds` (`invalid_body`; `fields` names it)"),
    ),
    security(("api_key" = []))
)]
pub async fn create_token(
    State(state): State<ApiState>,
    caller: KeyCaller,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let KeyCaller { workspace, key_id } = caller;
    let made = async {
        let asked: CreateToken = super::json_body::parse_json(&state, &headers, body).await?;
        checked_user_id(&asked.user_id)?;
        let Some(sealing) = state.signing.sealing() else {
            return Err(Problem::forbidden(
                end_user::TokenError::Disabled.to_string(),
            ));
        };
        let max = state.settings.end_user_token_max_ttl_seconds;
        let ttl = asked.ttl_seconds.unwrap_or(DEFAULT_TTL_SECONDS.min(max));
        if !(1..=max).contains(&ttl) {
            return Err(Problem::invalid_body(format!(
                "`ttl_seconds` is {ttl}; it must be between 1 and {max} (api.end_user_token_max_ttl_seconds)"
            ))
            .with_fields(vec!["ttl_seconds"]));
        }
        let (version, secret) = match state
            .store
            .current_signing_key(&workspace, sealing)
            .await
            .map_err(Problem::store_unavailable)?
        {
            SigningKey::Current { version, secret } => (version, secret),
            SigningKey::NoWorkspace => {
                return Err(Problem::not_found(format!("no workspace {workspace}")));
            }
            // The deployment's configuration, not the request: said as it is, not as a 5xx.
            SigningKey::Unopened { version } => {
                return Err(Problem::forbidden(format!(
                    "the workspace's signing secret {version} does not open under api.end_user_token_key (the key changed?); an operator runs `replyd end-user-tokens rotate --workspace {workspace}`"
                )));
            }
        };
        let generation = state
            .store
            .token_standing(&workspace, &asked.user_id, &key_id)
            .await
            .map_err(Problem::store_unavailable)?
            .generation;
        let now = Utc::now();
        let token = end_user::mint(
            &secret,
            version,
            end_user::Issuer {
                workspace: &workspace,
                key_id: &key_id,
            },
            &asked.user_id,
            generation,
            now.timestamp(),
            i64::from(ttl),
        );
        state.signing.remember(&workspace, version, secret).await;
        crate::telemetry::end_user_token();
        Ok::<_, Problem>(EndUserToken {
            token,
            token_type: "Bearer".into(),
            user_id: asked.user_id,
            expires_at: now + chrono::TimeDelta::seconds(i64::from(ttl)),
            expires_in: ttl,
        })
    };
    made.await
        .map(|token| (StatusCode::CREATED, Json(token)))
        .into_response()
}

/// The end user whose tokens to revoke.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // documents the path; the handler reads it as a string
pub(super) struct UserIdPath {
    /// The product's id of its user.
    user_id: String,
}

/// The refusals every route of one end user (`/v1/end-users/{user_id}`) answers. Each
/// variant's doc comment is the answer's description.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)] // documents the answers; the handlers give them as a `Problem`
pub(super) enum UserIdRefusals {
    /// An end user's token (`forbidden`)
    #[response(status = 403)]
    Forbidden,
    /// An empty `user_id` (no such route, `not_found`)
    #[response(status = 404)]
    Empty,
    /// A bad `user_id` (`invalid_body`)
    #[response(status = 422)]
    Bad,
}

/// Revoke every token of an end user issued so far (the user signed out everywhere, or was
/// removed). Their open event streams end; tokens asked for afterwards work.
#[utoipa::path(
    post,
    operation_id = "revokeEndUserTokens",
    path = "/v1/end-users/{user_id}/revoke",
    tag = "end users",
    params(UserIdPath),
    responses(
        (status = 204, description = "Every token of the user issued before this is refused from now on (`401`)"),
        UserIdRefusals,
        (status = 503, description = "The database cannot be reached; revoking again is safe"),
    ),
    security(("api_key" = []))
)]
pub async fn revoke(
    State(state): State<ApiState>,
    Workspace(workspace): Workspace,
    PathParam(user_id): PathParam,
) -> Response {
    let revoked = async {
        checked_user_id(&user_id)?;
        state
            .store
            .revoke_end_user(&workspace, &user_id)
            .await
            .map_err(Problem::store_unavailable)?;
        Ok::<_, Problem>(())
    };
    revoked
        .await
        .map(|()| StatusCode::NO_CONTENT)
        .into_response()
}

/// What erasing an end user deleted.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErasedEndUser {
    pub user_id: String,
    /// The conversations the user began, each erased as `DELETE
    /// /v1/conversations/{conversation_id}` erases one.
    pub conversations: u64,
    /// Their tasks (with their replies and attempts).
    pub tasks: u64,
    /// Their messages.
    pub messages: u64,
    /// Tasks that had not finished: they ended now.
    pub ended: u64,
}

/// Erase an end user's data: every conversation they began, with its messages, tasks,
/// replies, attempts and idempotency records; their tokens are revoked first. Other users'
/// conversations and the workspace's own are not touched; quota charges stay.
#[utoipa::path(
    delete,
    operation_id = "eraseEndUser",
    path = "/v1/end-users/{user_id}",
    tag = "end users",
    params(UserIdPath),
    responses(
        (status = 200, description = "Erased (again: nothing more to delete, all counts 0). The user's tokens issued so far are refused; a new token may be asked for and begins afresh", body = ErasedEndUser),
        UserIdRefusals,
        super::conversations::ErasureUnavailable,
    ),
    security(("api_key" = []))
)]
pub async fn erase(
    State(state): State<ApiState>,
    Workspace(workspace): Workspace,
    PathParam(user_id): PathParam,
) -> Response {
    let erased = async {
        checked_user_id(&user_id)?;
        let done = crate::erasure::erase_end_user(&state.store, &workspace, &user_id)
            .await
            .map_err(Problem::store_unavailable)?;
        let forgotten = done.erased.forgotten;
        Ok::<_, Problem>(ErasedEndUser {
            user_id: user_id.clone(),
            conversations: done.conversations,
            tasks: forgotten.tasks,
            messages: forgotten.messages + done.erased.other_messages,
            ended: forgotten.charged + forgotten.released,
        })
    };
    erased.await.map(Json).into_response()
}
