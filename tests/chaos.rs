//! The chaos harness: three `replyd worker` processes on a 6-partition topic, tasks arriving at
//! a steady rate, faults injected every few seconds from a recorded seed, then heal, drain and
//! check every invariant from the durable state (`replyd check`). Each scenario writes
//! `target/chaos/<scenario>.json`; `summary.json` gathers them.
//!
//! Half the tasks are published to Kafka by a producer; the other half are presses of Send:
//! `POST /v1/replies` to a `replyd api` process with a key of their own, asked again with the
//! same key until answered (some once more after their answer, a double click), against a
//! workspace with a quota, and handed to Kafka by a `replyd relay` process. So every scenario
//! judges the intake (I6) and the quota reservations (I8) under its faults too.
//!
//! `cargo test --test chaos` runs the short version of every scenario (CI). `make chaos` runs
//! the long one: `CHAOS_SECONDS=180 cargo test --release --test chaos -- --test-threads=1`,
//! and `make chaos SCENARIO=kill` one of them. A scenario that injected no fault fails: a run
//! must prove the fault fired. `CHAOS_PROFILE` picks the provider it plays: `key-honouring` (the
//! default), `openai-chat` (no recovery of a lost answer) or `openai-responses` (looked up by id).

// The fixtures of the integration tests (`tests/it`). The chaos scenarios are a binary of their
// own because they crash PostgreSQL and Kafka, which every other test relies on; they use only
// part of the fixtures.
#[allow(dead_code)]
#[path = "it/helpers/mod.rs"]
mod helpers;

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use helpers::app::{TestApp, WorkerConfig};
use helpers::{unique, wait_until};
use prost::Message as _;
use replyd::api::reply_view::Accepted;
use replyd_core::api_key::issue;
use replyd_lab::mock_provider::MockSettings;
use replyd_lab::produce::{demo_task, malformed_record, producer, publish};
use serde_json::{Value, json};

const PARTITIONS: i32 = 6;
const WORKERS: [&str; 3] = ["w1", "w2", "w3"];
/// The processes of the front half: presses go to `API`, `RELAY` hands their tasks to Kafka.
const API: &str = "api";
const RELAY: &str = "relay";
/// The presses' workspace and its quota: generous, so every press is admitted and the count
/// of tasks is known; the reservations and the counter are what the check judges.
const WORKSPACE: &str = "chaos";
const QUOTA_LIMIT: i64 = 1_000_000;

/// Where the harness's tasks travel: Kafka (a 6-partition topic) or an SQS Standard queue
/// (`worker.source` and `relay.sink` = `sqs`), the same faults on each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum On {
    Kafka,
    Sqs,
}

/// The provider's limits a scenario runs under: none (every scenario but one), or a request
/// limit declared to the workers and enforced by the mock. Under a limit calls wait for their
/// turn at the shared budget and give their window slots back meanwhile (I10), which is the
/// path the `kill_limited` scenario puts under kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Budget {
    Open,
    Limited,
}

/// The request limit of [`Budget::Limited`]: below the producer's 40 presses a second, so
/// calls queue at the budget for the whole fault window.
const LIMITED_RPM: u64 = 1_500;

/// Receives before the SQS server moves a message to the dead-letter queue: far above what a
/// scenario's redeliveries and hand-backs reach, so a move would show as a lost task.
const SQS_MAX_RECEIVES: u32 = 100;

/// How long faults are injected; short by default (CI), longer for `make chaos`.
fn fault_window() -> Duration {
    let seconds = std::env::var("CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    Duration::from_secs(seconds)
}

fn seed() -> u64 {
    std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..))
}

/// Runs only the scenario named in `SCENARIO`, when set.
fn selected(name: &str) -> bool {
    std::env::var("SCENARIO").map_or(true, |s| s.is_empty() || s == name)
}

/// What a scenario did, for its report.
#[derive(Default)]
struct Faults {
    counts: BTreeMap<&'static str, u64>,
    /// Seconds from a worker's SIGKILL until the group had all partitions assigned again.
    reassign_s: Vec<f64>,
}

impl Faults {
    fn fired(&mut self, kind: &'static str) {
        *self.counts.entry(kind).or_default() += 1;
    }
}

fn config(protocol: &'static str) -> WorkerConfig {
    WorkerConfig {
        protocol,
        partition_window: 16,
        global_window: 48,
        lease_ms: 3_000,
        renew_interval_ms: 1_000,
        drain_timeout_ms: 1_500,
        session_timeout_ms: 3_000,
        default_max_attempts: 8,
        request_timeout_ms: 3_000,
        retry_base_delay_ms: 100,
        // By default the harness plays a provider that honours the key (below), and its
        // workers know it, so its figures stay comparable with the runs before the honest
        // default. The other profiles leave the product's default (false).
        provider_honours_idempotency_key: (profile() == Profile::KeyHonouring).then_some(true),
        provider_api: match profile() {
            Profile::OpenAiResponses => "background_responses",
            _ => "chat_completions",
        },
        // On SQS: a stalled worker's messages reappear after as long as its leases last.
        sqs_visibility_seconds: 3,
        ..WorkerConfig::default()
    }
}

/// The provider the harness plays (`CHAOS_PROFILE`): what recovery a lost answer has, and so
/// what a kill costs in generations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Profile {
    /// `key-honouring` (the default): chat completions from a provider that honours
    /// `Idempotency-Key`, an opt-in no real chat API documents.
    KeyHonouring,
    /// `openai-chat`: OpenAI's chat completions as documented: no key honoured, no recovery.
    OpenAiChat,
    /// `openai-responses`: OpenAI's background responses: a lost answer is looked up by its id.
    OpenAiResponses,
}

fn profile() -> Profile {
    match std::env::var("CHAOS_PROFILE").as_deref() {
        Ok("openai-chat") => Profile::OpenAiChat,
        Ok("openai-responses") => Profile::OpenAiResponses,
        Ok("key-honouring") | Ok("") | Err(_) => Profile::KeyHonouring,
        Ok(other) => {
            panic!("CHAOS_PROFILE={other:?}: use key-honouring, openai-chat or openai-responses")
        }
    }
}

/// A provider that honours `Idempotency-Key`, which no real chat API documents: an opt-in that
/// keeps the harness's generation counts comparable with its earlier runs (a call resent after
/// a kill, a stall or a lost answer finds the first generation). Its streams go at a fixed
/// 20 ms a delta after the latency, so a press's 300 characters take about half a second to
/// stream, in time for the kills and stalls to strike mid-answer.
fn mock() -> MockSettings {
    MockSettings {
        latency_ms: 80,
        latency_jitter_ms: 60,
        stream_chunk_interval_ms: Some(20),
        honour_idempotency_key: profile() == Profile::KeyHonouring,
        profile: match profile() {
            Profile::OpenAiResponses => replyd_lab::mock_provider::MockProfile::OpenAiResponses,
            _ => replyd_lab::mock_provider::MockProfile::OpenAiChat,
        },
        ..MockSettings::default()
    }
}

/// Partitions assigned over the live workers, read from their `/readyz`.
async fn assigned_partitions(app: &TestApp, live: &[&str]) -> usize {
    let mut total = 0;
    for name in live {
        let log = app.log_of(name);
        let Some(addr) = log
            .rsplit("addr=")
            .next()
            .and_then(|rest| rest.split_whitespace().next())
            .filter(|_| log.contains("addr="))
        else {
            continue;
        };
        if let Ok(response) = reqwest::get(format!("http://{addr}/readyz")).await
            && let Ok(text) = response.text().await
        {
            total += text
                .split_whitespace()
                .find_map(|word| word.parse::<usize>().ok())
                .unwrap_or(0);
        }
    }
    total
}

/// What arrived during a scenario.
struct Produced {
    /// Tasks published to Kafka directly.
    published: usize,
    malformed: usize,
    /// Presses of Send, each answered with its task.
    presses: usize,
    /// Presses sent again after their answer, with the same key.
    double_clicks: usize,
    /// Requests that got no answer (API down, PostgreSQL down) and were asked again.
    unanswered: usize,
    /// Presses stopped: the task ended cancelled (the cancel was answered `200`).
    stopped: Vec<replyd_core::domain::TaskId>,
    /// Stops that came too late: the reply was saved, or the task failed, first (`409`).
    stopped_too_late: Vec<replyd_core::domain::TaskId>,
    /// Presses whose task's event stream was followed to its end, and what their followers
    /// were shown of the live text.
    followed: usize,
    live: LiveCheck,
}

/// Tasks at a steady rate until `until`: half published to Kafka (a share `poison` of the
/// records malformed), half pressed through the API.
async fn produce_steadily(
    app: &Arc<TestApp>,
    token: &str,
    until: Instant,
    per_second: u32,
    poison: f64,
    seed: u64,
) -> Produced {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
    let workspace = unique("ws");
    let (mut good, mut bad) = (0usize, 0usize);
    let mut presses = Vec::new();
    let tick = Duration::from_millis(100);
    let per_tick = (per_second / 10).max(1) as usize;
    let producer = producer(&app.bootstrap).expect("producer");
    let client = reqwest::Client::new();
    let mut next = Instant::now();
    while Instant::now() < until {
        let mut records = Vec::with_capacity(per_tick);
        for _ in 0..per_tick {
            if rng.f64() < poison {
                records.push((format!("bad-{bad}"), malformed_record(bad).1));
                bad += 1;
            } else if rng.bool() {
                let press = Press {
                    app: Arc::clone(app),
                    client: client.clone(),
                    token: token.to_owned(),
                    key: format!("press-{}", presses.len()),
                    double_click: rng.f64() < 0.1,
                    // A user who presses Stop, at once or while the reply is written.
                    stop_after: (rng.f64() < 0.1)
                        .then(|| Duration::from_millis(rng.u64(0..=2_000))),
                    follow: rng.f64() < 0.25,
                };
                presses.push(tokio::spawn(press.run()));
            } else {
                let task = demo_task(&workspace, good, 60, 0);
                records.push((
                    task.conversation_id.clone(),
                    task.to_proto().encode_to_vec(),
                ));
                good += 1;
            }
        }
        match &app.sqs {
            None => publish(&producer, &app.topic, &records)
                .await
                .expect("published"),
            Some(sqs) => {
                let bodies: Vec<String> = records
                    .iter()
                    .map(|(_, value)| replyd_lab::sqs::body_of(value))
                    .collect();
                replyd_lab::sqs::send_bodies(&sqs.client(), &sqs.queues.url, &bodies)
                    .await
                    .expect("sent");
            }
        }
        // A steady rate: the next batch is due one tick after the last was due.
        next += tick;
        tokio::time::sleep_until(next.into()).await;
    }
    let mut produced = Produced {
        published: good,
        malformed: bad,
        presses: presses.len(),
        double_clicks: 0,
        unanswered: 0,
        stopped: Vec::new(),
        stopped_too_late: Vec::new(),
        followed: 0,
        live: LiveCheck::default(),
    };
    let mut tasks = HashSet::new();
    for press in presses {
        let pressed = press.await.unwrap();
        tasks.insert(pressed.task);
        if let Some(live) = pressed.followed {
            produced.followed += 1;
            produced.live.add(live);
        }
        produced.double_clicks += usize::from(pressed.double_clicked);
        produced.unanswered += pressed.unanswered;
        match pressed.stopped {
            Some(true) => produced.stopped.push(pressed.task),
            Some(false) => produced.stopped_too_late.push(pressed.task),
            None => {}
        }
    }
    // One task per key, whatever was asked again.
    assert_eq!(tasks.len(), produced.presses, "a task per press");
    // Whatever died, stalled or restarted, no follower was shown a piece twice, out of order,
    // or after its attempt's text was withdrawn, and every stream reached its task's end.
    assert_eq!(
        produced.live.violations,
        Vec::<String>::new(),
        "live text of {} followed presses",
        produced.followed
    );
    produced
}

/// What the followers of presses were shown of the live text, checked event by event.
#[derive(Debug, Default)]
struct LiveCheck {
    pieces: usize,
    withdrawals: usize,
    /// Connections that ended or broke before the task's end and were opened again with
    /// `Last-Event-ID`.
    reconnects: usize,
    violations: Vec<String>,
    /// Per attempt of the followed task: the next piece's number, and whether its text was
    /// withdrawn.
    next: std::collections::HashMap<i64, i64>,
    withdrawn: HashSet<i64>,
}

impl LiveCheck {
    /// One event; true at the task's end.
    fn event(&mut self, task: replyd_core::domain::TaskId, kind: &str, data: &Value) -> bool {
        let version = data["assignment_version"].as_i64().unwrap_or(-1);
        match kind {
            "delta" => {
                self.pieces += 1;
                let seq = data["seq"].as_i64().unwrap_or(-1);
                if self.withdrawn.contains(&version) {
                    self.violations.push(format!(
                        "{task}: piece {seq} of attempt {version} after its withdrawal"
                    ));
                }
                let expected = self.next.entry(version).or_insert(1);
                if seq != *expected {
                    self.violations.push(format!(
                        "{task}: piece {seq} of attempt {version} where {expected} was next"
                    ));
                }
                *expected = seq + 1;
                false
            }
            "withdrawn" => {
                self.withdrawals += 1;
                self.withdrawn.insert(version);
                false
            }
            "status" => matches!(
                data["status"].as_str(),
                Some("completed" | "failed" | "cancelled")
            ),
            _ => false,
        }
    }

    /// Adds one follower's counts to the scenario's.
    fn add(&mut self, one: LiveCheck) {
        self.pieces += one.pieces;
        self.withdrawals += one.withdrawals;
        self.reconnects += one.reconnects;
        self.violations.extend(one.violations);
    }
}

/// One press of Send, as a careful browser makes it.
struct Press {
    app: Arc<TestApp>,
    client: reqwest::Client,
    token: String,
    key: String,
    double_click: bool,
    /// Press Stop this long after the press was answered.
    stop_after: Option<Duration>,
    /// Follow the task's event stream to its end, as the page does.
    follow: bool,
}

struct Pressed {
    task: replyd_core::domain::TaskId,
    double_clicked: bool,
    unanswered: usize,
    /// Whether Stop was pressed and cancelled the task (`Some(true)`), or came too late.
    stopped: Option<bool>,
    /// What its follower was shown, when it was followed.
    followed: Option<LiveCheck>,
}

impl Press {
    /// Asks until answered: a connection refused (the API restarting), a lost answer or a 503
    /// (PostgreSQL down) is asked again with the same key. A refusal (4xx) fails the scenario:
    /// the quota is generous and every request is well formed.
    async fn run(self) -> Pressed {
        let limit = Instant::now() + Duration::from_secs(180);
        let mut unanswered = 0;
        let first = loop {
            match self.send().await {
                Ok(accepted) => break accepted,
                Err(why) => {
                    assert!(
                        Instant::now() < limit,
                        "press {} never answered: {why}",
                        self.key
                    );
                    unanswered += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        if self.double_click {
            // The second click may meet a fault too; when it is answered, it is the same task.
            if let Ok(again) = self.send().await {
                assert_eq!(again.task_id, first.task_id, "press {} again", self.key);
                assert!(again.replayed, "press {} again is a replay", self.key);
            }
        }
        let stopping = async {
            match self.stop_after {
                Some(after) => {
                    tokio::time::sleep(after).await;
                    Some(self.stop(first.task_id, limit).await)
                }
                None => None,
            }
        };
        let following = async {
            if self.follow {
                Some(self.follow(first.task_id, limit).await)
            } else {
                None
            }
        };
        let (stopped, followed) = tokio::join!(stopping, following);
        Pressed {
            task: first.task_id,
            double_clicked: self.double_click,
            unanswered,
            stopped,
            followed,
        }
    }

    /// Follows the task's event stream to its end, through the API's restarts and
    /// PostgreSQL's outages: a stream that ends or breaks first is opened again with the id
    /// of the last event seen.
    async fn follow(&self, task: replyd_core::domain::TaskId, limit: Instant) -> LiveCheck {
        let mut check = LiveCheck::default();
        let mut last_id: Option<String> = None;
        while Instant::now() < limit {
            if let Some(addr) = self.app.api_addr(API) {
                let mut request = self
                    .client
                    .get(format!("http://{addr}/v1/replies/{task}/events"))
                    .bearer_auth(&self.token);
                if let Some(id) = &last_id {
                    request = request.header("Last-Event-ID", id);
                }
                if let Ok(mut response) = request.send().await
                    && response.status().is_success()
                {
                    let mut buffer = String::new();
                    // A stream says something (a keep-alive at least) every 15 s.
                    while let Ok(Ok(Some(bytes))) =
                        tokio::time::timeout(Duration::from_secs(20), response.chunk()).await
                    {
                        buffer.push_str(&String::from_utf8_lossy(&bytes));
                        while let Some(end) = buffer.find("\n\n") {
                            let block: String = buffer.drain(..end + 2).collect();
                            let field =
                                |name: &str| block.lines().find_map(|l| l.strip_prefix(name));
                            let (Some(kind), Some(data)) = (field("event: "), field("data: "))
                            else {
                                continue; // a keep-alive
                            };
                            if let Some(id) = field("id: ") {
                                last_id = Some(id.to_owned());
                            }
                            let data: Value = serde_json::from_str(data).unwrap_or_default();
                            if check.event(task, kind, &data) {
                                return check;
                            }
                        }
                    }
                }
            }
            check.reconnects += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        check
            .violations
            .push(format!("{task}: the stream never reached the task's end"));
        check
    }

    /// Presses Stop until answered (a cancel is safe to send again): true when the task is
    /// cancelled, false when it had ended first (`409`). Anything else fails the scenario.
    async fn stop(&self, task: replyd_core::domain::TaskId, limit: Instant) -> bool {
        loop {
            let answered = async {
                let addr = self.app.api_addr(API).ok_or("the API has not started")?;
                let response = self
                    .client
                    .post(format!("http://{addr}/v1/replies/{task}/cancel"))
                    .bearer_auth(&self.token)
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                match response.status().as_u16() {
                    200 => Ok(true),
                    409 => Ok(false),
                    status if status >= 500 => Err(format!("{status}")),
                    status => panic!(
                        "stop of press {}: {status} {}",
                        self.key,
                        response.text().await.unwrap_or_default()
                    ),
                }
            };
            match answered.await {
                Ok(cancelled) => return cancelled,
                Err(why) => {
                    assert!(
                        Instant::now() < limit,
                        "stop of press {} never answered: {why}",
                        self.key
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    async fn send(&self) -> Result<Accepted, String> {
        let addr = self.app.api_addr(API).ok_or("the API has not started")?;
        let response = self
            .client
            .post(format!("http://{addr}/v1/replies"))
            .bearer_auth(&self.token)
            .header("Idempotency-Key", &self.key)
            .timeout(Duration::from_secs(10))
            // Long enough to be streamed in pieces, over about half a second.
            .json(&json!({"conversation_id": self.key, "message": "What changed? [mock:reply_chars=300]"}))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        if status.is_server_error() {
            return Err(format!("{status}"));
        }
        assert!(
            status.is_success(),
            "press {}: {status} {}",
            self.key,
            response.text().await.unwrap_or_default()
        );
        response.json().await.map_err(|e| e.to_string())
    }
}

/// Drives one scenario: start, produce while `inject` fires faults, heal, drain, check, report.
async fn run_scenario<F, Fut>(
    name: &str,
    protocol: &'static str,
    poison: f64,
    inject: F,
) -> replyd::check::Report
where
    F: FnOnce(Arc<TestApp>, Instant, fastrand::Rng) -> Fut,
    Fut: std::future::Future<Output = Faults>,
{
    run_scenario_with(
        (On::Kafka, Budget::Open),
        name,
        protocol,
        poison,
        |_app| async { None },
        inject,
    )
    .await
}

/// [`run_scenario`] on `on`; the scenario's report is `<name>_sqs` on SQS.
async fn run_scenario_on<F, Fut>(
    on: On,
    name: &str,
    poison: f64,
    inject: F,
) -> replyd::check::Report
where
    F: FnOnce(Arc<TestApp>, Instant, fastrand::Rng) -> Fut,
    Fut: std::future::Future<Output = Faults>,
{
    let name = match on {
        On::Kafka => name.to_owned(),
        On::Sqs => format!("{name}_sqs"),
    };
    run_scenario_with(
        (on, Budget::Open),
        &name,
        "classic",
        poison,
        |_app| async { None },
        inject,
    )
    .await
}

/// Something a scenario keeps alive until its check is done (a proxy process).
type Keep = Option<Box<dyn std::any::Any + Send>>;

/// [`run_scenario`] with a `setup` that runs after the app starts and before its workers do.
async fn run_scenario_with<S, SFut, F, Fut>(
    (on, budget): (On, Budget),
    name: &str,
    protocol: &'static str,
    poison: f64,
    setup: S,
    inject: F,
) -> replyd::check::Report
where
    S: FnOnce(Arc<TestApp>) -> SFut,
    SFut: std::future::Future<Output = Keep>,
    F: FnOnce(Arc<TestApp>, Instant, fastrand::Rng) -> Fut,
    Fut: std::future::Future<Output = Faults>,
{
    // One scenario at a time, whatever the test runner's threads: each loads the machine (three
    // workers, a producer) and its timings are part of its report.
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _serial = SERIAL.lock().await;
    let seed = seed();
    eprintln!("chaos {name}: seed {seed}");
    let (mut mock, mut config) = (mock(), config(protocol));
    if budget == Budget::Limited {
        mock.limits.requests_per_minute = Some(LIMITED_RPM);
        config.extra_toml = format!("[capacity]\nrequests_per_minute = {LIMITED_RPM}\n");
    }
    let app = Arc::new(match on {
        On::Kafka => TestApp::start(PARTITIONS, mock, config).await,
        On::Sqs => TestApp::start_on_sqs(mock, config, SQS_MAX_RECEIVES).await,
    });
    let store = &app.db.store;
    store.create_workspace(WORKSPACE).await.unwrap();
    let key = issue(&mut rand::rng());
    assert!(store.create_api_key(WORKSPACE, &key).await.unwrap());
    assert!(
        store
            .set_quota(WORKSPACE, Some(QUOTA_LIMIT), 86_400)
            .await
            .unwrap()
    );
    let _keep = setup(Arc::clone(&app)).await;
    app.spawn_process(API, "api");
    app.spawn_relay(RELAY);
    for worker in WORKERS {
        app.spawn_worker(worker);
    }
    for worker in WORKERS {
        app.wait_until_ready(worker).await;
    }
    app.wait_for_api_addr(API, Duration::from_secs(60)).await;
    let started = Instant::now();
    let until = started + fault_window();
    let producer = {
        let app = Arc::clone(&app);
        let token = key.token.clone();
        tokio::spawn(async move { produce_steadily(&app, &token, until, 40, poison, seed).await })
    };
    let mut faults = inject(Arc::clone(&app), until, fastrand::Rng::with_seed(seed)).await;
    // Presses still unanswered are asked again after the faults end, as a browser would.
    let produced = producer.await.unwrap();
    let (good, bad) = (produced.published + produced.presses, produced.malformed);
    if bad > 0 {
        // Poison is a fault of the stream itself.
        faults.counts.insert("malformed_records", bad as u64);
    }

    // Heal: faults off, every process running and continued.
    app.set_faults(json!({})).await;
    for worker in WORKERS {
        app.ensure_running_as(worker, "worker");
    }
    app.ensure_running_as(API, "api");
    app.ensure_running_as(RELAY, "relay");
    let healed = Instant::now();
    let drained_limit = Duration::from_secs(240);
    let client = app.db.raw_client().await;
    wait_until("every produced task is terminal", drained_limit, || {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT count(*) FROM reply_tasks WHERE status IN ('completed', 'failed', 'cancelled')",
                    &[],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                >= good as i64
        }
    })
    .await;
    match &app.sqs {
        None => app.wait_until_committed_to_end(drained_limit).await,
        // Every message deleted: each was acknowledged only past its task's end.
        Some(sqs) => {
            let client = sqs.client();
            wait_until("the queue is drained", drained_limit, || async {
                client
                    .depth(&sqs.queues.url)
                    .await
                    .is_ok_and(|d| d.total() == 0)
            })
            .await
        }
    }
    // The drain includes the outbox: a row whose record reached Kafka while the commit that
    // marks it published was cut (a reset connection) is published again by the relay's next
    // batch, up to a poll interval later; its task may be done before that.
    wait_until("every outbox row is published", drained_limit, || {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT count(*) FROM outbox WHERE published_at IS NULL AND refused_at IS NULL",
                    &[],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 0
        }
    })
    .await;
    let recovery_s = healed.elapsed().as_secs_f64();
    // Presses that failed while the provider may have done their work keep their reservations
    // (I8: not released as if nothing ran). Their TTL is made to pass, and one pass of the
    // reconciler settles them as quota.charge_unresolved says.
    let held: i64 = client
        .query_one(
            "WITH aged AS (UPDATE quota_reservations r \
               SET expires_at = clock_timestamp() - interval '1 second' \
               FROM reply_tasks t WHERE t.task_id = r.task_id AND r.state = 'reserved' \
                 AND t.status = 'failed' RETURNING 1) \
             SELECT count(*) FROM aged",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    if held > 0 {
        replyd::reconcile::run_command(
            &app.settings().database,
            &app.settings().reconcile_settings(),
        )
        .await
        .expect("a reconciler pass");
    }
    // No reservation was freed whose work the provider did (the mock counts generations by
    // the task id each request carried as its key).
    let generated = app.mock.stats().per_key;
    // A stopped task's too: a Stop whose call may have run is charged (V27), the user may
    // have been shown its text.
    let freed_with_work: Vec<String> = client
        .query(
            "SELECT r.task_id::text FROM quota_reservations r JOIN reply_tasks t USING (task_id) \
             WHERE r.state IN ('released', 'expired')",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get::<_, String>(0))
        .filter(|task| generated.get(task).is_some_and(|n| *n > 0))
        .collect();
    let report = app.check().await;

    let total_faults: u64 = faults.counts.values().sum();
    let out = json!({
        "scenario": name,
        "source": format!("{on:?}").to_lowercase(),
        "protocol": protocol,
        "profile": format!("{:?}", profile()),
        "seed": seed,
        "fault_window_s": fault_window().as_secs(),
        "duration_s": started.elapsed().as_secs_f64(),
        "recovery_s": recovery_s,
        "reassign_s": faults.reassign_s,
        "faults": faults.counts,
        "produced": {
            "tasks": good,
            "published": produced.published,
            "pressed": produced.presses,
            "double_clicks": produced.double_clicks,
            "asked_again_unanswered": produced.unanswered,
            "stopped": produced.stopped.len(),
            "stopped_too_late": produced.stopped_too_late.len(),
            "malformed": bad,
        },
        "followed": {
            "presses": produced.followed,
            "pieces": produced.live.pieces,
            "withdrawals": produced.live.withdrawals,
            "reconnects": produced.live.reconnects,
        },
        "reservations_held_unresolved": held,
        "check": report,
    });
    write_report(name, &out);

    assert!(total_faults > 0, "{name}: no fault was injected");
    assert_eq!(report.violations, Vec::<String>::new(), "{name}: {out:#}");
    assert_eq!(report.duplicate_replies, 0, "{name}: {out:#}");
    assert_eq!(report.lost, 0, "{name}: {out:#}");
    assert_eq!(report.pending, 0, "{name}: {out:#}");
    assert_eq!(report.tasks, good as i64, "{name}: {out:#}");
    assert_eq!(report.dead_lettered, bad as i64, "{name}: {out:#}");
    assert!(report.attempts_per_task.max <= 8, "{name}: {out:#}");
    // Every press's reservation was settled once, by the transaction that ended its task (I8;
    // a second settlement or a counter out of step is among the violations above).
    assert_eq!(
        (
            report.reservations_charged + report.reservations_released,
            report.reservations_open,
            report.reservations_unsettled,
        ),
        (produced.presses as i64, 0, 0),
        "{name}: {out:#}"
    );
    assert_eq!(
        freed_with_work,
        Vec::<String>::new(),
        "{name}: reservations released although the provider did the work: {out:#}"
    );
    assert_eq!(report.duplicate_tasks, 0, "{name}: {out:#}");
    assert_eq!(report.outbox_unpublished, 0, "{name}: {out:#}");
    // Every Stop did what its answer said: a `200` left the task cancelled with no reply, a
    // `409` left it as it had ended, and no task ended cancelled that nobody stopped.
    let statuses = |tasks: &[replyd_core::domain::TaskId]| {
        let ids: Vec<uuid::Uuid> = tasks.iter().map(|t| t.as_uuid()).collect();
        let client = &client;
        async move {
            client
                .query(
                    "SELECT status, count(*) FROM reply_tasks WHERE task_id = ANY($1) GROUP BY 1",
                    &[&ids],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
                .collect::<BTreeMap<_, _>>()
        }
    };
    let stopped = statuses(&produced.stopped).await;
    assert!(
        stopped.keys().all(|s| s == "cancelled"),
        "{name}: stopped tasks not cancelled: {stopped:?}"
    );
    let too_late = statuses(&produced.stopped_too_late).await;
    assert!(
        too_late.keys().all(|s| s == "completed" || s == "failed"),
        "{name}: stops refused as too late, tasks not finished: {too_late:?}"
    );
    assert_eq!(
        report.cancelled,
        produced.stopped.len() as i64,
        "{name}: {out:#}"
    );
    report
}

fn write_report(name: &str, report: &serde_json::Value) {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/target/chaos"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join(format!("{name}.json")),
        serde_json::to_vec_pretty(report).unwrap(),
    )
    .unwrap();
    // summary.json gathers every scenario's latest report.
    let mut summary = serde_json::Map::new();
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let path = entry.path();
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_owned();
        if path.extension().is_some_and(|e| e == "json")
            && stem != "summary"
            && let Ok(value) = serde_json::from_slice(&std::fs::read(&path).unwrap())
        {
            summary.insert(stem, value);
        }
    }
    std::fs::write(
        dir.join("summary.json"),
        serde_json::to_vec_pretty(&summary).unwrap(),
    )
    .unwrap();
}

async fn pause(rng: &mut fastrand::Rng, from_ms: u64, to_ms: u64) {
    tokio::time::sleep(Duration::from_millis(rng.u64(from_ms..to_ms))).await;
}

/// SIGKILL of the API or the relay, then a restart: presses in flight lose their answers and
/// are asked again; outbox rows published but not yet marked so go out again.
async fn kill_front(app: &TestApp, rng: &mut fastrand::Rng, faults: &mut Faults) {
    let (front, command, fault) = if rng.bool() {
        (API, "api", "api_sigkill")
    } else {
        (RELAY, "relay", "relay_sigkill")
    };
    app.kill(front);
    faults.fired(fault);
    pause(rng, 200, 1_500).await;
    app.spawn_process(front, command);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kill() {
    if selected("kill") {
        kill((On::Kafka, Budget::Open)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kill_sqs() {
    if selected("kill_sqs") {
        kill((On::Sqs, Budget::Open)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kill_limited() {
    if selected("kill_limited") {
        kill((On::Kafka, Budget::Limited)).await;
    }
}

/// SIGKILL of a worker, then a restart, and of the API or the relay. On Kafka the others must
/// own every partition before the victim comes back (`reassign_s`); an SQS queue has none:
/// the victim's messages reappear once their visibility runs out. Under a limited budget
/// (`kill_limited`) the victims die with calls waiting for their turn, their slots given back.
async fn kill((on, budget): (On, Budget)) {
    let name = match (on, budget) {
        (On::Kafka, Budget::Open) => "kill",
        (On::Sqs, Budget::Open) => "kill_sqs",
        (On::Kafka, Budget::Limited) => "kill_limited",
        (On::Sqs, Budget::Limited) => "kill_limited_sqs",
    };
    let setup = |_app| async { None };
    run_scenario_with(
        (on, budget),
        name,
        "classic",
        0.0,
        setup,
        |app, until, mut rng| async move {
            let mut faults = Faults::default();
            while Instant::now() < until {
                pause(&mut rng, 2_000, 4_000).await;
                let victim = WORKERS[rng.usize(..WORKERS.len())];
                app.kill(victim);
                faults.fired("sigkill");
                if app.sqs.is_none() {
                    let killed = Instant::now();
                    let others: Vec<&str> =
                        WORKERS.iter().copied().filter(|w| *w != victim).collect();
                    wait_until(
                        "the others own every partition",
                        Duration::from_secs(60),
                        || async {
                            assigned_partitions(&app, &others).await == PARTITIONS as usize
                        },
                    )
                    .await;
                    faults.reassign_s.push(killed.elapsed().as_secs_f64());
                }
                pause(&mut rng, 500, 2_000).await;
                app.spawn_worker(victim);
                kill_front(&app, &mut rng, &mut faults).await;
            }
            faults
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_zombie() {
    if selected("zombie") {
        zombie(On::Kafka).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_zombie_sqs() {
    if selected("zombie_sqs") {
        zombie(On::Sqs).await;
    }
}

/// SIGSTOP of a worker holding work, past its lease and its session (or its messages'
/// visibility), then SIGCONT: a zombie whose late writes must be refused.
async fn zombie(on: On) {
    let report = run_scenario_on(on, "zombie", 0.0, |app, until, mut rng| async move {
        let mut faults = Faults::default();
        while Instant::now() < until {
            pause(&mut rng, 1_000, 3_000).await;
            // A zombie needs work in hand to come back with. At 40 tasks/s and 80 ms a reply a
            // worker is often idle, so a stop timed by chance can catch nothing: the provider
            // is slowed (every request held 1.5 s, under the 3 s request timeout) until a
            // worker is seen holding records, and that worker is stopped. Bounded: after 100
            // looks, the last worker looked at is stopped anyway.
            app.set_faults(json!({"hang_rate": 1.0, "hang_ms": 1_500}))
                .await;
            let mut victim = WORKERS[rng.usize(..WORKERS.len())];
            for _ in 0..100 {
                if app
                    .metric(victim, "replyd_in_flight_records")
                    .await
                    .unwrap_or(0.0)
                    > 0.0
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                victim = WORKERS[rng.usize(..WORKERS.len())];
            }
            app.stop(victim);
            faults.fired("sigstop");
            app.set_faults(json!({})).await;
            // Past the lease (3 s) and the session (3 s): the group moves on, leases lapse.
            tokio::time::sleep(Duration::from_millis(rng.u64(5_000..7_000))).await;
            app.resume(victim);
            faults.fired("sigcont");
        }
        faults
    })
    .await;
    // The zombies came back and were refused: the fault really fired.
    assert!(report.fenced_rejections > 0, "{report:#?}");
}

async fn rebalance(protocol: &'static str) {
    let name = if protocol == "classic" {
        "rebalance"
    } else {
        "rebalance_consumer"
    };
    if !selected(name) && !selected("rebalance") {
        return;
    }
    run_scenario(name, protocol, 0.0, |app, until, mut rng| async move {
        let mut faults = Faults::default();
        // 3 → 1 → 3 → 2, repeatedly: graceful leaves (SIGTERM) and joins.
        while Instant::now() < until {
            for worker in ["w2", "w3"] {
                app.terminate(worker).await;
                faults.fired("leave");
            }
            pause(&mut rng, 1_000, 2_500).await;
            for worker in ["w2", "w3"] {
                app.spawn_worker(worker);
                faults.fired("join");
            }
            for worker in ["w2", "w3"] {
                app.wait_until_ready(worker).await;
            }
            pause(&mut rng, 1_500, 3_000).await;
            app.terminate("w3").await;
            faults.fired("leave");
            pause(&mut rng, 1_000, 2_500).await;
            app.spawn_worker("w3");
            faults.fired("join");
            app.wait_until_ready("w3").await;
        }
        faults
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_rebalance_classic() {
    rebalance("classic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_rebalance_consumer_protocol() {
    rebalance("consumer").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_provider() {
    if selected("provider") {
        provider(On::Kafka).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_provider_sqs() {
    if selected("provider_sqs") {
        provider(On::Sqs).await;
    }
}

/// The provider's faults in turn: 5xx, 429 with Retry-After, hangs, answers lost after the
/// work was done.
async fn provider(on: On) {
    run_scenario_on(on, "provider", 0.0, |app, until, mut rng| async move {
        let mut faults = Faults::default();
        let kinds = [
            ("5xx", json!({"error_rate": 0.3, "error_status": 502})),
            ("429", json!({"rate_limit_rate": 0.3, "retry_after_s": 1})),
            ("hang", json!({"hang_rate": 0.1, "hang_ms": 600000})),
            ("ambiguous_drop", json!({"drop_after_work_rate": 0.3})),
        ];
        while Instant::now() < until {
            let (kind, faults_json) = &kinds[rng.usize(..kinds.len())];
            app.set_faults(faults_json.clone()).await;
            faults.fired(kind);
            pause(&mut rng, 1_500, 3_000).await;
            app.set_faults(json!({})).await;
            pause(&mut rng, 500, 1_500).await;
        }
        faults
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_poison() {
    if selected("poison") {
        poison(On::Kafka).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_poison_sqs() {
    if selected("poison_sqs") {
        poison(On::Sqs).await;
    }
}

async fn poison(on: On) {
    // 1% malformed, truncated or oversized records, mixed into the steady stream.
    run_scenario_on(on, "poison", 0.01, |_app, until, _rng| async move {
        // The faults are in the stream (counted as malformed_records).
        tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
        Faults::default()
    })
    .await;
}

/// Runs `deploy/infra.sh <command>` (a crash and restart of a local service).
async fn infra_crash(command: &'static str) {
    let status = tokio::task::spawn_blocking(move || {
        std::process::Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/infra.sh"))
            .arg(command)
            .stdout(std::process::Stdio::null())
            .status()
    })
    .await
    .unwrap()
    .expect("infra.sh runs");
    assert!(status.success(), "infra.sh {command} failed");
}

/// Crash scenarios need the local services; with external ones they are skipped (and say so).
fn local_services() -> bool {
    let local = std::env::var("DATABASE_URL").is_err() && std::env::var("KAFKA_BOOTSTRAP").is_err();
    if !local {
        eprintln!("skipped: DATABASE_URL or KAFKA_BOOTSTRAP names an external service");
    }
    local
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_postgres() {
    if selected("postgres") && local_services() {
        postgres(On::Kafka).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_postgres_sqs() {
    if selected("postgres_sqs") && local_services() {
        postgres(On::Sqs).await;
    }
}

/// PostgreSQL crashed (immediate stop and restart), or its connections cut under the workers.
async fn postgres(on: On) {
    run_scenario_on(on, "postgres", 0.0, |app, until, mut rng| async move {
        let mut faults = Faults::default();
        while Instant::now() < until {
            pause(&mut rng, 2_000, 4_000).await;
            if rng.bool() {
                // A crash: every session dies, whatever it was doing (COMMIT included).
                infra_crash("postgres-crash").await;
                faults.fired("immediate_restart");
            } else {
                // Connections cut under the workers, some mid-transaction or mid-COMMIT.
                let client = app.db.raw_client().await;
                let cut: i64 = client
                    .query_one(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                         WHERE application_name = 'replyd' AND pid <> pg_backend_pid()",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get(0);
                if cut > 0 {
                    faults.fired("connections_cut");
                }
            }
        }
        faults
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_broker() {
    if !selected("broker") || !local_services() {
        return;
    }
    run_scenario(
        "broker",
        "classic",
        0.0,
        |_app, until, mut rng| async move {
            let mut faults = Faults::default();
            while Instant::now() < until {
                pause(&mut rng, 3_000, 6_000).await;
                infra_crash("kafka-crash").await;
                faults.fired("broker_kill_restart");
            }
            faults
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_mixed() {
    if !selected("mixed") {
        return;
    }
    let local = std::env::var("DATABASE_URL").is_err() && std::env::var("KAFKA_BOOTSTRAP").is_err();
    run_scenario(
        "mixed",
        "classic",
        0.005,
        |app, until, mut rng| async move {
            let mut faults = Faults::default();
            while Instant::now() < until {
                pause(&mut rng, 1_500, 3_500).await;
                let victim = WORKERS[rng.usize(..WORKERS.len())];
                match rng.u8(..7) {
                    0 => {
                        app.kill(victim);
                        faults.fired("sigkill");
                        pause(&mut rng, 500, 2_000).await;
                        app.spawn_worker(victim);
                    }
                    1 => {
                        app.stop(victim);
                        faults.fired("sigstop");
                        tokio::time::sleep(Duration::from_millis(rng.u64(4_000..6_000))).await;
                        app.resume(victim);
                    }
                    2 => {
                        app.set_faults(json!({"error_rate": 0.2, "drop_after_work_rate": 0.2}))
                            .await;
                        faults.fired("provider_faults");
                        pause(&mut rng, 1_000, 3_000).await;
                        app.set_faults(json!({})).await;
                    }
                    3 if local => {
                        infra_crash("postgres-crash").await;
                        faults.fired("postgres_restart");
                    }
                    4 if local => {
                        infra_crash("kafka-crash").await;
                        faults.fired("broker_restart");
                    }
                    5 => kill_front(&app, &mut rng, &mut faults).await,
                    _ => {
                        app.terminate(victim).await;
                        faults.fired("leave");
                        app.spawn_worker(victim);
                        app.wait_until_ready(victim).await;
                    }
                }
            }
            faults
        },
    )
    .await;
}

/// A Toxiproxy server of this test, stopped (by its pid) when dropped.
struct Toxiproxy {
    child: std::process::Child,
    api: String,
}

impl Drop for Toxiproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Toxiproxy {
    async fn start() -> Self {
        let output = std::process::Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/infra.sh"))
            .arg("toxiproxy")
            .output()
            .expect("infra.sh runs");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let binary = String::from_utf8(output.stdout).unwrap().trim().to_owned();
        let port = {
            // A free port: bind, read, release.
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let child = std::process::Command::new(binary)
            .args(["-host", "127.0.0.1", "-port", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("toxiproxy starts");
        let proxy = Self {
            child,
            api: format!("http://127.0.0.1:{port}"),
        };
        wait_until("toxiproxy answers", Duration::from_secs(20), || async {
            reqwest::get(format!("{}/version", proxy.api)).await.is_ok()
        })
        .await;
        proxy
    }

    /// A proxy listening on `listen` (port 0: a free one) in front of `upstream`; returns
    /// its `host:port`.
    async fn proxy(&self, name: &str, listen: &str, upstream: &str) -> String {
        let response = reqwest::Client::new()
            .post(format!("{}/proxies", self.api))
            .json(&json!({"name": name, "listen": listen, "upstream": upstream, "enabled": true}))
            .send()
            .await
            .unwrap();
        let status = response.status();
        let created: serde_json::Value = response.json().await.unwrap();
        assert!(status.is_success(), "proxy {name} on {listen}: {created}");
        created["listen"]
            .as_str()
            .expect("the proxy's address")
            .to_owned()
    }

    async fn add_toxic(&self, proxy: &str, toxic: &str, kind: &str, attributes: serde_json::Value) {
        let response = reqwest::Client::new()
            .post(format!("{}/proxies/{proxy}/toxics", self.api))
            .json(&json!({"name": toxic, "type": kind, "stream": "downstream", "toxicity": 1.0, "attributes": attributes}))
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success(), "toxic {toxic} refused");
    }

    async fn remove_toxic(&self, proxy: &str, toxic: &str) {
        let _ = reqwest::Client::new()
            .delete(format!("{}/proxies/{proxy}/toxics/{toxic}", self.api))
            .send()
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_network() {
    if !selected("network") {
        return;
    }
    let toxiproxy = Arc::new(Toxiproxy::start().await);
    // Kafka is proxied through the broker's third listener, which advertises the address the
    // proxy listens on (deploy/infra.sh); an external broker has no such listener.
    let kafka = match (
        helpers::infra_opt("KAFKA_PROXIED_BOOTSTRAP"),
        helpers::infra_opt("KAFKA_PROXIED_UPSTREAM"),
    ) {
        (Some(listen), Some(upstream)) => Some((listen, upstream)),
        _ => {
            eprintln!("network: no proxied Kafka listener (external broker): Kafka is not proxied");
            None
        }
    };
    let mut targets = vec!["postgres", "provider"];
    if kafka.is_some() {
        targets.insert(0, "kafka");
    }
    let proxies = Arc::clone(&toxiproxy);
    let setup = move |app: Arc<TestApp>| async move {
        let db = helpers::infra("DATABASE_URL");
        let at = db.find('@').unwrap() + 1;
        let upstream = &db[at..at + db[at..].find('/').unwrap()];
        let database = proxies.proxy("postgres", "127.0.0.1:0", upstream).await;
        let provider = proxies
            .proxy("provider", "127.0.0.1:0", &app.mock.addr().to_string())
            .await;
        let kafka = match kafka {
            Some((listen, upstream)) => Some(proxies.proxy("kafka", &listen, &upstream).await),
            None => None,
        };
        app.route(helpers::app::Routes {
            database: Some(database),
            provider: Some(format!("http://{provider}")),
            kafka,
            ..helpers::app::Routes::default()
        });
        let keep: Keep = Some(Box::new(proxies));
        keep
    };
    let black_hole = (fault_window() / 4).clamp(Duration::from_secs(3), Duration::from_secs(20));
    run_scenario_with(
        (On::Kafka, Budget::Open),
        "network",
        "classic",
        0.0,
        setup,
        |_app, until, mut rng| async move {
            let mut faults = Faults::default();
            let mut round = 0;
            while Instant::now() < until {
                pause(&mut rng, 1_000, 3_000).await;
                // Every target once first, so even a short run hits each connection.
                let proxy = targets
                    .get(round)
                    .copied()
                    .unwrap_or_else(|| targets[rng.usize(..targets.len())]);
                round += 1;
                faults.fired(match proxy {
                    "kafka" => "on_kafka",
                    "postgres" => "on_postgres",
                    _ => "on_provider",
                });
                match rng.u8(..3) {
                    0 => {
                        toxiproxy
                            .add_toxic(
                                proxy,
                                "latency",
                                "latency",
                                json!({"latency": 300, "jitter": 200}),
                            )
                            .await;
                        faults.fired("latency");
                        pause(&mut rng, 2_000, 4_000).await;
                        toxiproxy.remove_toxic(proxy, "latency").await;
                    }
                    1 => {
                        toxiproxy
                            .add_toxic(proxy, "black_hole", "timeout", json!({"timeout": 0}))
                            .await;
                        faults.fired("black_hole");
                        tokio::time::sleep(black_hole).await;
                        toxiproxy.remove_toxic(proxy, "black_hole").await;
                    }
                    _ => {
                        toxiproxy
                            .add_toxic(proxy, "reset", "reset_peer", json!({"timeout": 0}))
                            .await;
                        faults.fired("reset_peer");
                        pause(&mut rng, 300, 1_000).await;
                        toxiproxy.remove_toxic(proxy, "reset").await;
                    }
                }
            }
            faults
        },
    )
    .await;
}
