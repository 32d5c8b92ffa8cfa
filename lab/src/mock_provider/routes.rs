//! Where the mock answers each API: at the paths the real providers serve it. OpenAI's and
//! Anthropic's own under `/v1`; the same OpenAI-compatible routes under Gemini's compatibility
//! root (`/v1beta/openai`) and Azure OpenAI's v1 API (`/openai/v1`); and Azure's classic
//! deployment route, `/openai/deployments/{deployment}/chat/completions`, which, as Azure
//! does, answers 404 `Resource not found` to a request without its `api-version` query. So a
//! client's base URL is tried against the paths it will meet: a wrong one finds no route.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;

use super::server::MockState;
use super::{chat, messages, models, responses};

/// The roots under which the OpenAI-compatible routes are served: OpenAI's, Gemini's
/// compatibility layer's, Azure OpenAI's v1 API's.
const OPENAI_ROOTS: &[&str] = &["/v1", "/v1beta/openai", "/openai/v1"];

/// The generating routes and the model lists, at every root that serves them.
pub(super) fn api_routes() -> Router<Arc<MockState>> {
    let mut router = Router::new()
        .route("/v1/messages", post(messages::create_message))
        .route(
            "/openai/deployments/{deployment}/chat/completions",
            post(azure_deployment_chat),
        );
    for root in OPENAI_ROOTS {
        router = router
            .route(
                &format!("{root}/chat/completions"),
                post(chat::chat_completions),
            )
            .route(
                &format!("{root}/responses"),
                post(responses::create_response),
            )
            .route(
                &format!("{root}/responses/{{id}}"),
                get(responses::get_response),
            )
            .route(&format!("{root}/models"), get(models::list_models));
    }
    router
}

/// Azure's classic chat completions of one deployment (the deployment answers whatever model
/// the body names, as the mock serves any model): the chat route, once the request names its
/// `api-version`.
async fn azure_deployment_chat(
    state: State<Arc<MockState>>,
    Path(_deployment): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !query.contains_key("api-version") {
        // Azure's answer to a data-plane request without its version.
        let body = json!({ "error": { "code": "404", "message": "Resource not found" } });
        return (StatusCode::NOT_FOUND, axum::Json(body)).into_response();
    }
    chat::chat_completions(state, headers, body).await
}
