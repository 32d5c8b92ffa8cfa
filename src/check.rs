//! `replyd check`: reads the durable state — PostgreSQL, the topic and its dead-letter twin, the
//! group's committed offsets, and (when given) the mock provider's counters — and reports
//! whether the invariants hold. Every figure is read back, none is taken from what a producer
//! meant to do. Every rule comes from the same settings as the worker's (`--config`), so a
//! record the worker refuses is a bad record here too.
//!
//! [`read_facts`] does the I/O; [`verdict`] is pure and judges:
//! - I1: `duplicate_replies` counts tasks with more than one accepted attempt in the history
//!   (the schema's constraints make a second saved reply impossible; the history is the
//!   independent witness).
//! - I3: `lost` counts records below the committed offset whose task is not terminal (or was
//!   never created) and bad records below it with no dead-letter copy.
//! - I7: `max_attempts_exceeded` counts tasks with more attempts than their budget: calls that
//!   may have cost money (attempt rows other than `refused`; a refusal gives its attempt back).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Serialize;
use uuid::Uuid;

use crate::config::Settings;
use crate::kafka::dead_letter::headers;
use crate::store::{connect_error, session_config, tls_connector};
use replyd_core::domain::{AttemptOutcome, RecordRules, TaskSpec, TaskStatus};

/// Exit code when an invariant is broken.
pub const INVARIANT_BROKEN: u8 = 3;

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// Base URL of the mock provider, to read its request counters.
    #[arg(long)]
    pub mock_url: Option<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Print one `key=value` line of the headline figures instead (for `make demo`).
    #[arg(long, conflicts_with = "json")]
    pub summary: bool,
}

/// Percentiles of attempts (claims, each one provider call at most) per task.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Percentiles {
    pub p50: i64,
    pub p99: i64,
    pub max: i64,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Report {
    pub tasks: i64,
    pub completed: i64,
    pub failed: i64,
    pub pending: i64,
    pub dead_lettered: i64,
    /// Records in the topic (all partitions), good and bad.
    pub records: i64,
    pub bad_records: i64,
    /// Records at or above their partition's committed offset (not yet committed past).
    pub uncommitted_records: i64,
    pub duplicate_replies: i64,
    pub lost: i64,
    pub fenced_rejections: i64,
    /// Attempt rows but refusals: one per claim whose call may have cost money. An attempt
    /// makes at most one provider call (a claim refused later, or cancelled before its call,
    /// makes none).
    pub attempts: i64,
    /// Calls the provider refused without doing them (attempt rows `refused`): they spend no
    /// attempt of a task's budget (I7).
    pub refused_calls: i64,
    pub attempts_per_task: Percentiles,
    pub max_attempts_exceeded: i64,
    /// Messages submitted once through the API with more than one task for that submission
    /// (a retried key that made new work; must be 0).
    pub duplicate_tasks: i64,
    /// API-created tasks (those with an idempotency record) with no outbox row, or more than
    /// one (must be 0 within the outbox's retention).
    pub tasks_without_one_outbox_row: i64,
    /// Outbox rows not yet published (0 after a drain).
    pub outbox_unpublished: i64,
    /// Quota reservations by state (I8).
    pub reservations_open: i64,
    pub reservations_charged: i64,
    pub reservations_released: i64,
    pub reservations_expired: i64,
    /// Open reservations past their TTL that the reconciler has not settled (0 after it ran).
    pub reservations_unsettled: i64,
    /// Open reservations held for tasks that failed while the provider may have done their
    /// work, until the reconciler can settle them (I8: not released as if nothing ran).
    pub reservations_unresolved: i64,
    /// Completed tasks whose reservation is not charged (must be 0).
    pub completed_without_charge: i64,
    /// Charged reservations whose task neither completed nor failed under a policy that
    /// charges failures, nor failed while the provider may have done its work (must be 0).
    pub charges_without_reply: i64,
    /// Workspaces whose counter of open reservations (or of the tokens they hold) differs from
    /// the reservations (must be 0).
    pub quota_counter_mismatches: i64,
    /// Settled reservations whose tokens are not what their settlement charges: a charge the
    /// saved reply's reported usage, else the ceiling; anything else none (must be 0).
    pub token_charge_mismatches: i64,
    /// Accepted replies per worker id: how the work was shared.
    pub replies_by_worker: BTreeMap<String, i64>,
    /// HTTP requests the mock provider received (when `--mock-url` is given).
    pub mock_requests: Option<i64>,
    /// Generations the mock ran. A mock started with `--honour-idempotency-key true` answers a
    /// resent request for work already done without generating again (a request but not a
    /// generation: compare the two); by default, like the real chat APIs, it generates anew.
    pub mock_generations: Option<i64>,
    /// `mock_requests / tasks`.
    pub mock_requests_per_task: Option<f64>,
    /// Names of the broken invariants; empty when all hold.
    pub violations: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("database: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error("kafka at {bootstrap} (kafka.bootstrap_servers): {error}")]
    Kafka {
        bootstrap: String,
        error: rdkafka::error::KafkaError,
    },
    #[error("mock provider: {0}")]
    Mock(#[from] reqwest::Error),
    #[error("{0}")]
    Other(String),
}

impl From<rdkafka::error::KafkaError> for CheckError {
    fn from(error: rdkafka::error::KafkaError) -> Self {
        CheckError::Kafka {
            bootstrap: String::new(),
            error,
        }
    }
}

impl Report {
    /// The headline figures as one `key=value` line.
    pub fn summary_line(&self) -> String {
        let workers: Vec<String> = self
            .replies_by_worker
            .iter()
            .map(|(w, n)| format!("{w}:{n}"))
            .collect();
        format!(
            "tasks={} completed={} failed={} dead_lettered={} duplicate_tasks={} duplicate_replies={} lost={} charged={} released={} unsettled={} provider_requests={} generations={} replies_by_worker={}",
            self.tasks,
            self.completed,
            self.failed,
            self.dead_lettered,
            self.duplicate_tasks,
            self.duplicate_replies,
            self.lost,
            self.reservations_charged,
            self.reservations_released,
            self.reservations_unsettled,
            self.mock_requests
                .map_or_else(|| "unknown".to_string(), |n| n.to_string()),
            self.mock_generations
                .map_or_else(|| "unknown".to_string(), |n| n.to_string()),
            if workers.is_empty() {
                "none".to_string()
            } else {
                workers.join(",")
            },
        )
    }

    /// The report as a table for operators.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let mut row = |name: &str, value: String, note: &str| {
            // Writing to a String cannot fail.
            let _ = writeln!(out, "{name:<26} {value:>10}  {note}");
        };
        row("tasks", self.tasks.to_string(), "");
        row("  completed", self.completed.to_string(), "");
        row("  failed", self.failed.to_string(), "");
        row("  pending or running", self.pending.to_string(), "");
        row("records in the topic", self.records.to_string(), "");
        row("  bad records", self.bad_records.to_string(), "");
        row("  dead-lettered", self.dead_lettered.to_string(), "");
        row(
            "  not yet committed past",
            self.uncommitted_records.to_string(),
            "",
        );
        row(
            "duplicate replies",
            self.duplicate_replies.to_string(),
            "I1: must be 0",
        );
        row(
            "lost records",
            self.lost.to_string(),
            "I3: committed past without an outcome; must be 0",
        );
        row(
            "fenced rejections",
            self.fenced_rejections.to_string(),
            "I2: zombie writes refused",
        );
        row(
            "attempts",
            self.attempts.to_string(),
            "one per claim whose call may have cost money",
        );
        row(
            "refused calls",
            self.refused_calls.to_string(),
            "the provider did no work; no attempt spent",
        );
        row(
            "attempts per task",
            format!(
                "{}/{}/{}",
                self.attempts_per_task.p50, self.attempts_per_task.p99, self.attempts_per_task.max
            ),
            "p50/p99/max",
        );
        row(
            "over their budget",
            self.max_attempts_exceeded.to_string(),
            "I7: must be 0",
        );
        row(
            "duplicate tasks",
            self.duplicate_tasks.to_string(),
            "I6: a retried key that made new work; must be 0",
        );
        row(
            "API tasks, outbox rows ≠ 1",
            self.tasks_without_one_outbox_row.to_string(),
            "I6: must be 0",
        );
        row(
            "outbox unpublished",
            self.outbox_unpublished.to_string(),
            "0 once the relay has drained",
        );
        row(
            "reservations open / charged / released / expired",
            format!(
                "{} / {} / {} / {}",
                self.reservations_open,
                self.reservations_charged,
                self.reservations_released,
                self.reservations_expired
            ),
            "",
        );
        row(
            "reservations past TTL, unsettled",
            self.reservations_unsettled.to_string(),
            "I8: must be 0 once the reconciler ran",
        );
        row(
            "reservations held unresolved",
            self.reservations_unresolved.to_string(),
            "failed tasks whose work may exist; settled by the reconciler after their TTL",
        );
        row(
            "completed without charge",
            self.completed_without_charge.to_string(),
            "I8: must be 0",
        );
        row(
            "charges without reply",
            self.charges_without_reply.to_string(),
            "I8: must be 0",
        );
        row(
            "quota counters off",
            self.quota_counter_mismatches.to_string(),
            "I8: must be 0",
        );
        row(
            "token charges off",
            self.token_charge_mismatches.to_string(),
            "I8: must be 0 (the reply's reported usage, else the ceiling)",
        );
        for (worker, replies) in &self.replies_by_worker {
            row(&format!("replies by {worker}"), replies.to_string(), "");
        }
        if let (Some(requests), Some(generations)) = (self.mock_requests, self.mock_generations) {
            row(
                "mock: requests",
                requests.to_string(),
                &format!(
                    "{:.3} per task",
                    self.mock_requests_per_task.unwrap_or_default()
                ),
            );
            row(
                "mock: generations",
                generations.to_string(),
                "a resent Idempotency-Key is a request, not a generation",
            );
        }
        if self.violations.is_empty() {
            let _ = writeln!(out, "\nevery invariant holds");
        } else {
            let _ = writeln!(out, "\nBROKEN:");
            for v in &self.violations {
                let _ = writeln!(out, "  {v}");
            }
        }
        out
    }
}

/// Runs `replyd check` and prints the report; exit 3 when an invariant is broken.
pub async fn run_command(settings: &Settings, args: &CheckArgs) -> anyhow::Result<ExitCode> {
    let report = run(settings, args.mock_url.as_deref()).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else if args.summary {
        println!("{}", report.summary_line());
    } else {
        print!("{}", report.render_table());
    }
    Ok(if report.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(INVARIANT_BROKEN)
    })
}

/// One record of the source topic, as the checker sees it.
#[derive(Debug, Clone)]
pub struct SourceRecord {
    pub partition: i32,
    pub offset: i64,
    /// The task it carries, when the worker's rules make one of it.
    pub task: Option<Uuid>,
}

fn consumer(base: &ClientConfig, group: &str) -> Result<BaseConsumer, CheckError> {
    Ok(base
        .clone()
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()?)
}

/// The offsets `group` has committed on `partitions` of `topic` (partitions without one are
/// left out). Blocking: call it off the runtime's threads.
pub fn committed_offsets(
    bootstrap: &str,
    group: &str,
    topic: &str,
    partitions: impl IntoIterator<Item = i32>,
) -> Result<HashMap<i32, i64>, CheckError> {
    let mut base = ClientConfig::new();
    base.set("bootstrap.servers", bootstrap);
    committed_offsets_with(&base, group, topic, partitions)
}

/// [`committed_offsets`] through `base` (the brokers and how to reach them).
pub fn committed_offsets_with(
    base: &ClientConfig,
    group: &str,
    topic: &str,
    partitions: impl IntoIterator<Item = i32>,
) -> Result<HashMap<i32, i64>, CheckError> {
    let mut list = TopicPartitionList::new();
    for p in partitions {
        list.add_partition(topic, p);
    }
    if list.count() == 0 {
        return Ok(HashMap::new());
    }
    Ok(consumer(base, group)?
        .committed_offsets(list, Duration::from_secs(10))?
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) => Some((e.partition(), o)),
            _ => None,
        })
        .collect())
}

/// Reads every record of `topic` from the beginning up to the high watermarks seen at start.
fn read_topic<T>(
    base: &ClientConfig,
    topic: &str,
    mut each: impl FnMut(&rdkafka::message::BorrowedMessage<'_>) -> T,
) -> Result<Vec<T>, CheckError> {
    let reader = consumer(base, "replyd-check-reader")?;
    let metadata = reader.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let Some(meta) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(Vec::new());
    };
    let mut assignment = TopicPartitionList::new();
    let mut remaining: HashMap<i32, i64> = HashMap::new();
    for partition in meta.partitions() {
        let (low, high) =
            reader.fetch_watermarks(topic, partition.id(), Duration::from_secs(10))?;
        if high > low {
            remaining.insert(partition.id(), high);
            assignment.add_partition_offset(topic, partition.id(), Offset::Offset(low))?;
        }
    }
    let mut out = Vec::new();
    if remaining.is_empty() {
        return Ok(out);
    }
    reader.assign(&assignment)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !remaining.is_empty() {
        if Instant::now() > deadline {
            return Err(CheckError::Other(format!(
                "reading {topic} took over 120 s"
            )));
        }
        match reader.poll(Duration::from_millis(200)) {
            Some(Ok(message)) => {
                let partition = message.partition();
                if let Some(&high) = remaining.get(&partition) {
                    if message.offset() < high {
                        out.push(each(&message));
                    }
                    if message.offset() + 1 >= high {
                        remaining.remove(&partition);
                    }
                }
            }
            Some(Err(e)) => return Err(e.into()),
            None => {}
        }
    }
    Ok(out)
}

/// The `p` quantile of `sorted` by the nearest-rank method (0 when empty).
pub fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Counters of the mock provider.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MockCounts {
    pub requests: i64,
    pub generations: i64,
}

/// Everything the checker reads, as plain values.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    pub source: Vec<SourceRecord>,
    /// (partition, offset) of each dead-letter copy's source record.
    pub dead: HashSet<(i32, i64)>,
    pub committed: HashMap<i32, i64>,
    pub statuses: HashMap<Uuid, TaskStatus>,
    pub duplicate_replies: i64,
    pub fenced_rejections: i64,
    pub refused_calls: i64,
    /// Attempts of each task.
    pub attempts_per_task: Vec<i64>,
    pub max_attempts_exceeded: i64,
    pub duplicate_tasks: i64,
    pub tasks_without_one_outbox_row: i64,
    pub outbox_unpublished: i64,
    pub quota: QuotaFacts,
    pub replies_by_worker: BTreeMap<String, i64>,
    pub mock: Option<MockCounts>,
}

/// The quota's ledger as read (I8).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuotaFacts {
    pub open: i64,
    pub charged: i64,
    pub released: i64,
    pub expired: i64,
    pub unsettled: i64,
    /// Open reservations of failed tasks whose provider may have done the work.
    pub unresolved: i64,
    pub completed_without_charge: i64,
    pub charges_without_reply: i64,
    pub counter_mismatches: i64,
    pub token_charge_mismatches: i64,
}

/// Runs every check and returns the report.
pub async fn run(settings: &Settings, mock_url: Option<&str>) -> Result<Report, CheckError> {
    Ok(verdict(read_facts(settings, mock_url).await?))
}

/// Reads the topic, its dead-letter twin, the committed offsets, the task tables and the
/// mock's counters.
pub async fn read_facts(settings: &Settings, mock_url: Option<&str>) -> Result<Facts, CheckError> {
    let kafka = settings.kafka.clone();
    let rules = settings.worker.record_rules();
    // Kafka: blocking client calls, off the runtime's threads.
    let (source, dead, committed) = tokio::task::spawn_blocking(move || {
        read_kafka(&kafka, &rules).map_err(|e| match e {
            CheckError::Kafka { error, .. } => CheckError::Kafka {
                bootstrap: kafka.bootstrap_servers.clone(),
                error,
            },
            other => other,
        })
    })
    .await
    .map_err(|e| CheckError::Other(format!("kafka reader: {e}")))??;

    let config = session_config(&settings.database)?;
    let (client, connection) = config
        .connect(tls_connector(&settings.database)?)
        .await
        .map_err(|e| connect_error(&settings.database, &e))?;
    tokio::spawn(connection);
    let mut statuses = HashMap::new();
    for row in client
        .query("SELECT task_id, status FROM reply_tasks", &[])
        .await?
    {
        let status: &str = row.get(1);
        let status = TaskStatus::parse(status)
            .ok_or_else(|| CheckError::Other(format!("unknown task status {status:?}")))?;
        statuses.insert(row.get(0), status);
    }
    // Outcomes are bound as parameters from the one enum that writes them.
    let count = |sql: &'static str, outcome: Option<AttemptOutcome>| {
        let client = &client;
        async move {
            match outcome {
                Some(o) => client.query_one(sql, &[&o.as_str()]).await,
                None => client.query_one(sql, &[]).await,
            }
            .map(|r| r.get::<_, i64>(0))
        }
    };
    let duplicate_replies = count(
        "SELECT count(*) FROM (SELECT task_id FROM reply_attempts WHERE outcome = $1 \
         GROUP BY task_id HAVING count(*) > 1) d",
        Some(AttemptOutcome::Accepted),
    )
    .await?;
    let fenced_rejections = count(
        "SELECT count(*) FROM reply_attempts WHERE outcome = $1",
        Some(AttemptOutcome::Fenced),
    )
    .await?;
    let refused_calls = count(
        "SELECT count(*) FROM reply_attempts WHERE outcome = $1",
        Some(AttemptOutcome::Refused),
    )
    .await?;
    let max_attempts_exceeded = count(
        "SELECT count(*) FROM reply_tasks t WHERE attempt_count > max_attempts \
         OR (SELECT count(*) FROM reply_attempts a WHERE a.task_id = t.task_id \
             AND a.outcome IS DISTINCT FROM 'refused') > max_attempts",
        None,
    )
    .await?;
    // I6, from the intake's own tables: one task per submission (a message's create_reply
    // tasks), one outbox row per API-created task, and every row published after a drain.
    let duplicate_tasks = count(
        "SELECT count(*) FROM (SELECT t.message_id FROM reply_tasks t \
         JOIN idempotency_keys k ON k.task_id = t.task_id AND k.operation = 'create_reply' \
         GROUP BY t.workspace_id, t.message_id HAVING count(*) > 1) d",
        None,
    )
    .await?;
    // The relay deletes a published row `relay.retention_ms` after it was published, so a
    // missing row is a violation only for a task younger than that; a second row always is.
    let retention = settings.relay.retention().as_secs_f64();
    let tasks_without_one_outbox_row: i64 = client
        .query_one(
            "SELECT count(*) FROM idempotency_keys k, \
             LATERAL (SELECT count(*) AS n FROM outbox o WHERE o.task_id = k.task_id) o \
             WHERE o.n > 1 OR (o.n = 0 AND k.created_at > clock_timestamp() - make_interval(secs => $1))",
            &[&retention],
        )
        .await?
        .get(0);
    let outbox_unpublished = count(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL AND refused_at IS NULL",
        None,
    )
    .await?;
    // I8, from the reservations, the tasks they reserve for, and the counters.
    let row = client
        .query_one(
            "SELECT \
               count(*) FILTER (WHERE r.state = 'reserved'), \
               count(*) FILTER (WHERE r.state = 'charged'), \
               count(*) FILTER (WHERE r.state = 'released'), \
               count(*) FILTER (WHERE r.state = 'expired'), \
               count(*) FILTER (WHERE r.state = 'reserved' AND r.expires_at < clock_timestamp()), \
               count(*) FILTER (WHERE r.state = 'reserved' AND t.status = 'failed'), \
               count(*) FILTER (WHERE t.status = 'completed' AND r.state <> 'charged'), \
               count(*) FILTER (WHERE r.state = 'charged' AND NOT (t.status = 'completed' \
                                OR (t.status = 'failed' \
                                    AND (r.charge_on_failure OR t.provider_may_have_run)))), \
               (SELECT count(*) FROM quota_counters q WHERE (q.reserved, q.tokens_reserved) <> \
                  (SELECT count(*), coalesce(sum(o.token_ceiling), 0) FROM quota_reservations o \
                    WHERE o.workspace_id = q.workspace_id AND o.state = 'reserved')), \
               count(*) FILTER (WHERE r.state <> 'reserved' AND r.tokens_charged IS DISTINCT FROM \
                 CASE WHEN r.state <> 'charged' THEN 0 \
                      ELSE coalesce((SELECT a.prompt_tokens + a.completion_tokens \
                                       FROM reply_attempts a \
                                      WHERE a.task_id = t.task_id \
                                        AND a.assignment_version = t.assignment_version \
                                        AND t.status = 'completed'), r.token_ceiling) END) \
             FROM quota_reservations r JOIN reply_tasks t USING (task_id)",
            &[],
        )
        .await?;
    let quota = QuotaFacts {
        open: row.get(0),
        charged: row.get(1),
        released: row.get(2),
        expired: row.get(3),
        unsettled: row.get(4),
        unresolved: row.get(5),
        completed_without_charge: row.get(6),
        charges_without_reply: row.get(7),
        counter_mismatches: row.get(8),
        token_charge_mismatches: row.get(9),
    };
    let attempts_per_task = client
        .query(
            "SELECT count(a.task_id) FILTER (WHERE a.outcome IS DISTINCT FROM 'refused') \
             FROM reply_tasks t LEFT JOIN reply_attempts a USING (task_id) GROUP BY t.task_id",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get::<_, i64>(0))
        .collect();
    let replies_by_worker = client
        .query(
            "SELECT worker, count(*) FROM reply_attempts WHERE outcome = $1 GROUP BY worker",
            &[&AttemptOutcome::Accepted.as_str()],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    let mock = match mock_url {
        Some(url) => {
            let stats: serde_json::Value =
                reqwest::get(format!("{}/stats", url.trim_end_matches('/')))
                    .await?
                    .json()
                    .await?;
            Some(MockCounts {
                requests: stats["requests"].as_i64().unwrap_or_default(),
                generations: stats["generations"].as_i64().unwrap_or_default(),
            })
        }
        None => None,
    };
    Ok(Facts {
        source,
        dead,
        committed,
        statuses,
        duplicate_replies,
        fenced_rejections,
        refused_calls,
        attempts_per_task,
        max_attempts_exceeded,
        duplicate_tasks,
        tasks_without_one_outbox_row,
        outbox_unpublished,
        quota,
        replies_by_worker,
        mock,
    })
}

type KafkaFacts = (Vec<SourceRecord>, HashSet<(i32, i64)>, HashMap<i32, i64>);

fn read_kafka(
    kafka: &crate::config::KafkaSettings,
    rules: &RecordRules,
) -> Result<KafkaFacts, CheckError> {
    let base = kafka.client_config();
    let source = read_topic(&base, &kafka.topic, |m| SourceRecord {
        partition: m.partition(),
        offset: m.offset(),
        // The worker's own rules, the record's own timestamp: a record is a task here
        // exactly when the worker would have made one of it.
        task: TaskSpec::from_record(
            m.payload(),
            m.timestamp()
                .to_millis()
                .and_then(chrono::DateTime::from_timestamp_millis),
            rules,
        )
        .ok()
        .map(|t| t.task_id.as_uuid()),
    })?;
    let dead = read_topic(&base, &kafka.dead_letter_topic(), |m| {
        let mut partition = None;
        let mut offset = None;
        if let Some(hs) = m.headers() {
            for h in hs.iter() {
                let value = h.value.and_then(|v| std::str::from_utf8(v).ok());
                match h.key {
                    headers::SOURCE_PARTITION => partition = value.and_then(|v| v.parse().ok()),
                    headers::SOURCE_OFFSET => offset = value.and_then(|v| v.parse().ok()),
                    _ => {}
                }
            }
        }
        partition.zip(offset)
    })?
    .into_iter()
    .flatten()
    .collect();
    let partitions: HashSet<i32> = source.iter().map(|r| r.partition).collect();
    let committed = committed_offsets_with(&base, &kafka.group_id, &kafka.topic, partitions)?;
    Ok((source, dead, committed))
}

/// Judges the facts. Pure.
pub fn verdict(facts: Facts) -> Report {
    let mut lost = 0;
    let mut bad_records = 0;
    let mut uncommitted_records = 0;
    for record in &facts.source {
        let below_commit = facts
            .committed
            .get(&record.partition)
            .is_some_and(|c| record.offset < *c);
        let dead_lettered = facts.dead.contains(&(record.partition, record.offset));
        if record.task.is_none() {
            bad_records += 1;
        }
        if !below_commit {
            uncommitted_records += 1;
        }
        if !below_commit || dead_lettered {
            continue;
        }
        let terminal = record
            .task
            .and_then(|id| facts.statuses.get(&id))
            .is_some_and(|s| s.is_terminal());
        if !terminal {
            lost += 1;
        }
    }
    let count =
        |status: TaskStatus| facts.statuses.values().filter(|s| **s == status).count() as i64;
    let mut attempts_per_task = facts.attempts_per_task;
    attempts_per_task.sort_unstable();
    let tasks = facts.statuses.len() as i64;
    let mut report = Report {
        tasks,
        completed: count(TaskStatus::Completed),
        failed: count(TaskStatus::Failed),
        pending: count(TaskStatus::Pending) + count(TaskStatus::Running),
        dead_lettered: facts.dead.len() as i64,
        records: facts.source.len() as i64,
        bad_records,
        uncommitted_records,
        duplicate_replies: facts.duplicate_replies,
        lost,
        fenced_rejections: facts.fenced_rejections,
        refused_calls: facts.refused_calls,
        attempts: attempts_per_task.iter().sum(),
        attempts_per_task: Percentiles {
            p50: percentile(&attempts_per_task, 0.50),
            p99: percentile(&attempts_per_task, 0.99),
            max: attempts_per_task.last().copied().unwrap_or(0),
        },
        max_attempts_exceeded: facts.max_attempts_exceeded,
        duplicate_tasks: facts.duplicate_tasks,
        tasks_without_one_outbox_row: facts.tasks_without_one_outbox_row,
        outbox_unpublished: facts.outbox_unpublished,
        reservations_open: facts.quota.open,
        reservations_charged: facts.quota.charged,
        reservations_released: facts.quota.released,
        reservations_expired: facts.quota.expired,
        reservations_unsettled: facts.quota.unsettled,
        reservations_unresolved: facts.quota.unresolved,
        completed_without_charge: facts.quota.completed_without_charge,
        charges_without_reply: facts.quota.charges_without_reply,
        quota_counter_mismatches: facts.quota.counter_mismatches,
        token_charge_mismatches: facts.quota.token_charge_mismatches,
        replies_by_worker: facts.replies_by_worker,
        mock_requests: facts.mock.map(|m| m.requests),
        mock_generations: facts.mock.map(|m| m.generations),
        mock_requests_per_task: facts
            .mock
            .filter(|_| tasks > 0)
            .map(|m| m.requests as f64 / tasks as f64),
        violations: Vec::new(),
    };
    if report.duplicate_replies > 0 {
        report
            .violations
            .push("I1 one reply: tasks with more than one accepted reply".into());
    }
    if report.lost > 0 {
        report.violations.push(
            "I3 nothing lost: records committed past without a terminal task or dead-letter copy"
                .into(),
        );
    }
    if report.max_attempts_exceeded > 0 {
        report
            .violations
            .push("I7 bounded effort: tasks with more attempts than max_attempts".into());
    }
    if report.reservations_unsettled > 0
        || report.completed_without_charge > 0
        || report.charges_without_reply > 0
        || report.quota_counter_mismatches > 0
        || report.token_charge_mismatches > 0
    {
        report.violations.push(
            "I8 quota once: a reservation past its TTL unsettled, a completed task without its charge, a charge without its reply, a counter that disagrees with its reservations, or a token charge other than the reply's reported usage (else its ceiling)"
                .into(),
        );
    }
    if report.duplicate_tasks > 0 || report.tasks_without_one_outbox_row > 0 {
        report.violations.push(
            "I6 one logical request: a submission with more than one task, or an API task without exactly one outbox row"
                .into(),
        );
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(partition: i32, offset: i64, task: Option<Uuid>) -> SourceRecord {
        SourceRecord {
            partition,
            offset,
            task,
        }
    }

    #[test]
    fn a_record_committed_past_without_an_outcome_is_lost() {
        let (done, open) = (Uuid::new_v4(), Uuid::new_v4());
        let facts = Facts {
            source: vec![
                record(0, 0, Some(done)),
                record(0, 1, None),
                record(0, 2, Some(open)),
                record(0, 3, Some(open)),
            ],
            // Offset 1 is a bad record with its dead-letter copy; 2 is committed past while
            // its task is still running; 3 is not committed past yet.
            dead: HashSet::from([(0, 1)]),
            committed: HashMap::from([(0, 3)]),
            statuses: HashMap::from([(done, TaskStatus::Completed), (open, TaskStatus::Running)]),
            ..Facts::default()
        };
        let report = verdict(facts);
        assert_eq!(report.lost, 1);
        assert_eq!(report.bad_records, 1);
        assert_eq!(report.uncommitted_records, 1);
        assert_eq!((report.completed, report.pending), (1, 1));
        assert_eq!(report.violations.len(), 1);
        assert!(
            report.violations[0].starts_with("I3"),
            "{:?}",
            report.violations
        );
    }

    #[test]
    fn duplicates_and_budget_overruns_name_i1_i7_and_i6() {
        let report = verdict(Facts {
            duplicate_replies: 1,
            max_attempts_exceeded: 2,
            duplicate_tasks: 1,
            ..Facts::default()
        });
        let named: Vec<&str> = report.violations.iter().map(|v| &v[..2]).collect();
        assert_eq!(named, ["I1", "I7", "I6"]);
        assert!(report.render_table().contains("BROKEN"));
    }

    #[test]
    fn the_table_and_the_summary_show_the_mock_beside_the_attempts() {
        let task = Uuid::new_v4();
        let report = verdict(Facts {
            statuses: HashMap::from([(task, TaskStatus::Completed)]),
            attempts_per_task: vec![2],
            replies_by_worker: BTreeMap::from([("w1".to_string(), 1)]),
            mock: Some(MockCounts {
                requests: 2,
                generations: 1,
            }),
            ..Facts::default()
        });
        assert_eq!(report.mock_requests_per_task, Some(2.0));
        let table = report.render_table();
        assert!(table.contains("every invariant holds"), "{table}");
        assert!(table.contains("2.000 per task"), "{table}");
        assert!(!table.contains("Report {"), "{table}");
        let line = report.summary_line();
        assert!(
            line.contains("provider_requests=2 generations=1 replies_by_worker=w1:1"),
            "{line}"
        );
    }
}
