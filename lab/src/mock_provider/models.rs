//! The mock's `GET /v1/models`: the model list OpenAI's and Anthropic's APIs answer without
//! generating anything, in the profile's shape. Anthropic's requires `x-api-key` and
//! `anthropic-version` as its messages do; OpenAI's lists whatever the key may use.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::messages::refuse_headers;
use super::server::MockState;
use super::settings::MockProfile;

/// The models the mock lists: any model name is served, these are what it says it has.
const LISTED: &[&str] = &["mock-model", "mock-model-mini"];

pub(super) async fn list_models(
    State(state): State<Arc<MockState>>,
    headers: HeaderMap,
) -> Response {
    match state.profile() {
        MockProfile::AnthropicMessages => {
            if let Some(refusal) = refuse_headers(&headers) {
                return refusal;
            }
            let data: Vec<_> = LISTED
                .iter()
                .map(|id| json!({"type": "model", "id": id, "display_name": id, "created_at": "2025-01-01T00:00:00Z"}))
                .collect();
            axum::Json(json!({
                "data": data,
                "has_more": false,
                "first_id": LISTED.first(),
                "last_id": LISTED.last(),
            }))
            .into_response()
        }
        MockProfile::OpenAiChat | MockProfile::OpenAiResponses => {
            let data: Vec<_> = LISTED
                .iter()
                .map(|id| json!({"id": id, "object": "model", "created": 1_735_689_600, "owned_by": "mock"}))
                .collect();
            axum::Json(json!({"object": "list", "data": data})).into_response()
        }
    }
}
