//! One scenario's run: the workers' settings and the provider the harness plays, then start,
//! produce while faults are injected, heal, drain, check every invariant from the durable
//! state, and write the scenario's report.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::traffic::produce_steadily;
use super::{
    API, Budget, Faults, On, PARTITIONS, QUOTA_LIMIT, RELAY, WORKERS, WORKSPACE, fault_window,
};
use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::wait_until;
use replyd_core::api_key::issue;
use replyd_lab::mock_provider::MockSettings;
use serde_json::json;

/// The request limit of [`Budget::Limited`]: below the producer's 40 presses a second, so
/// calls queue at the budget for the whole fault window.
const LIMITED_RPM: u64 = 1_500;

/// Receives before the SQS server moves a message to the dead-letter queue: far above what a
/// scenario's redeliveries and hand-backs reach, so a move would show as a lost task.
const SQS_MAX_RECEIVES: u32 = 100;

fn seed() -> u64 {
    std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..))
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

/// Something a scenario keeps alive until its check is done (a proxy process).
pub(super) type Keep = Option<Box<dyn std::any::Any + Send>>;

/// Drives one scenario: start, produce while `inject` fires faults, heal, drain, check, report.
pub(super) async fn run_scenario<F, Fut>(
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
pub(super) async fn run_scenario_on<F, Fut>(
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

/// [`run_scenario`] with a `setup` that runs after the app starts and before its workers do.
pub(super) async fn run_scenario_with<S, SFut, F, Fut>(
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
        let settings = app.settings();
        replyd::reconcile::run_command(&settings.database, &settings.reconcile_settings())
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
