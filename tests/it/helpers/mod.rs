//! Fixtures shared by the integration tests: the real PostgreSQL and Kafka started by
//! `make infra-up` (addresses in `target/infra/env`, or `DATABASE_URL` / `KAFKA_BOOTSTRAP`, or
//! the set under `REPLYD_INFRA_DIR`),
//! a fresh schema per test, and a random topic and group per test.

pub mod api;
pub mod app;
pub mod provider;

use std::collections::HashMap;
use std::time::Duration;

use replyd::config::Secret;
use replyd::store::DatabaseSettings;
use replyd::store::Store;
use replyd::store::migrate::run_migrations;
use replyd_core::domain::{ChatMessage, ProviderRequest, Role, TaskId, TaskSpec};

/// Addresses of the test infrastructure. A missing one is a setup error, not a skipped test:
/// a suite that silently skips proves nothing.
pub fn infra(name: &str) -> String {
    infra_opt(name).unwrap_or_else(|| {
        panic!(
            "{name} missing from {} and {TOOLS_ENV}: run `make infra-up test-tools`",
            infra_env()
        )
    })
}

/// The services' addresses (`deploy/infra.sh up`), or those of the set under
/// `REPLYD_INFRA_DIR` (the chaos scenarios', which crash theirs, in `make test`).
fn infra_env() -> String {
    match std::env::var("REPLYD_INFRA_DIR") {
        Ok(dir) if !dir.is_empty() => format!("{dir}/env"),
        _ => concat!(env!("CARGO_MANIFEST_DIR"), "/target/infra/env").to_string(),
    }
}

/// The test tools' paths (`deploy/infra.sh tools`), which the demo does not need.
const TOOLS_ENV: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/target/infra/tools.env");

/// Like `infra`, for what only local infrastructure provides (None with an external one).
pub fn infra_opt(name: &str) -> Option<String> {
    if let Ok(value) = std::env::var(name) {
        return Some(value);
    }
    let path = infra_env();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("{name} is not set and {path} is unreadable ({e}): run `make infra-up`")
    });
    // The tools' file is absent until `make test-tools` ran: then only services are known.
    let tools = std::fs::read_to_string(TOOLS_ENV).unwrap_or_default();
    let vars: HashMap<&str, &str> = text
        .lines()
        .chain(tools.lines())
        .filter_map(|l| l.split_once('='))
        .collect();
    vars.get(name).map(|v| v.to_string())
}

/// The `replyd-lab` binary (the producer, the simulated browsers), built beside `replyd` by
/// `cargo test --workspace` (the tools' own test needs it) or `cargo build -p replyd-lab`.
pub fn lab_bin() -> std::path::PathBuf {
    let lab = std::path::Path::new(env!("CARGO_BIN_EXE_replyd")).with_file_name("replyd-lab");
    assert!(
        lab.exists(),
        "{} is not built: run `cargo build -p replyd-lab` (`cargo test --workspace` does)",
        lab.display()
    );
    lab
}

/// A port on 127.0.0.1 nobody listens on now. Bound and released: another process could take
/// it in between, which the caller's start-up wait reports.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// The test database's URL with sessions whose `search_path` is `schema`.
pub fn schema_url(schema: &str) -> Secret {
    let base = infra("DATABASE_URL");
    let separator = if base.contains('?') { '&' } else { '?' };
    Secret::new(format!(
        "{base}{separator}options=-c%20search_path%3D{schema}"
    ))
}

/// A schema of its own in the test database, migrated, with a store whose sessions use it.
pub struct TestDb {
    pub schema: String,
    pub settings: DatabaseSettings,
    pub store: Store,
}

impl TestDb {
    pub async fn new() -> Self {
        Self::with(|_| {}).await
    }

    /// A test database whose session settings `adjust` may change (timeouts, pool size).
    pub async fn with(adjust: impl FnOnce(&mut DatabaseSettings)) -> Self {
        let base = infra("DATABASE_URL");
        let schema = unique("t");
        let (client, connection) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
            .await
            .expect("connect to the test database");
        tokio::spawn(connection);
        client
            .batch_execute(&format!("CREATE SCHEMA {schema}"))
            .await
            .expect("create test schema");
        let mut settings = DatabaseSettings {
            url: schema_url(&schema),
            pool_size: 32,
            ..DatabaseSettings::default()
        };
        adjust(&mut settings);
        run_migrations(&settings).await.expect("migrations apply");
        let store = Store::connect(&settings).expect("store");
        Self {
            schema,
            settings,
            store,
        }
    }

    /// A plain session in this test's schema, outside the store (to play other transactions).
    pub async fn raw_client(&self) -> tokio_postgres::Client {
        let config = replyd::store::session_config(&self.settings).expect("config");
        let (client, connection) = config
            .connect(tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        client
    }
}

/// The payloads notified on `channel` from now on (every schema of the database notifies on
/// it: pick out your own), heard through the service's own listening session; it listens
/// until the guard is dropped.
pub async fn hear(
    settings: &DatabaseSettings,
    channel: &'static str,
) -> (
    tokio::sync::mpsc::UnboundedReceiver<String>,
    tokio_util::sync::DropGuard,
) {
    struct Collect {
        channel: &'static str,
        payloads: tokio::sync::mpsc::UnboundedSender<String>,
        listening: Option<tokio::sync::oneshot::Sender<()>>,
    }
    impl replyd::store::listen::Listener for Collect {
        fn listening(&mut self) {
            if let Some(listening) = self.listening.take() {
                let _ = listening.send(());
            }
        }
        fn notified(&mut self, channel: &str, payload: &str) {
            if channel == self.channel {
                let _ = self.payloads.send(payload.to_owned());
            }
        }
    }
    let (payloads, heard) = tokio::sync::mpsc::unbounded_channel();
    let (listening, listens) = tokio::sync::oneshot::channel();
    let stop = tokio_util::sync::CancellationToken::new();
    let channels: &'static [&'static str] = Box::leak(Box::new([channel]));
    tokio::spawn(replyd::store::listen::listen(
        settings.clone(),
        format!("test-listener {channel}"),
        channels,
        Collect {
            channel,
            payloads,
            listening: Some(listening),
        },
        replyd::store::listen::Demand::always(),
        stop.clone(),
    ));
    listens.await.expect("the session listens");
    (heard, stop.drop_guard())
}

/// Moves every open quota reservation's TTL into the past, as if it had passed (the tab closed
/// an hour ago, or the reconciler's turn came).
pub async fn age_open_reservations(db: &TestDb) {
    db.raw_client()
        .await
        .execute(
            "UPDATE quota_reservations SET expires_at = clock_timestamp() - interval '1 second' \
             WHERE state = 'reserved'",
            &[],
        )
        .await
        .unwrap();
}

/// A valid task with the given budget.
pub fn task_spec(max_attempts: u32) -> TaskSpec {
    TaskSpec {
        task_id: TaskId::new_random(),
        workspace_id: "ws-test".into(),
        conversation_id: "conv-1".into(),
        message_id: format!("msg-{}", uuid::Uuid::new_v4().simple()),
        document_version: "v1".into(),
        request: ProviderRequest {
            model: None,
            messages: vec![ChatMessage {
                role: Role::User,
                content: "What are the key decisions in this document?".into(),
            }],
            max_output_tokens: None,
        },
        max_attempts,
        deadline: None,
    }
}

/// `count` demo tasks of a workspace of their own, over `conversations` conversations.
pub fn demo_tasks(count: usize, conversations: usize) -> Vec<TaskSpec> {
    let workspace = unique("ws");
    (0..count)
        .map(|n| replyd_lab::produce::demo_task(&workspace, n, conversations, 0))
        .collect()
}

/// The tasks' ids.
pub fn ids(tasks: &[TaskSpec]) -> Vec<TaskId> {
    tasks.iter().map(|t| t.task_id).collect()
}

/// A provider that honours `Idempotency-Key` (an opt-in: no real chat API documents it),
/// answering after `latency_ms`. The end-to-end scenarios kill and stop workers mid-call and
/// count generations; a call resent under the same key after a kill or a takeover finds the
/// first generation, so one per task.
pub fn key_honouring_mock(latency_ms: u64) -> replyd_lab::mock_provider::MockSettings {
    replyd_lab::mock_provider::MockSettings {
        latency_ms,
        honour_idempotency_key: true,
        ..Default::default()
    }
}

/// Waits (10 s at most) until `sql`, one row of one boolean read by the database's clock, is
/// true; NULL counts as false.
pub async fn wait_until_sql(
    client: &tokio_postgres::Client,
    what: &str,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) {
    wait_until(what, Duration::from_secs(10), || async {
        client
            .query_one(sql, params)
            .await
            .unwrap()
            .get::<_, Option<bool>>(0)
            == Some(true)
    })
    .await;
}

/// Polls `condition` until it holds or `limit` passes; panics naming `what` on timeout.
/// Tests wait on conditions, never on bare sleeps.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if condition().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Presses Send once against the API at `addr` (`POST /v1/replies` with `key` as its
/// `Idempotency-Key`) and waits until the task is completed; returns the 202's body.
pub async fn press_until_completed(
    http: &reqwest::Client,
    addr: &str,
    token: &str,
    key: &str,
) -> serde_json::Value {
    press_with_headers_until_completed(http, addr, token, key, &[]).await
}

/// [`press_until_completed`], with more request headers (a browser's `traceparent`).
pub async fn press_with_headers_until_completed(
    http: &reqwest::Client,
    addr: &str,
    token: &str,
    key: &str,
    headers: &[(&str, &str)],
) -> serde_json::Value {
    let mut request = http
        .post(format!("http://{addr}/v1/replies"))
        .bearer_auth(token)
        .header("Idempotency-Key", key)
        .json(&serde_json::json!({"conversation_id": key, "message": "What changed?"}));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 202, "the press was not accepted");
    let accepted: serde_json::Value = response.json().await.unwrap();
    let status_url = format!("http://{addr}{}", accepted["status_url"].as_str().unwrap());
    wait_until(
        "the press is completed",
        Duration::from_secs(120),
        || async {
            let view: serde_json::Value = http
                .get(&status_url)
                .bearer_auth(token)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            view["status"] == "completed"
        },
    )
    .await;
    accepted
}

/// Runs `replyd config check` on `toml` and asserts that it refuses it (exit 2) with
/// `expected` in its message, and that `hunter2` (the fixtures' password) is not in it.
pub fn assert_config_refused(toml: &str, expected: &str) {
    let dir = std::env::temp_dir().join(unique("config"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("replyd.toml");
    std::fs::write(&path, toml).unwrap();
    let checked = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
        .args(["config", "check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert_eq!(checked.status.code(), Some(2), "{toml}: {stderr}");
    assert!(stderr.contains(expected), "{toml}: {stderr}");
    assert!(!stderr.contains("hunter2"), "a password in: {stderr}");
    std::fs::remove_dir_all(dir).unwrap();
}
