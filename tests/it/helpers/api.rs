//! The API served in-process on a free loopback port, over a test schema: what the intake,
//! quota, front-half and reconciler tests start the same way.

use replyd::api::{ApiState, IntakeLimits, serve};
use replyd::store::Store;
use replyd_core::api_key::{IssuedKey, issue};
use tokio_util::sync::{CancellationToken, DropGuard};

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
