//! `GET /v1/conversations/{conversation_id}/messages`: a conversation's messages in the order
//! they were written, each with its tasks' states and saved replies, page by page, so a client
//! can show a conversation again (another device, a reload). A page's `next_cursor` is where
//! the next one starts; paging while others write neither skips nor repeats a message
//! ([`crate::store::conversations`]).
//!
//! `DELETE /v1/conversations/{conversation_id}`: the conversation erased, as `replyd erase`
//! does it ([`crate::store::forgetting`]).

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::{Caller, Workspace};
use super::echo;
use super::path::PathParam;
use super::problem::{Problem, ProblemKind};
use super::reply_view::ReplyView;
use super::state::ApiState;

/// Messages a page holds when the client does not say.
const DEFAULT_LIMIT: i64 = 50;
/// The most messages a page may hold.
const MAX_LIMIT: i64 = 100;

/// One message, with its tasks (its reply, and any regenerated ones), oldest first.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct MessageView {
    pub message_id: uuid::Uuid,
    /// The user's message as it was sent.
    pub content: String,
    pub created_at: DateTime<Utc>,
    /// Its tasks, oldest first: the reply, then each regenerated one. The last is the newest.
    pub replies: Vec<ReplyView>,
}

/// One page of a conversation's messages.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct MessagePage {
    pub conversation_id: String,
    /// Oldest first.
    pub messages: Vec<MessageView>,
    /// Pass as `after` for the next page: after this page's last message (after the asked
    /// `after` when the page is empty; absent when it is empty and none was asked). Messages
    /// written later come after it too, so a client that reached the newest keeps it to ask
    /// for what comes next.
    pub next_cursor: Option<String>,
    /// Whether more messages followed this page when it was read.
    pub has_more: bool,
}

/// Where a page starts and how long it is.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// A `next_cursor` of an earlier page: the page starts after it. Absent: the oldest
    /// message.
    #[param(min_length = 1, max_length = 64)]
    after: Option<String>,
    /// Messages in the page, 1 to 100 (50 when absent).
    #[param(minimum = 1, maximum = 100)]
    limit: Option<i64>,
}

/// The `{conversation_id}` path segment.
#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // read by the handler's extractor; this type only documents it
pub(super) struct ConversationIdPath {
    /// The conversation, as its messages were sent (at most 256 bytes).
    #[param(max_length = 256)]
    conversation_id: String,
}

/// The cursor after message number `seq`: opaque to clients, stable across releases.
fn cursor_of(seq: i64) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("seq:{seq}"))
}

/// The message number a cursor names, if it is one this API gave.
fn seq_of(cursor: &str) -> Option<i64> {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(cursor)
        .ok()?;
    std::str::from_utf8(&bytes)
        .ok()?
        .strip_prefix("seq:")?
        .parse::<i64>()
        .ok()
        .filter(|seq| *seq >= 0)
}

fn invalid_query(detail: String) -> Problem {
    Problem::bad_request(ProblemKind::InvalidQuery, detail)
}

/// List a conversation's messages with their replies.
#[utoipa::path(
    get,
    operation_id = "listMessages",
    path = "/v1/conversations/{conversation_id}/messages",
    tag = "conversations",
    params(ConversationIdPath, PageQuery),
    responses(
        (status = 200, description = "A page of the conversation's messages, oldest first, each with its replies", body = MessagePage),
        (status = 400, description = "`after` is not a cursor this API gave, `limit` is not 1 to 100, or the query cannot be read (`invalid_query`)"),
        (status = 404, description = "No such conversation in the caller's workspace, or, for an end user's token, none of its user's (one is made by its first message sent through `POST /v1/replies`)"),
    ),
    security(("api_key" = []), ("end_user_token" = []))
)]
pub async fn list(
    State(state): State<ApiState>,
    caller: Caller,
    PathParam(conversation_id): PathParam,
    query: Result<Query<PageQuery>, QueryRejection>,
) -> Response {
    let listed = async {
        let Query(query) = query.map_err(|e| invalid_query(echo::message(&e.body_text())))?;
        let limit = query.limit.unwrap_or(DEFAULT_LIMIT);
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(invalid_query(format!(
                "limit {limit} is not 1 to {MAX_LIMIT}"
            )));
        }
        let after = match query.after.as_deref() {
            None => 0,
            Some(cursor) => seq_of(cursor).ok_or_else(|| {
                invalid_query(format!(
                    "after {} is not a cursor this API gave (a page's next_cursor)",
                    echo::quoted(cursor)
                ))
            })?,
        };
        let not_found = || {
            Problem::not_found(format!(
                "no conversation {}",
                echo::quoted(&conversation_id)
            ))
        };
        if conversation_id.len() > 256 {
            return Err(not_found());
        }
        let workspace = &caller.workspace;
        if caller.end_user.is_some() {
            // An end user lists their own conversations only; another's is not there.
            let owner = state
                .store
                .conversation_owner(workspace, &conversation_id)
                .await
                .map_err(Problem::store_unavailable)?;
            if !caller.sees(owner.as_ref()) {
                return Err(not_found());
            }
        }
        let page = state
            .store
            .conversation_page(workspace, &conversation_id, after, limit)
            .await
            .map_err(Problem::store_unavailable)?
            .ok_or_else(not_found)?;
        let next_cursor = page
            .messages
            .last()
            .map(|m| cursor_of(m.seq))
            .or(query.after.clone());
        Ok::<_, Problem>(MessagePage {
            conversation_id: conversation_id.clone(),
            messages: page
                .messages
                .iter()
                .map(|m| MessageView {
                    message_id: m.message_id,
                    content: m.content.clone(),
                    created_at: m.created_at,
                    replies: m.tasks.iter().map(ReplyView::of).collect(),
                })
                .collect(),
            next_cursor,
            has_more: page.more,
        })
    };
    listed.await.map(Json).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_names_its_message_and_nothing_else_is_one() {
        for seq in [0, 1, 50, i64::MAX] {
            assert_eq!(seq_of(&cursor_of(seq)), Some(seq));
        }
        for bad in ["", "42", "c2VxOi0x", "not base64!", "c2VxOmFi"] {
            assert_eq!(seq_of(bad), None, "{bad}");
        }
    }
}

/// What erasing a conversation deleted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct ErasedConversation {
    pub conversation_id: String,
    /// Tasks deleted (0 when it was erased before).
    pub tasks: u64,
    /// Messages deleted.
    pub messages: u64,
    /// Tasks still running or waiting that ended now: their reservations charged when the
    /// provider may have done the work, released otherwise.
    pub ended: u64,
}

/// The `503` of a route that erases (`crate::erasure`), a conversation's or an end user's. Its
/// description is given as `description`: a doc comment's line breaks would be kept in it.
#[derive(utoipa::IntoResponses)]
#[response(
    status = 503,
    description = "The database, or the erasure log (`database.erasure_log_url`), cannot be reached; nothing is erased until the log is written, and erasing again finishes the work"
)]
#[allow(dead_code)] // documents the answer; the handlers give it as a `Problem`
pub(super) struct ErasureUnavailable;

/// Erase a conversation.
#[utoipa::path(
    delete,
    operation_id = "eraseConversation",
    path = "/v1/conversations/{conversation_id}",
    tag = "conversations",
    params(ConversationIdPath),
    responses(
        (status = 200, description = "The conversation is erased: its messages, tasks, replies, attempts and idempotency records are deleted, a task still running ends (its reply, when its call returns, is not saved), and a record of it that comes later is refused. Its quota charges stay. New messages to it get `410` (`conversation_erased`). Erasing it again answers `200` with nothing deleted", body = ErasedConversation),
        (status = 403, description = "An end user's token: a conversation is erased with the workspace's key (`forbidden`)"),
        (status = 404, description = "No such conversation in the caller's workspace"),
        ErasureUnavailable,
    ),
    security(("api_key" = []))
)]
pub async fn erase(
    State(state): State<ApiState>,
    Workspace(workspace): Workspace,
    PathParam(conversation_id): PathParam,
) -> Response {
    let erased = async {
        if conversation_id.len() > 256
            || !state
                .store
                .conversation_known(&workspace, &conversation_id)
                .await
                .map_err(Problem::store_unavailable)?
        {
            return Err(Problem::not_found(format!(
                "no conversation {}",
                echo::quoted(&conversation_id)
            )));
        }
        let scope = crate::store::forgetting::ErasureScope {
            workspace_id: workspace.clone(),
            conversation_id: Some(conversation_id.clone()),
        };
        let erased = crate::erasure::erase(&state.store, &scope)
            .await
            .map_err(Problem::store_unavailable)?;
        Ok::<_, Problem>(ErasedConversation {
            conversation_id: conversation_id.clone(),
            tasks: erased.forgotten.tasks,
            messages: erased.forgotten.messages + erased.other_messages,
            ended: erased.forgotten.charged + erased.forgotten.released,
        })
    };
    erased.await.map(Json).into_response()
}
