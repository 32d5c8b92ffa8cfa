//! An application under test: a fresh schema, a topic and group of its own, the mock provider
//! on a free port, and `replyd worker` processes (the real binary) that can be killed, stopped
//! and continued.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use prost::Message as _;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use replyd_core::domain::{TaskId, TaskSpec};
use replyd_lab::mock_provider::{MockHandle, MockSettings};
use replyd_lab::produce::{create_topic, producer, publish};

use super::{TestDb, infra, unique, wait_until};

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
    /// `provider.stream`: streamed answers (the default), or whole ones for a test about how
    /// a whole answer is waited for.
    pub stream: bool,
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
            stream: true,
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

    /// The `[sqs]` table and the source and sink that use it, on a test on SQS.
    fn sqs_toml(&self) -> String {
        let Some(sqs) = &self.sqs else {
            return String::new();
        };
        format!(
            r#"
[sqs]
queue_url = "{url}"
endpoint_url = "{endpoint}"
region = "us-east-1"
wait_time_seconds = 2
visibility_timeout_seconds = {visibility}
"#,
            url = sqs.queues.url,
            endpoint = sqs.endpoint,
            visibility = self.config.sqs_visibility_seconds,
        )
    }

    fn worker_toml(&self, name: &str) -> String {
        let c = &self.config;
        // A copy: a guard held across the arguments below would deadlock the next lock.
        let routes = self
            .routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        format!(
            r#"
[database]
url = "{url}"
pool_size = 16
listen = {listen}
listen_idle_ms = {listen_idle}

[kafka]
bootstrap_servers = "{bootstrap}"
topic = "{topic}"
group_id = "{group}"
group_protocol = "{protocol}"
{session}
dead_letter_topic = "{dlq}"
{instance}
{kafka_toml}

[kafka.librdkafka]
"topic.metadata.refresh.interval.ms" = "2000"
{heartbeat}

[worker]
{source}worker_id = "{name}"
partition_window = {pw}
global_window = {gw}
read_ahead = {ra}
lease_ms = {lease}
renew_interval_ms = {renew}
drain_timeout_ms = {drain}
commit_interval_ms = {commit}
io_retry_ms = 100
default_max_attempts = {attempts}
max_prompt_bytes = {max_prompt}

[provider]
base_url = "{mock}"
request_timeout_ms = {timeout}
api = "{api}"
poll_interval_ms = 100
stream = {stream}

[retry]
base_delay_ms = {retry_base}
max_delay_ms = 5000
ambiguous = "{ambiguous}"
{honours}refusal_budget_ms = {refusal_budget}

[observability]
listen = "127.0.0.1:0"

[api]
listen = "127.0.0.1:0"
end_user_token_key = "{token_key}"
{sink}
{sqs}
{extra}
"#,
            source = if self.sqs.is_some() {
                "source = \"sqs\"\n"
            } else {
                ""
            },
            sink = if self.sqs.is_some() {
                "\n[relay]\nsink = \"sqs\"\n"
            } else {
                ""
            },
            sqs = self.sqs_toml(),
            stream = c.stream,
            token_key = super::api::TOKEN_KEY,
            url = self.worker_database_url(),
            commit = c.commit_interval_ms,
            kafka_toml = routes.kafka_toml.as_deref().unwrap_or_default(),
            bootstrap = routes.kafka.as_deref().unwrap_or(&self.bootstrap),
            topic = self.topic,
            group = self.group,
            protocol = c.protocol,
            // KIP-848 sessions are the broker's; the setting is refused with that protocol.
            session = if c.protocol == "classic" {
                format!("session_timeout_ms = {}", c.session_timeout_ms)
            } else {
                String::new()
            },
            dlq = c.dead_letter_topic,
            instance = if c.static_membership {
                format!("group_instance_id = \"{name}\"")
            } else {
                String::new()
            },
            // KIP-848 heartbeats are the broker's to set (see deploy/infra.sh).
            heartbeat = if c.protocol == "classic" {
                r#""heartbeat.interval.ms" = "500""#
            } else {
                ""
            },
            name = name,
            pw = c.partition_window,
            gw = c.global_window,
            ra = c.read_ahead,
            lease = c.lease_ms,
            renew = c.renew_interval_ms,
            drain = c.drain_timeout_ms,
            attempts = c.default_max_attempts,
            mock = routes.provider.unwrap_or_else(|| self.mock.base_url()),
            timeout = c.request_timeout_ms,
            retry_base = c.retry_base_delay_ms,
            ambiguous = c.ambiguous,
            honours = c
                .provider_honours_idempotency_key
                .map(|honours| format!("provider_honours_idempotency_key = {honours}\n"))
                .unwrap_or_default(),
            refusal_budget = c.refusal_budget_ms,
            api = c.provider_api,
            listen = c.listen,
            listen_idle = c.listen_idle_ms,
            max_prompt = c.max_prompt_bytes,
            extra = c.extra_toml,
        )
    }

    /// Routes the workers started from now on through other addresses (a fault proxy).
    pub fn route(&self, routes: Routes) {
        *self.routes.lock().unwrap_or_else(|p| p.into_inner()) = routes;
    }

    /// The test database's URL, with the host and port the workers should use.
    fn worker_database_url(&self) -> String {
        let routes = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        let url = routes
            .database_url
            .clone()
            .unwrap_or_else(|| self.db.settings.url.expose().to_owned());
        match &routes.database {
            Some(via) => {
                // postgres://user:pass@HOST:PORT/db?... → the same with `via` as HOST:PORT.
                let at = url.find('@').expect("the test URL has credentials") + 1;
                let end = at + url[at..].find('/').expect("the test URL names a database");
                format!("{}{via}{}", &url[..at], &url[end..])
            }
            None => url,
        }
    }

    fn workers(&self) -> std::sync::MutexGuard<'_, HashMap<String, WorkerProcess>> {
        // A panic elsewhere in the test poisons nothing we rely on: the map is still right.
        self.workers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take(&self, name: &str) -> WorkerProcess {
        self.workers()
            .remove(name)
            .unwrap_or_else(|| panic!("worker {name} is not running"))
    }

    /// Starts (or restarts) worker `name`.
    pub fn spawn_worker(&self, name: &str) {
        self.spawn_process(name, "worker");
    }

    /// Starts (or restarts) `replyd relay` as process `name`, with the workers' settings.
    pub fn spawn_relay(&self, name: &str) {
        self.spawn_process(name, "relay");
    }

    /// Starts (or restarts) `replyd <command>` as process `name`, with the workers' settings.
    pub fn spawn_process(&self, name: &str, command: &str) {
        let config = self.dir.join(format!("{name}.toml"));
        std::fs::write(&config, self.worker_toml(name)).unwrap();
        let incarnation = {
            let mut spawns = self.spawns.lock().unwrap_or_else(|p| p.into_inner());
            let n = spawns.entry(name.to_owned()).or_default();
            *n += 1;
            *n
        };
        let log = self.dir.join(format!("{name}.{incarnation}.log"));
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let mut env = self
            .routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .env
            .clone();
        if self.sqs.is_some() {
            env.extend(
                replyd_lab::sqs::TEST_ENV
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string())),
            );
        }
        // The routes' environment last, so a test may set its own log levels.
        let child = Command::new(env!("CARGO_BIN_EXE_replyd"))
            .args([command, "--config"])
            .arg(&config)
            .env("RUST_LOG", "info,replyd=debug,librdkafka=warn")
            .envs(env)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("worker starts");
        self.workers().insert(
            name.to_owned(),
            WorkerProcess {
                child,
                log,
                stopped: false,
            },
        );
    }

    /// The process id of the running incarnation of worker `name`.
    pub fn pid(&self, name: &str) -> u32 {
        self.workers()
            .get(name)
            .unwrap_or_else(|| panic!("worker {name} is not running"))
            .child
            .id()
    }

    /// Waits until every named worker has at least one partition assigned (from its
    /// `/metrics`), so work published next is spread over all of them.
    pub async fn wait_until_assigned(&self, names: &[&str]) {
        super::wait_until(
            &format!("{names:?} each hold partitions"),
            Duration::from_secs(60),
            || async {
                for name in names {
                    if self
                        .metric(name, "replyd_assigned_partitions")
                        .await
                        .unwrap_or(0.0)
                        < 1.0
                    {
                        return false;
                    }
                }
                true
            },
        )
        .await;
    }

    /// Publishes each task once to each of `partitions` (keys differ, so each copy is a record
    /// of its own partition, processed by whichever worker holds it).
    pub async fn produce_to_partitions(&self, tasks: &[TaskSpec], partitions: &[i32]) {
        let producer = producer(&self.bootstrap).expect("producer");
        for task in tasks {
            let value = task.to_proto().encode_to_vec();
            for &partition in partitions {
                let key = format!("{}-{partition}", task.conversation_id);
                producer
                    .send(
                        rdkafka::producer::FutureRecord::to(&self.topic)
                            .key(&key)
                            .payload(&value)
                            .partition(partition),
                        Duration::from_secs(30),
                    )
                    .await
                    .map_err(|(e, _)| e)
                    .expect("published");
            }
        }
    }

    /// A `key=value` count from the worker's logs: how many lines of `name`'s logs contain
    /// every one of `needles`.
    pub fn log_lines_with(&self, name: &str, needles: &[&str]) -> usize {
        self.log_of(name)
            .lines()
            .filter(|line| needles.iter().all(|n| line.contains(n)))
            .count()
    }

    /// Waits until the latest incarnation of worker `name` has joined (its consumer polls).
    pub async fn wait_until_ready(&self, name: &str) {
        let log = self.workers()[name].log.clone();
        super::wait_until(
            &format!("{name} is ready"),
            Duration::from_secs(60),
            || async {
                std::fs::read_to_string(&log).is_ok_and(|text| {
                    text.contains("consumer started") || text.contains("SQS source started")
                })
            },
        )
        .await;
    }

    /// Starts process `name` (`replyd <command>`) if it is not running, continues it if it is
    /// stopped: how a chaos scenario heals.
    #[allow(dead_code)] // the chaos binary's, which shares these fixtures
    pub fn ensure_running_as(&self, name: &str, command: &str) {
        let stopped = self.workers().get(name).map(|w| w.stopped);
        match stopped {
            None => self.spawn_process(name, command),
            Some(true) => self.resume(name),
            Some(false) => {}
        }
    }

    /// Waits for worker `name` to exit by itself (bounded) and returns whether it succeeded.
    pub async fn wait_for_exit(&self, name: &str, limit: Duration) -> bool {
        let mut worker = self.take(name);
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = worker.child.try_wait().expect("try_wait") {
                return status.success();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name} did not exit within {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL: a crash with work in flight.
    pub fn kill(&self, name: &str) {
        let mut worker = self.take(name);
        worker.signal("-KILL");
        let _ = worker.child.wait();
    }

    /// SIGSTOP: the process stalls, connections open, locks and leases held.
    pub fn stop(&self, name: &str) {
        let mut workers = self.workers();
        let worker = workers.get_mut(name).expect("worker exists");
        worker.signal("-STOP");
        worker.stopped = true;
    }

    /// SIGCONT: the stalled process resumes as a zombie.
    pub fn resume(&self, name: &str) {
        let mut workers = self.workers();
        let worker = workers.get_mut(name).expect("worker exists");
        worker.signal("-CONT");
        worker.stopped = false;
    }

    /// SIGTERM, then waits for a clean exit (drain, commit, leave).
    pub async fn terminate(&self, name: &str) {
        let mut worker = self.take(name);
        worker.signal("-TERM");
        let waited = tokio::task::spawn_blocking(move || {
            let status = worker.child.wait();
            (status, worker)
        })
        .await
        .unwrap();
        let status = waited.0.expect("wait");
        assert!(
            status.success(),
            "worker exited with {status}; log {:?}",
            waited.1.log
        );
    }

    /// Everything worker `name` logged, over all its incarnations.
    pub fn log_of(&self, name: &str) -> String {
        let count = self
            .spawns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .copied()
            .unwrap_or(0);
        (1..=count)
            .filter_map(|n| std::fs::read_to_string(self.dir.join(format!("{name}.{n}.log"))).ok())
            .collect()
    }

    /// Where the latest incarnation of worker `name` serves `/metrics`, `/healthz` and
    /// `/readyz`, from its start-up log line (None before it logged it).
    pub fn observability_addr(&self, name: &str) -> Option<String> {
        let log = self.log_of(name);
        // The observability server's own line: a `serve` process logs the API's address too.
        let line = log.lines().rfind(|l| l.contains("serving /metrics"))?;
        let (_, rest) = line.split_once("addr=")?;
        Some(rest.split_whitespace().next()?.to_owned())
    }

    /// Where the latest incarnation of process `name` serves the API, from its start-up line
    /// (None before any incarnation logged it; an earlier one's after a restart, until the new
    /// one logs its own).
    pub fn api_addr(&self, name: &str) -> Option<String> {
        let log = self.log_of(name);
        let (_, rest) = log.rsplit_once("API listening addr=")?;
        Some(rest.split_whitespace().next()?.to_owned())
    }

    /// [`Self::api_addr`], waiting up to `limit` for the process to log it.
    pub async fn wait_for_api_addr(&self, name: &str, limit: Duration) -> String {
        wait_until("the process logs the API's address", limit, || {
            let found = self.api_addr(name).is_some();
            async move { found }
        })
        .await;
        self.api_addr(name).unwrap_or_default()
    }

    /// The value of an unlabelled gauge or counter on the `/metrics` page of the running
    /// incarnation of worker `name` (None before it serves the page or names the metric).
    pub async fn metric(&self, name: &str, metric: &str) -> Option<f64> {
        let addr = self.observability_addr(name)?;
        let page = reqwest::get(format!("http://{addr}/metrics"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        page.lines()
            .find_map(|line| line.strip_prefix(metric)?.strip_prefix(' ')?.parse().ok())
    }

    /// The sum of every series of metric family `metric` of worker `name` (0 when none).
    pub async fn metric_total(&self, name: &str, metric: &str) -> f64 {
        let Some(addr) = self.observability_addr(name) else {
            return 0.0;
        };
        let Ok(page) = reqwest::get(format!("http://{addr}/metrics")).await else {
            return 0.0;
        };
        page.text()
            .await
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix(metric)?;
                let value = match rest.strip_prefix('{') {
                    Some(labelled) => labelled.split_once("} ")?.1,
                    None => rest.strip_prefix(' ')?,
                };
                value.parse::<f64>().ok()
            })
            .sum()
    }

    /// Publishes tasks (key = conversation id) and returns once the broker acknowledged all.
    pub async fn produce_tasks(&self, tasks: &[TaskSpec], copies: usize) {
        let records: Vec<(String, Vec<u8>)> = (0..copies)
            .flat_map(|_| tasks.iter())
            .map(|t| (t.conversation_id.clone(), t.to_proto().encode_to_vec()))
            .collect();
        self.produce_raw(&records).await;
    }

    pub async fn produce_raw(&self, records: &[(String, Vec<u8>)]) {
        let producer = producer(&self.bootstrap).expect("producer");
        publish(&producer, &self.topic, records)
            .await
            .expect("published");
    }

    /// Waits until every task in `ids` is completed or failed. On a timeout it says which
    /// tasks are still open and shows the end of every worker's log: a stall seen once in a
    /// loaded run must be explainable from the failure alone.
    pub async fn wait_until_terminal(&self, ids: &[TaskId], limit: Duration) {
        let client = self.db.raw_client().await;
        let uuids: Vec<uuid::Uuid> = ids.iter().map(|t| t.as_uuid()).collect();
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let open: Vec<(uuid::Uuid, String)> = client
                .query(
                    "SELECT t.id, coalesce(r.status, 'not saved') FROM unnest($1::uuid[]) AS t(id) \
                     LEFT JOIN reply_tasks r ON r.task_id = t.id \
                     WHERE r.status IS NULL OR r.status NOT IN ('completed', 'failed', 'cancelled') \
                     ORDER BY t.id",
                    &[&uuids],
                )
                .await
                .unwrap()
                .iter()
                .map(|row| (row.get(0), row.get(1)))
                .collect();
            if open.is_empty() {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                let shown: Vec<String> = open
                    .iter()
                    .take(10)
                    .map(|(id, status)| format!("{id} ({status})"))
                    .collect();
                panic!(
                    "timed out after {limit:?} waiting until {} tasks are terminal: {} are not, \
                     among them {}\n{}",
                    ids.len(),
                    open.len(),
                    shown.join(", "),
                    self.log_tails(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The last `lines` lines of every worker's latest log, for a failure message.
    pub fn log_tails(&self, lines: usize) -> String {
        let spawns = self
            .spawns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut names: Vec<_> = spawns.into_iter().collect();
        names.sort();
        names
            .into_iter()
            .map(|(name, count)| {
                let path = self.dir.join(format!("{name}.{count}.log"));
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let all: Vec<&str> = text.lines().collect();
                let tail = all[all.len().saturating_sub(lines)..].join("\n");
                format!("--- the end of {} ---\n{tail}", path.display())
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The group's committed offsets, per partition.
    pub async fn committed_offsets(&self) -> HashMap<i32, i64> {
        let (bootstrap, group, topic, partitions) = (
            self.bootstrap.clone(),
            self.group.clone(),
            self.topic.clone(),
            self.partitions,
        );
        tokio::task::spawn_blocking(move || {
            replyd::check::committed_offsets(&bootstrap, &group, &topic, 0..partitions)
                .expect("the group's committed offsets")
        })
        .await
        .unwrap()
    }

    /// Waits until the committed offset of every partition reaches its end.
    pub async fn wait_until_committed_to_end(&self, limit: Duration) {
        let ends = self.end_offsets().await;
        wait_until(
            "offsets committed to the end of every partition",
            limit,
            || async {
                let committed = self.committed_offsets().await;
                ends.iter()
                    .all(|(p, end)| *end == 0 || committed.get(p) == Some(end))
            },
        )
        .await;
    }

    pub async fn end_offsets(&self) -> HashMap<i32, i64> {
        let (bootstrap, topic, partitions) =
            (self.bootstrap.clone(), self.topic.clone(), self.partitions);
        tokio::task::spawn_blocking(move || {
            let reader: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .create()
                .unwrap();
            (0..partitions)
                .map(|p| {
                    (
                        p,
                        reader
                            .fetch_watermarks(&topic, p, Duration::from_secs(10))
                            .unwrap()
                            .1,
                    )
                })
                .collect()
        })
        .await
        .unwrap()
    }

    /// Replaces the mock provider's faults (`PUT /faults`), e.g. `{"error_rate": 1.0}`.
    pub async fn set_faults(&self, faults: serde_json::Value) {
        super::provider::set_faults(&self.mock, faults).await;
    }

    /// Writes `text` to `name` in this test's folder and returns its path.
    pub fn dir_file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// The settings file the workers use (direct routes), for operator commands
    /// (`replyd check --config`, `replyd inspect --config`).
    pub fn settings_file(&self) -> PathBuf {
        let path = self.dir.join("operator.toml");
        std::fs::write(&path, self.direct_toml()).unwrap();
        path
    }

    /// `replyd ARGS --config <settings_file>`, as an operator runs a command against this
    /// test's parts; the caller adds environment and runs it.
    pub fn operator_command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_replyd"));
        command.args(args).arg("--config").arg(self.settings_file());
        command
    }

    /// The settings file of a process spawned now (the routes applied), for operator
    /// commands that should see what the processes see.
    pub fn settings_file_as_routed(&self) -> PathBuf {
        let path = self.dir.join("operator-routed.toml");
        std::fs::write(&path, self.worker_toml("operator")).unwrap();
        path
    }

    /// The workers' settings with direct routes, as the library reads them.
    pub fn settings(&self) -> replyd::config::Settings {
        replyd::config::Settings::from_toml(&self.direct_toml()).expect("test settings are valid")
    }

    fn direct_toml(&self) -> String {
        let routes = std::mem::take(&mut *self.routes.lock().unwrap_or_else(|p| p.into_inner()));
        let text = self.worker_toml("operator");
        *self.routes.lock().unwrap_or_else(|p| p.into_inner()) = routes;
        text
    }

    /// The checker's report over this test's schema, topic, group and mock.
    pub async fn check(&self) -> replyd::check::Report {
        match &self.sqs {
            Some(sqs) => replyd::check::run_with_sqs(
                &self.settings(),
                Some(&self.mock.base_url()),
                sqs.client(),
            )
            .await
            .expect("check runs"),
            None => replyd::check::run(&self.settings(), Some(&self.mock.base_url()))
                .await
                .expect("check runs"),
        }
    }

    /// Attempt outcomes over all tasks, counted.
    pub async fn attempt_outcomes(&self) -> HashMap<String, i64> {
        self.db
            .raw_client()
            .await
            .query(
                "SELECT coalesce(outcome, 'open'), count(*) FROM reply_attempts GROUP BY 1",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }
}
