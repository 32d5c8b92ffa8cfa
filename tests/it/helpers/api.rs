//! The API served in-process on a free loopback port, over a test schema: what the intake,
//! quota, front-half and reconciler tests start the same way, and [`Api`], the intake and quota
//! tests' fixture, and [`Front`], the fixture of the tests that run workers beside it.

use std::collections::BTreeMap;

use replyd::api::reply_view::{Accepted, ReplyStatus, ReplyView};
use replyd::api::settings::ApiSettings;
use replyd::api::{ApiState, IntakeLimits, serve};
use replyd::store::Store;
use replyd_core::api_key::{IssuedKey, issue};
use replyd_core::domain::TaskId;
use replyd_core::quota::QuotaPolicy;
use serde_json::json;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::TestDb;

/// The key end users' token secrets are sealed with in these tests (`api.end_user_token_key`).
pub const TOKEN_KEY: &str = "dGhlIHRlc3RzJyBzZWFsaW5nIGtleSwgMzIgYnl0ZXM=";

/// `settings` with the tests' sealing key, unless they name one (or, `Some("")`, none).
pub fn with_token_key(mut settings: ApiSettings) -> ApiSettings {
    match &settings.end_user_token_key {
        None => settings.end_user_token_key = Some(replyd_core::secret::Secret::new(TOKEN_KEY)),
        Some(key) if key.expose().is_empty() => settings.end_user_token_key = None,
        Some(_) => {}
    }
    settings
}

/// The API over its own test schema, with a workspace `acme` and a key of it. The intake tests
/// and the quota tests add the requests and the database reads each needs.
pub struct Api {
    pub db: TestDb,
    pub base: String,
    /// A key of workspace `acme`.
    pub key: String,
    /// Keeps up to 256 idle connections, for the tests that send hundreds of requests at once.
    pub client: reqwest::Client,
    /// The served API's copy of the signing secrets, to count its reads.
    pub signing: std::sync::Arc<replyd::api::signing::SigningKeys>,
    _stop: DropGuard,
}

impl Api {
    /// Serves `settings` with `limits` and the quota `policy` on a new schema.
    pub async fn start(settings: ApiSettings, limits: IntakeLimits, policy: QuotaPolicy) -> Self {
        let db = TestDb::new().await;
        let key = workspace_with_key(&db.store, "acme").await;
        let mut state = ApiState::new(db.store.clone(), with_token_key(settings), limits);
        state.quota = policy;
        let signing = state.signing.clone();
        let (base, stop) = serve_on_loopback(state, CancellationToken::new()).await;
        Self {
            db,
            base,
            key: key.token,
            signing,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(256)
                .build()
                .unwrap(),
            _stop: stop,
        }
    }

    /// Plays a worker's claim of the task.
    pub async fn claim(&self, task: TaskId) -> replyd_core::lease::Lease {
        let replyd_core::lease::ClaimOutcome::Claimed(lease) = self
            .db
            .store
            .claim(task, "w-test", std::time::Duration::from_secs(30))
            .await
            .unwrap()
        else {
            panic!("the task can be claimed");
        };
        lease
    }

    /// Plays a worker: claims the task and completes it (or fails it) through the fenced path.
    pub async fn finish(&self, task: TaskId, complete: bool) {
        let lease = self.claim(task).await;
        if complete {
            self.db
                .store
                .complete(&lease, "the answer", None)
                .await
                .unwrap();
        } else {
            self.db
                .store
                .fail(
                    &lease,
                    "the provider refused",
                    replyd_core::domain::AttemptOutcome::ProviderError,
                    replyd_core::domain::ProviderRan::No,
                )
                .await
                .unwrap();
        }
    }

    /// A token of `acme`'s end user `user`, asked for with the key as a product's backend
    /// asks for one.
    pub async fn end_user_token(&self, user: &str) -> String {
        let response = self
            .client
            .post(format!("{}/v1/end-user-tokens", self.base))
            .bearer_auth(&self.key)
            .json(&json!({"user_id": user}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "a token for {user}");
        let made: serde_json::Value = response.json().await.unwrap();
        made["token"].as_str().unwrap().to_owned()
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

/// A problem+json answer's status, `type`'s last segment and `detail`.
pub async fn problem(response: reqwest::Response) -> (u16, String, String) {
    let status = response.status().as_u16();
    let body: serde_json::Value = response.json().await.unwrap();
    let kind = body["type"].as_str().unwrap().rsplit('/').next().unwrap();
    (
        status,
        kind.to_owned(),
        body["detail"].as_str().unwrap_or_default().to_owned(),
    )
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

/// The HTTP front over a test app's schema, with one key per workspace: what the tests that
/// run real workers beside the API (forgetting, cancelling) send and read through.
pub struct Front {
    pub base: String,
    pub client: reqwest::Client,
    pub keys: BTreeMap<&'static str, String>,
    _stop: DropGuard,
}

/// Serves the API over `store`'s schema, with a new key for each of `workspaces`.
pub async fn front(store: &Store, workspaces: &[&'static str]) -> Front {
    let mut keys = BTreeMap::new();
    for ws in workspaces {
        keys.insert(*ws, workspace_with_key(store, ws).await.token);
    }
    Front::serve(store, keys, ApiSettings::default()).await
}

impl Front {
    async fn serve(
        store: &Store,
        keys: BTreeMap<&'static str, String>,
        settings: ApiSettings,
    ) -> Self {
        let state = ApiState::new(store.clone(), with_token_key(settings), limits(64 * 1024));
        let (base, stop) = serve_on_loopback(state, CancellationToken::new()).await;
        Self {
            base,
            client: reqwest::Client::new(),
            keys,
            _stop: stop,
        }
    }

    /// A second API server over the same schema, taking the same keys, with `settings`.
    pub async fn beside(&self, store: &Store, settings: ApiSettings) -> Self {
        Self::serve(store, self.keys.clone(), settings).await
    }

    /// `POST /v1/replies` of `body` under the idempotency key `key`.
    pub async fn post_body(
        &self,
        ws: &str,
        key: &str,
        body: &serde_json::Value,
    ) -> reqwest::Response {
        self.client
            .post(format!("{}/v1/replies", self.base))
            .bearer_auth(&self.keys[ws])
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    /// `POST /v1/replies/{id}/regenerate` under a new idempotency key, which must be accepted.
    pub async fn regenerate(&self, ws: &str, task: &Accepted) -> Accepted {
        let response = self
            .client
            .post(format!(
                "{}/v1/replies/{}/regenerate",
                self.base, task.task_id
            ))
            .bearer_auth(&self.keys[ws])
            .header("Idempotency-Key", uuid::Uuid::new_v4().to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 202);
        response.json().await.unwrap()
    }

    /// A new message under a new idempotency key.
    pub async fn post(&self, ws: &str, conversation: &str, message: &str) -> reqwest::Response {
        let body = json!({"conversation_id": conversation, "message": message});
        self.post_body(ws, &uuid::Uuid::new_v4().to_string(), &body)
            .await
    }

    /// [`Front::post`], which must be accepted.
    pub async fn send(&self, ws: &str, conversation: &str, message: &str) -> Accepted {
        let response = self.post(ws, conversation, message).await;
        assert_eq!(response.status(), 202);
        response.json().await.unwrap()
    }

    /// `GET` of the task's status URL.
    pub async fn get(&self, ws: &str, accepted: &Accepted) -> reqwest::Response {
        self.client
            .get(format!("{}{}", self.base, accepted.status_url))
            .bearer_auth(&self.keys[ws])
            .send()
            .await
            .unwrap()
    }

    pub async fn status(&self, ws: &str, accepted: &Accepted) -> reqwest::StatusCode {
        self.get(ws, accepted).await.status()
    }

    /// The task as the API shows it.
    pub async fn view(&self, ws: &str, accepted: &Accepted) -> ReplyView {
        self.get(ws, accepted).await.json().await.unwrap()
    }

    /// `POST /v1/replies/{id}/cancel`.
    pub async fn cancel(&self, ws: &str, task: &str) -> reqwest::Response {
        self.client
            .post(format!("{}/v1/replies/{task}/cancel", self.base))
            .bearer_auth(&self.keys[ws])
            .send()
            .await
            .unwrap()
    }

    /// Waits (up to two minutes) until the task shows `status`.
    pub async fn wait_until(&self, ws: &str, accepted: &Accepted, status: ReplyStatus) {
        super::wait_until(
            &format!("task {} is {status:?}", accepted.task_id),
            std::time::Duration::from_secs(120),
            || async { self.view(ws, accepted).await.status == status },
        )
        .await;
    }
}
