//! The API served in-process on a free loopback port, over a test schema: what the intake,
//! quota, front-half and reconciler tests start the same way, and [`Api`], the intake and quota
//! tests' fixture.

use replyd::api::settings::ApiSettings;
use replyd::api::{ApiState, IntakeLimits, serve};
use replyd::store::Store;
use replyd_core::api_key::{IssuedKey, issue};
use replyd_core::quota::QuotaPolicy;
use serde_json::json;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::TestDb;

/// The API over its own test schema, with a workspace `acme` and a key of it. The intake tests
/// and the quota tests add the requests and the database reads each needs.
pub struct Api {
    pub db: TestDb,
    pub base: String,
    /// A key of workspace `acme`.
    pub key: String,
    /// Keeps up to 256 idle connections, for the tests that send hundreds of requests at once.
    pub client: reqwest::Client,
    _stop: DropGuard,
}

impl Api {
    /// Serves `settings` with `limits` and the quota `policy` on a new schema.
    pub async fn start(settings: ApiSettings, limits: IntakeLimits, policy: QuotaPolicy) -> Self {
        let db = TestDb::new().await;
        let key = workspace_with_key(&db.store, "acme").await;
        let mut state = ApiState::new(db.store.clone(), settings, limits);
        state.quota = policy;
        let (base, stop) = serve_on_loopback(state, CancellationToken::new()).await;
        Self {
            db,
            base,
            key: key.token,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(256)
                .build()
                .unwrap(),
            _stop: stop,
        }
    }

    /// A press with `acme`'s key ([`press`]).
    pub async fn press(&self, key: &str, message: &str) -> reqwest::Response {
        press(&self.client, &self.base, &self.key, key, message).await
    }
}

/// A press: `POST {base}/v1/replies` of `message` in conversation `conv-1` under the
/// idempotency key `key`, with the API key `token`.
pub async fn press(
    client: &reqwest::Client,
    base: &str,
    token: &str,
    key: &str,
    message: &str,
) -> reqwest::Response {
    client
        .post(format!("{base}/v1/replies"))
        .bearer_auth(token)
        .header("Idempotency-Key", key)
        .json(&json!({"conversation_id": "conv-1", "message": message}))
        .send()
        .await
        .unwrap()
}

/// A new workspace `workspace` with one API key; the key (`token`, `key_id`).
pub async fn workspace_with_key(store: &Store, workspace: &str) -> IssuedKey {
    store.create_workspace(workspace).await.unwrap();
    let key = issue(&mut rand::rng());
    assert!(store.create_api_key(workspace, &key).await.unwrap());
    key
}

/// The intake's bounds in these tests: 3 attempts a task, prompts of `max_prompt_bytes`.
pub fn limits(max_prompt_bytes: usize) -> IntakeLimits {
    IntakeLimits {
        max_attempts: 3,
        max_prompt_bytes,
        ..IntakeLimits::default()
    }
}

/// Serves `state` on a free loopback port until the guard is dropped; the base URL.
pub async fn serve_on_loopback(state: ApiState, stop: CancellationToken) -> (String, DropGuard) {
    let (addr, _) = serve("127.0.0.1:0".parse().unwrap(), state, stop.clone())
        .await
        .unwrap();
    (format!("http://{addr}"), stop.drop_guard())
}
