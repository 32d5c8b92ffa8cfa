//! The intake API over real HTTP on loopback, against the real PostgreSQL: one task per
//! logical request whatever the retries and races (I6), workspaces isolated, and every bad
//! input a problem+json 4xx that writes nothing.
//!
//! This file holds what the rooms share: a key of a workspace, the API started with settings
//! and limits, a press's body, and the rows a test counts. The rooms: [`idempotency`] (one
//! task per key, retries, regenerates, expired keys), [`bad_input`] (every bad body a problem
//! that writes nothing), [`http_limits`] (headers, bodies and connections at the HTTP layer),
//! [`rate_limit`] (a key over its request rate), [`server`] (`replyd api` serving and shutting
//! down), [`cors`] (browsers' origins) and [`conversations`] (listing and erasing a
//! conversation).

mod bad_input;
mod conversations;
mod cors;
mod http_limits;
mod idempotency;
mod rate_limit;
mod server;

use crate::helpers::api::Api;
use crate::helpers::{TestDb, api};
use replyd::api::IntakeLimits;
use replyd::api::settings::ApiSettings;
use replyd_core::quota::QuotaSettings;
use serde_json::{Value, json};

async fn key_for(db: &TestDb, workspace: &str) -> String {
    api::workspace_with_key(&db.store, workspace).await.token
}

async fn start_with(settings: ApiSettings) -> Api {
    start_with_limits(settings, api::limits(1000)).await
}

async fn start_with_limits(settings: ApiSettings, limits: IntakeLimits) -> Api {
    Api::start(settings, limits, QuotaSettings::default().policy()).await
}

async fn start() -> Api {
    start_with(ApiSettings {
        max_body_bytes: 4096,
        ..ApiSettings::default()
    })
    .await
}

fn body(message: &str) -> Value {
    json!({"conversation_id": "conv-1", "message": message, "document_version": "v7"})
}

impl Api {
    async fn post(&self, key: Option<&str>, auth: &str, body: &Value) -> reqwest::Response {
        let mut request = self
            .client
            .post(format!("{}/v1/replies", self.base))
            .bearer_auth(auth)
            .json(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        request.send().await.unwrap()
    }

    async fn counts(&self) -> (i64, i64, i64, i64) {
        let row = self
            .db
            .raw_client()
            .await
            .query_one(
                "SELECT (SELECT count(*) FROM messages), (SELECT count(*) FROM reply_tasks), \
                 (SELECT count(*) FROM idempotency_keys), (SELECT count(*) FROM outbox)",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1), row.get(2), row.get(3))
    }
}
