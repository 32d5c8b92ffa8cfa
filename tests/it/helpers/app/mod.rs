//! An application under test: a fresh schema, a topic and group of its own, the mock provider
//! on a free port, and `replyd worker` processes (the real binary) that can be killed, stopped
//! and continued.
//!
//! This file holds the application, its knobs and its processes' handles, and starts it. The
//! rest of `TestApp` is in rooms: [`settings`] (the settings files its processes and the
//! operator's commands read), [`processes`] (starting, signalling and stopping them),
//! [`observe`] (what they show: logs, the addresses they serve, metrics, readiness) and
//! [`tasks`] (tasks published, waited for and judged: offsets and the checker's report).

mod observe;
mod processes;
mod settings;
mod tasks;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use replyd_lab::mock_provider::{MockHandle, MockSettings};
use replyd_lab::produce::create_topic;

use super::{TestDb, infra, unique};

/// Knobs of a test's workers.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub protocol: &'static str,
    pub partition_window: usize,
    pub global_window: usize,
    /// Records queued per partition beyond its window before the partition is paused.
    pub read_ahead: usize,
    pub lease_ms: u64,
    pub renew_interval_ms: u64,
    pub drain_timeout_ms: u64,
    pub session_timeout_ms: u64,
    pub default_max_attempts: u32,
    pub request_timeout_ms: u64,
    /// Empty: `<topic>.dlq`, which `TestApp::start` creates.
    pub dead_letter_topic: String,
    pub retry_base_delay_ms: u64,
    /// `retry` or `stop`.
    pub ambiguous: &'static str,
    /// `retry.provider_honours_idempotency_key`; `None` writes nothing, so the product's
    /// default (false) holds. A test whose mock honours keys (`MockSettings {
    /// honour_idempotency_key: true, .. }`) and that relies on the worker knowing it says so.
    pub provider_honours_idempotency_key: Option<bool>,
    /// `retry.refusal_budget_ms`.
    pub refusal_budget_ms: u64,
    /// `chat_completions` or `background_responses`.
    pub provider_api: &'static str,
    /// `database.listen`: wake parked records on task status notifications.
    pub listen: bool,
    /// `database.listen_idle_ms`: how long a session listens once nothing needs it.
    pub listen_idle_ms: u64,
    /// `worker.max_prompt_bytes`.
    pub max_prompt_bytes: usize,
    /// `worker.commit_interval_ms`.
    pub commit_interval_ms: u64,
    /// More tables at the end of the settings (e.g. `[capacity]`).
    pub extra_toml: String,
    /// `kafka.group_instance_id` = the process's name: static membership.
    pub static_membership: bool,
    /// `sqs.visibility_timeout_seconds` of a test on SQS ([`TestApp::start_on_sqs`]).
    pub sqs_visibility_seconds: u32,
    /// `provider.stream`: unset is `"auto"` (streamed while live text is on, the default),
    /// `Some(false)` whole answers for a test about how a whole answer is waited for.
    pub stream: Option<bool>,
    /// `worker.live_text_interval_ms`; 0 forwards no live text.
    pub live_text_interval_ms: u64,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            protocol: "classic",
            partition_window: 16,
            global_window: 64,
            read_ahead: 64,
            lease_ms: 4_000,
            renew_interval_ms: 1_000,
            drain_timeout_ms: 3_000,
            session_timeout_ms: 6_000,
            default_max_attempts: 5,
            request_timeout_ms: 20_000,
            dead_letter_topic: String::new(),
            retry_base_delay_ms: 100,
            ambiguous: "retry",
            provider_honours_idempotency_key: None,
            refusal_budget_ms: 600_000,
            provider_api: "chat_completions",
            listen: true,
            listen_idle_ms: 30_000,
            max_prompt_bytes: 256 * 1024,
            commit_interval_ms: 200,
            extra_toml: String::new(),
            static_membership: false,
            sqs_visibility_seconds: 6,
            stream: None,
            live_text_interval_ms: 75,
        }
    }
}

/// Addresses that replace the direct ones in the workers' settings.
#[derive(Debug, Clone, Default)]
pub struct Routes {
    /// `host:port` of PostgreSQL as the workers should reach it.
    pub database: Option<String>,
    /// The whole `database.url` of the workers (another role, TLS parameters), in place of
    /// the test's own.
    pub database_url: Option<String>,
    /// Base URL of the provider as the workers should reach it.
    pub provider: Option<String>,
    /// Bootstrap `host:port` of Kafka as the workers should reach it. The broker must
    /// advertise it too (deploy/infra.sh's proxied listener), or clients leave the proxy
    /// after their first metadata answer.
    pub kafka: Option<String>,
    /// TOML added at the end of the workers' `[kafka]` table: more keys, then sub-tables
    /// (`[kafka.security]`).
    pub kafka_toml: Option<String>,
    /// Environment variables of the processes (secrets, as a Deployment passes them).
    pub env: Vec<(String, String)>,
}

pub struct TestApp {
    pub db: TestDb,
    pub bootstrap: String,
    pub topic: String,
    pub group: String,
    pub partitions: i32,
    pub mock: MockHandle,
    pub config: WorkerConfig,
    /// Behind a lock so a test can produce and inject faults at once through `&TestApp`.
    workers: Mutex<HashMap<String, WorkerProcess>>,
    /// Incarnations per worker name; each writes its own log file.
    spawns: Mutex<HashMap<String, usize>>,
    /// Where workers reach PostgreSQL and the provider, when not directly (a fault proxy).
    routes: Mutex<Routes>,
    dir: PathBuf,
    /// The queues of a test on SQS: the workers receive from them and the relay sends to them.
    pub sqs: Option<SqsQueues>,
}

/// A test's SQS queues and the server they live on.
#[derive(Debug, Clone)]
pub struct SqsQueues {
    pub endpoint: String,
    pub queues: replyd_lab::sqs::Queues,
}

impl SqsQueues {
    pub fn client(&self) -> replyd::transport::sqs::Sqs {
        replyd_lab::sqs::connect(&self.endpoint)
    }
}

/// A `replyd worker` process. Dropping it kills it, so no test leaves processes behind.
pub struct WorkerProcess {
    pub child: Child,
    pub log: PathBuf,
    stopped: bool,
}

impl WorkerProcess {
    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill {signal} failed");
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        // SIGCONT first: a stopped process ignores SIGKILL until continued on some kernels.
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl TestApp {
    pub async fn start(partitions: i32, mock: MockSettings, config: WorkerConfig) -> Self {
        let db = TestDb::new().await;
        let bootstrap = infra("KAFKA_BOOTSTRAP");
        let topic = unique("tasks");
        create_topic(&bootstrap, &topic, partitions)
            .await
            .expect("topic");
        create_topic(&bootstrap, &format!("{topic}.dlq"), 1)
            .await
            .expect("dlq topic");
        let mock = replyd_lab::mock_provider::spawn(mock, "127.0.0.1:0".parse().unwrap())
            .await
            .expect("mock provider");
        let dir =
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/target/test-runs")).join(&topic);
        std::fs::create_dir_all(&dir).unwrap();
        Self {
            db,
            bootstrap,
            group: unique("group"),
            topic,
            partitions,
            mock,
            config,
            workers: Mutex::new(HashMap::new()),
            spawns: Mutex::new(HashMap::new()),
            routes: Mutex::new(Routes::default()),
            dir,
            sqs: None,
        }
    }

    /// An application whose workers receive from an SQS queue of its own (on the server
    /// `deploy/infra.sh` starts), and whose relay sends to it. Its dead-letter queue is the
    /// queue's `RedrivePolicy`'s, after `max_receive_count` receives.
    pub async fn start_on_sqs(
        mock: MockSettings,
        config: WorkerConfig,
        max_receive_count: u32,
    ) -> Self {
        let mut app = Self::start(1, mock, config).await;
        let endpoint = infra("SQS_ENDPOINT");
        let client = replyd_lab::sqs::connect(&endpoint);
        let queues = replyd_lab::sqs::create_queues(&client, &app.topic, max_receive_count)
            .await
            .expect("SQS queues");
        app.sqs = Some(SqsQueues { endpoint, queues });
        app
    }

    /// The test's SQS queues (a test started with [`TestApp::start_on_sqs`]).
    pub fn on_sqs(&self) -> &SqsQueues {
        self.sqs.as_ref().expect("the test runs on SQS")
    }

    /// Replaces the mock provider's faults (`PUT /faults`), e.g. `{"error_rate": 1.0}`.
    pub async fn set_faults(&self, faults: serde_json::Value) {
        super::provider::set_faults(&self.mock, faults).await;
    }
}
