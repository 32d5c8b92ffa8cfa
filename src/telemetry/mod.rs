//! Telemetry, in one room: every metric and every notable event (this file: each event function
//! writes its log line and bumps its counter together, so the names of all metrics live here),
//! the HTTP endpoints that expose them ([`http`]: `/metrics`, `/healthz`, `/readyz`), and the
//! log set-up ([`logging`]).

pub mod logging;
pub mod trace;

use std::time::Duration;

use metrics::{counter, gauge, histogram};

use replyd_core::offsets::PartitionKey;

/// Names of the metrics, as Prometheus shows them.
pub mod names {
    pub const RECORDS_RECEIVED: &str = "replyd_records_received_total";
    pub const RECORDS_DONE: &str = "replyd_records_done_total";
    pub const RECORDS_DEAD_LETTERED: &str = "replyd_records_dead_lettered_total";
    pub const RECORD_CONFLICTS: &str = "replyd_record_conflicts_total";
    pub const CLAIMS: &str = "replyd_claims_total";
    pub const COMPLETIONS: &str = "replyd_completions_total";
    pub const PROVIDER_CALLS: &str = "replyd_provider_calls_total";
    pub const PROVIDER_SECONDS: &str = "replyd_provider_call_seconds";
    pub const CAPACITY_WAIT_SECONDS: &str = "replyd_capacity_wait_seconds";
    pub const CAPACITY_WAITING: &str = "replyd_capacity_waiting_records";
    pub const CAPACITY_REFUSALS: &str = "replyd_capacity_refusals_total";
    pub const CAPACITY_LIMIT: &str = "replyd_capacity_requests_per_second";
    pub const PROVIDER_TOKENS: &str = "replyd_provider_tokens_total";
    pub const PROVIDER_USAGE_UNREPORTED: &str = "replyd_provider_usage_unreported_total";
    pub const COMPLETION_BATCH_ROWS: &str = "replyd_completion_batch_rows";
    pub const RENEWAL_BATCH_ROWS: &str = "replyd_lease_renewal_batch_rows";
    pub const CLAIM_BATCH_ROWS: &str = "replyd_claim_batch_rows";
    pub const RETRIES: &str = "replyd_retries_total";
    pub const LEASE_RENEWALS_REFUSED: &str = "replyd_lease_renewals_refused_total";
    pub const STORE_ERRORS: &str = "replyd_store_errors_total";
    pub const DEAD_LETTER_ERRORS: &str = "replyd_dead_letter_errors_total";
    pub const IN_FLIGHT: &str = "replyd_in_flight_records";
    pub const OLDEST_IN_FLIGHT_SECONDS: &str = "replyd_oldest_in_flight_seconds";
    pub const CONSUMER_LAG: &str = "replyd_consumer_lag_records";
    pub const PAUSED_PARTITIONS: &str = "replyd_paused_partitions";
    pub const ASSIGNED_PARTITIONS: &str = "replyd_assigned_partitions";
    pub const COMMITS: &str = "replyd_offset_commits_total";
    pub const COMMIT_ERRORS: &str = "replyd_offset_commit_errors_total";
    pub const REBALANCES: &str = "replyd_rebalances_total";
    pub const DRAIN_LEFTOVERS: &str = "replyd_drain_cancelled_records_total";
    pub const CONSUMER_ERRORS: &str = "replyd_consumer_errors_total";
    pub const WATCHED_TASKS: &str = "replyd_watched_tasks";
    pub const WAKE_UPS: &str = "replyd_parked_wake_ups_total";
    pub const LISTENER_CONNECTS: &str = "replyd_listener_connects_total";
    pub const LISTENER_LOSSES: &str = "replyd_listener_losses_total";
    pub const TASKS_FAILED_AT_CLAIM: &str = "replyd_tasks_failed_at_claim_total";
    pub const LIBRDKAFKA_LOGS: &str = "replyd_librdkafka_logs_total";
    pub const API_REFUSALS: &str = "replyd_api_refusals_total";
    pub const SUBMISSIONS: &str = "replyd_api_submissions_total";
    pub const OUTBOX_PUBLISHED: &str = "replyd_outbox_published_total";
    pub const OUTBOX_PUBLISH_ERRORS: &str = "replyd_outbox_publish_errors_total";
    pub const OUTBOX_REFUSED: &str = "replyd_outbox_refused_total";
    pub const OUTBOX_PURGED: &str = "replyd_outbox_purged_total";
    pub const OUTBOX_UNPUBLISHED: &str = "replyd_outbox_unpublished";
    pub const OUTBOX_OLDEST_SECONDS: &str = "replyd_outbox_oldest_unpublished_seconds";
    pub const IDEMPOTENCY_KEYS_PURGED: &str = "replyd_idempotency_keys_purged_total";
    pub const QUOTA_RECONCILED: &str = "replyd_quota_reconciled_total";
    pub const QUOTA_REFUSED: &str = "replyd_quota_refused_total";
    pub const QUOTA_OVERDUE: &str = "replyd_quota_reservations_overdue";
}

use names::*;

/// Upper bounds of the provider-call latency buckets, in seconds.
pub const PROVIDER_SECONDS_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Upper bounds of the capacity wait buckets, in seconds.
pub const CAPACITY_WAIT_BUCKETS: &[f64] = &[
    0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Upper bounds of the completion and claim batch size buckets, in rows.
pub const COMPLETION_BATCH_ROWS_BUCKETS: &[f64] =
    &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Upper bounds of the lease renewal batch size buckets, in leases.
pub const RENEWAL_BATCH_ROWS_BUCKETS: &[f64] = &[1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0];

/// What kind of series a metric family is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// The metric families a worker exports.
pub const WORKER_METRICS: &[(&str, Kind)] = &[
    (RECORDS_RECEIVED, Kind::Counter),
    (RECORDS_DONE, Kind::Counter),
    (RECORDS_DEAD_LETTERED, Kind::Counter),
    (RECORD_CONFLICTS, Kind::Counter),
    (CLAIMS, Kind::Counter),
    (COMPLETIONS, Kind::Counter),
    (PROVIDER_CALLS, Kind::Counter),
    (PROVIDER_SECONDS, Kind::Histogram),
    (CAPACITY_WAIT_SECONDS, Kind::Histogram),
    (CAPACITY_WAITING, Kind::Gauge),
    (CAPACITY_REFUSALS, Kind::Counter),
    (CAPACITY_LIMIT, Kind::Gauge),
    (PROVIDER_TOKENS, Kind::Counter),
    (PROVIDER_USAGE_UNREPORTED, Kind::Counter),
    (COMPLETION_BATCH_ROWS, Kind::Histogram),
    (RENEWAL_BATCH_ROWS, Kind::Histogram),
    (CLAIM_BATCH_ROWS, Kind::Histogram),
    (RETRIES, Kind::Counter),
    (LEASE_RENEWALS_REFUSED, Kind::Counter),
    (STORE_ERRORS, Kind::Counter),
    (DEAD_LETTER_ERRORS, Kind::Counter),
    (IN_FLIGHT, Kind::Gauge),
    (OLDEST_IN_FLIGHT_SECONDS, Kind::Gauge),
    (CONSUMER_LAG, Kind::Gauge),
    (PAUSED_PARTITIONS, Kind::Gauge),
    (ASSIGNED_PARTITIONS, Kind::Gauge),
    (COMMITS, Kind::Counter),
    (COMMIT_ERRORS, Kind::Counter),
    (REBALANCES, Kind::Counter),
    (DRAIN_LEFTOVERS, Kind::Counter),
    (CONSUMER_ERRORS, Kind::Counter),
    (WATCHED_TASKS, Kind::Gauge),
    (WAKE_UPS, Kind::Counter),
    (LISTENER_CONNECTS, Kind::Counter),
    (LISTENER_LOSSES, Kind::Counter),
    (TASKS_FAILED_AT_CLAIM, Kind::Counter),
    (LIBRDKAFKA_LOGS, Kind::Counter),
];

/// The metric families the API exports.
pub const API_METRICS: &[(&str, Kind)] = &[
    (API_REFUSALS, Kind::Counter),
    (SUBMISSIONS, Kind::Counter),
    (QUOTA_REFUSED, Kind::Counter),
    (STORE_ERRORS, Kind::Counter),
];

/// The metric families the relay (and its quota reconciler) exports.
pub const RELAY_METRICS: &[(&str, Kind)] = &[
    (OUTBOX_PUBLISHED, Kind::Counter),
    (OUTBOX_PUBLISH_ERRORS, Kind::Counter),
    (OUTBOX_REFUSED, Kind::Counter),
    (OUTBOX_PURGED, Kind::Counter),
    (OUTBOX_UNPUBLISHED, Kind::Gauge),
    (OUTBOX_OLDEST_SECONDS, Kind::Gauge),
    (IDEMPOTENCY_KEYS_PURGED, Kind::Counter),
    (QUOTA_RECONCILED, Kind::Counter),
    (QUOTA_OVERDUE, Kind::Gauge),
    (LIBRDKAFKA_LOGS, Kind::Counter),
    (STORE_ERRORS, Kind::Counter),
];

/// Registers `families` at zero, so a dashboard or an alert finds each on the first scrape,
/// before the first event of its kind: a rate over a missing series is "no data", not 0. The
/// labelled series come with their events.
pub fn register(families: &[(&'static str, Kind)]) {
    for (name, kind) in families {
        match kind {
            Kind::Counter => counter!(*name).increment(0),
            Kind::Gauge => gauge!(*name).increment(0.0),
            Kind::Histogram => {
                let _ = histogram!(*name);
            }
        }
    }
}

/// An error with its causes, `outer: inner: innermost`: tokio-postgres, for one, says only
/// "db error" at the top and puts PostgreSQL's message in the source.
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.ends_with(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

/// Logs a failure that may repeat many times (a connection retried every few hundred
/// milliseconds) once per distinct message, and the recovery once, with how many it hid.
pub struct RepeatedFailure {
    what: &'static str,
    last: Option<String>,
    count: u64,
}

impl RepeatedFailure {
    pub fn new(what: &'static str) -> Self {
        Self {
            what,
            last: None,
            count: 0,
        }
    }

    /// Failures since the last success.
    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn failed(&mut self, error: &str) {
        self.count += 1;
        if self.last.as_deref() != Some(error) {
            tracing::warn!(
                what = self.what,
                error,
                "{} failed; retrying (logged once until it changes)",
                self.what
            );
            self.last = Some(error.to_owned());
        }
    }

    pub fn recovered(&mut self) {
        if self.count > 0 {
            tracing::info!(
                what = self.what,
                failures = self.count,
                "{} succeeded after {} failed attempts",
                self.what,
                self.count
            );
        }
        self.count = 0;
        self.last = None;
    }
}

pub fn record_received(key: &PartitionKey) {
    counter!(RECORDS_RECEIVED, "partition" => key.partition.to_string()).increment(1);
}

/// A record is finished; `how` says why.
pub fn record_done(key: &PartitionKey, offset: i64, how: replyd_core::domain::RecordEnd) {
    tracing::debug!(
        partition = key.partition,
        offset,
        how = how.as_str(),
        "record done"
    );
    counter!(RECORDS_DONE, "how" => how.as_str()).increment(1);
}

pub fn record_dead_lettered(key: &PartitionKey, offset: i64, kind: &'static str, reason: &str) {
    tracing::warn!(
        topic = %key.topic, partition = key.partition, offset, kind, reason,
        "bad record sent to the dead-letter topic"
    );
    counter!(RECORDS_DEAD_LETTERED, "kind" => kind).increment(1);
}

pub fn dead_letter_failed(key: &PartitionKey, offset: i64, error: &dyn std::error::Error) {
    tracing::error!(partition = key.partition, offset, error = %chain(error), "dead-letter write failed; will retry");
    counter!(DEAD_LETTER_ERRORS).increment(1);
}

pub fn record_conflicts_with_task(task_id: &str, offset: i64, fields: &[&'static str]) {
    tracing::warn!(
        task_id,
        offset,
        ?fields,
        "record disagrees with the stored task; stored inputs kept"
    );
    counter!(RECORD_CONFLICTS).increment(1);
}

/// What a claim found (`ClaimOutcome::label` is the metric label).
pub fn claim(task_id: &str, outcome: &replyd_core::lease::ClaimOutcome) {
    tracing::debug!(
        task_id,
        assignment_version = outcome.version(),
        outcome = outcome.label(),
        "claim"
    );
    counter!(CLAIMS, "outcome" => outcome.label()).increment(1);
}

/// A reply saved by this assignment (refusals are [`write_refused`]).
pub fn reply_accepted(task_id: &str, version: i64) {
    tracing::debug!(task_id, assignment_version = version, "completion accepted");
    counter!(COMPLETIONS, "outcome" => "accepted").increment(1);
}

/// How one provider call ended, for its metric label.
#[derive(Debug, Clone, Copy)]
pub enum CallEnd<'a> {
    Replied,
    Failed(&'a replyd_core::provider::ProviderError),
    /// Cut short: the partition was revoked or the worker is stopping.
    Cancelled,
    /// Cut short: a renewal was refused, so the lease is gone.
    LeaseLost,
}

impl CallEnd<'_> {
    pub fn label(self) -> &'static str {
        match self {
            CallEnd::Replied => "ok",
            CallEnd::Failed(error) => error.kind(),
            CallEnd::Cancelled => "cancelled",
            CallEnd::LeaseLost => "lease_lost",
        }
    }
}

pub fn provider_call(task_id: &str, version: i64, end: CallEnd<'_>, took: Duration) {
    tracing::debug!(
        task_id,
        assignment_version = version,
        outcome = end.label(),
        took_ms = took.as_millis() as u64,
        "provider call"
    );
    counter!(PROVIDER_CALLS, "outcome" => end.label()).increment(1);
    histogram!(PROVIDER_SECONDS).record(took.as_secs_f64());
}

/// How many records of this worker wait for `bucket`'s capacity now.
pub fn capacity_waiting(bucket: &str, records: usize) {
    gauge!(CAPACITY_WAITING, "model" => bucket.to_owned()).set(records as f64);
}

/// A record got its capacity permit after `waited`.
pub fn capacity_waited(bucket: &str, waited: Duration) {
    histogram!(CAPACITY_WAIT_SECONDS, "model" => bucket.to_owned()).record(waited.as_secs_f64());
}

/// The provider refused a call for capacity (a 429 or an overload): the deployment pauses.
pub fn capacity_refused(bucket: &str) {
    if once_a_minute(&format!("capacity-refused:{bucket}")) {
        tracing::warn!(
            model = bucket,
            "the provider refused a call for capacity; every worker pauses as it asked (repeats are held back for a minute)"
        );
    }
    counter!(CAPACITY_REFUSALS, "model" => bucket.to_owned()).increment(1);
}

/// The tokens a provider's answer reported, by the model asked and the kind (`prompt`,
/// `completion`); an answer that reported none is counted apart, never as 0 tokens.
pub fn provider_usage(model: &str, usage: Option<(u32, u32)>) {
    match usage {
        Some((prompt, completion)) => {
            counter!(PROVIDER_TOKENS, "model" => model.to_owned(), "kind" => "prompt")
                .increment(u64::from(prompt));
            counter!(PROVIDER_TOKENS, "model" => model.to_owned(), "kind" => "completion")
                .increment(u64::from(completion));
        }
        None => counter!(PROVIDER_USAGE_UNREPORTED, "model" => model.to_owned()).increment(1),
    }
}

/// The request rate the budget applies to `bucket` now: configured, or learned.
pub fn capacity_limit(bucket: &str, per_second: f64) {
    gauge!(CAPACITY_LIMIT, "model" => bucket.to_owned()).set(per_second);
}

/// A fenced write was refused: one INFO line with the refusal's class and both versions.
/// `current_version` is the task's version when the refusal knows it (a takeover).
pub fn write_refused(
    task_id: &str,
    what: &'static str,
    version: i64,
    refusal: &'static str,
    current_version: Option<i64>,
) {
    tracing::info!(
        task_id,
        what,
        refusal,
        assignment_version = version,
        current_version,
        "fenced write refused"
    );
    counter!(COMPLETIONS, "outcome" => refusal).increment(1);
}

/// A claim found the task out of budget or past its deadline and failed it, before any call
/// of this attempt: a producer mistake (a deadline in seconds) shows here.
pub fn task_failed_at_claim(task_id: &str, why: &'static str, reason: &str) {
    tracing::warn!(
        task_id,
        why,
        reason,
        "task failed at claim, with no provider call"
    );
    counter!(TASKS_FAILED_AT_CLAIM, "why" => why).increment(1);
}

/// An API request answered with a problem; `kind` is the problem's type.
pub fn api_refused(kind: &'static str, status: u16) {
    tracing::debug!(kind, status, "API request refused");
    counter!(API_REFUSALS, "kind" => kind).increment(1);
}

/// A submission accepted: new work, or a replay of an earlier request with the same key.
pub fn submission(replayed: bool) {
    counter!(SUBMISSIONS, "replayed" => if replayed { "true" } else { "false" }).increment(1);
}

pub fn outbox_published(rows: usize) {
    if rows > 0 {
        tracing::debug!(rows, "outbox rows published");
    }
    counter!(OUTBOX_PUBLISHED).increment(rows as u64);
}

pub fn outbox_publish_failed(outbox_id: i64, error: &rdkafka::error::KafkaError) {
    if once_a_minute(&format!("outbox:{}", shape_of(&error.to_string()))) {
        tracing::warn!(outbox_id, error = %chain(error), "publishing an outbox row failed; it stays for the next batch (repeats are held back for a minute)");
    }
    counter!(OUTBOX_PUBLISH_ERRORS).increment(1);
}

/// A record the broker will never take: its outbox row is refused and its task failed.
pub fn outbox_refused(outbox_id: i64, task_id: &str, reason: &str) {
    tracing::error!(
        outbox_id,
        task_id,
        reason,
        "the broker refused an outbox row's record for good; its task fails with the reason"
    );
    counter!(OUTBOX_REFUSED).increment(1);
}

pub fn outbox_purged(rows: u64) {
    counter!(OUTBOX_PURGED).increment(rows);
}

/// One decision of the quota's reconciler (`decision`: `ExpiredDecision::label`).
pub fn quota_reconciled(decision: &'static str) {
    counter!(QUOTA_RECONCILED, "decision" => decision).increment(1);
}

/// A submission the quota did not admit.
pub fn quota_refused() {
    counter!(QUOTA_REFUSED).increment(1);
}

pub fn idempotency_keys_purged(rows: u64) {
    counter!(IDEMPOTENCY_KEYS_PURGED).increment(rows);
}

pub fn outbox_lag(unpublished: i64, oldest_seconds: f64) {
    gauge!(OUTBOX_UNPUBLISHED).set(unpublished as f64);
    gauge!(OUTBOX_OLDEST_SECONDS).set(oldest_seconds);
}

pub fn watched_tasks(tasks: usize) {
    gauge!(WATCHED_TASKS).set(tasks as f64);
}

/// `source` is where the wake-up came from (`parking::WakeSource`'s label).
pub fn wake_up(source: &'static str, records: usize) {
    if records > 0 {
        tracing::debug!(source, records, "parked records woken");
    }
    counter!(WAKE_UPS, "source" => source).increment(records as u64);
}

pub fn listener_connected() {
    tracing::info!("listening for task status notifications");
    counter!(LISTENER_CONNECTS).increment(1);
}

pub fn listener_lost() {
    counter!(LISTENER_LOSSES).increment(1);
}

pub fn bad_notification(payload: &str) {
    tracing::warn!(payload, "task status notification not understood; ignored");
}

pub fn task_failed(task_id: &str, version: i64, reason: &str) {
    tracing::warn!(
        task_id,
        assignment_version = version,
        reason,
        "task failed for good"
    );
    counter!(COMPLETIONS, "outcome" => "failed").increment(1);
}

pub fn retry_planned(task_id: &str, version: i64, error_class: &'static str, after: Duration) {
    tracing::info!(
        task_id,
        assignment_version = version,
        error_class,
        after_ms = after.as_millis() as u64,
        "provider call failed; retrying after backoff"
    );
    counter!(RETRIES, "class" => error_class).increment(1);
}

pub fn lease_renewal_refused(task_id: &str, version: i64, why: &str) {
    tracing::warn!(
        task_id,
        assignment_version = version,
        why,
        "lease renewal refused; stopping the call"
    );
    counter!(LEASE_RENEWALS_REFUSED).increment(1);
}

pub fn store_error(operation: &'static str, error: &dyn std::error::Error) {
    tracing::warn!(operation, error = %chain(error), "database operation failed; will retry");
    counter!(STORE_ERRORS, "operation" => operation).increment(1);
}

pub fn in_flight(total: usize, paused: usize) {
    gauge!(IN_FLIGHT).set(total as f64);
    gauge!(PAUSED_PARTITIONS).set(paused as f64);
}

/// How long the oldest record still in flight on `partition` has been running or waiting
/// (0 when none): it holds the partition's commit point back.
pub fn oldest_in_flight(partition: i32, seconds: f64) {
    gauge!(OLDEST_IN_FLIGHT_SECONDS, "partition" => partition.to_string()).set(seconds);
}

/// Records of `partition` after the group's committed offset, up to the high watermark, as
/// librdkafka's statistics last said (0 for a partition this worker no longer has).
pub fn consumer_lag(partition: i32, records: i64) {
    gauge!(CONSUMER_LAG, "partition" => partition.to_string()).set(records as f64);
}

/// Open reservations past their TTL after a reconciler pass.
pub fn reservations_overdue(count: i64) {
    gauge!(QUOTA_OVERDUE).set(count as f64);
}

pub fn assigned(partitions: usize) {
    gauge!(ASSIGNED_PARTITIONS).set(partitions as f64);
}

pub fn rebalance(kind: &'static str, partitions: &[PartitionKey]) {
    let list: Vec<i32> = partitions.iter().map(|k| k.partition).collect();
    tracing::info!(kind, partitions = ?list, "rebalance");
    counter!(REBALANCES, "kind" => kind).increment(1);
}

/// A partition let go while paused for back-pressure. librdkafka keeps a partition's pause
/// across assignments, so it is resumed when it comes back (see `kafka::consumer`).
pub fn released_while_paused(partition: &PartitionKey) {
    tracing::info!(partition = partition.partition, "released while paused");
}

/// Records of a released partition that had not finished: after the drain timeout (`drained`)
/// or at once, when the partition was lost to another member.
pub fn cancelling_left_over(partition: &PartitionKey, records: usize, drained: bool) {
    let why = if drained {
        "drain timeout"
    } else {
        "partition lost"
    };
    tracing::warn!(
        partition = partition.partition,
        records,
        why,
        "cancelling records still in flight"
    );
    counter!(DRAIN_LEFTOVERS).increment(records as u64);
}

pub fn committed(points: &[(PartitionKey, i64)], sync: bool) {
    tracing::debug!(?points, sync, "committed offsets");
    counter!(COMMITS, "mode" => if sync { "sync" } else { "async" }).increment(1);
}

/// The commit of partitions being let go was sent but not seen committed within `bound`: the
/// next owner may read some of their done records again (refused at claim, no call).
pub fn release_commit_unconfirmed(points: &[(PartitionKey, i64)], bound: std::time::Duration) {
    counter!(COMMIT_ERRORS, "expected" => "false").increment(1);
    tracing::warn!(
        ?points,
        bound_ms = bound.as_millis() as u64,
        "offset commit of released partitions not confirmed in time; letting them go"
    );
}

/// Whether a Kafka error is the expected, self-healing kind of a group in motion (a commit
/// from a generation the group has left, a coordinator still loading): counted, logged once a
/// minute at INFO, never paged on. Anything else is a real failure and stays a WARN.
pub fn is_expected_in_rebalance(error: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode::*;
    matches!(
        error.rdkafka_error_code(),
        Some(
            IllegalGeneration
                | RebalanceInProgress
                | UnknownMemberId
                | FencedMemberEpoch
                | StaleMemberEpoch
                | CoordinatorLoadInProgress
                | NotCoordinator
                | State
                | AssignmentLost
        )
    )
}

/// An offset commit failed. `sync` says which path: a synchronous commit returns its error to
/// the caller (the drain of a revoke); an asynchronous one reports in `commit_callback`.
pub fn commit_failed(error: &rdkafka::error::KafkaError, sync: bool) {
    let expected = is_expected_in_rebalance(error);
    counter!(COMMIT_ERRORS, "expected" => if expected { "true" } else { "false" }).increment(1);
    if expected {
        if once_a_minute("commit-expected") {
            tracing::info!(error = %chain(error), sync, "offset commit refused while the group moves on; the next owner resumes from the last committed offset (logged once a minute)");
        }
    } else {
        tracing::warn!(error = %chain(error), sync, "offset commit failed");
    }
}

/// True at most once a minute per `key`: for conditions that repeat while they last.
fn once_a_minute(key: &str) -> bool {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    use std::time::Instant;
    static LAST: OnceLock<Mutex<HashMap<String, Instant>>> = OnceLock::new();
    let mut last = LAST
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    match last.get(key) {
        Some(at) if now.duration_since(*at) < Duration::from_secs(60) => false,
        _ => {
            last.insert(key.to_owned(), now);
            true
        }
    }
}

/// A log line's shape: numbers and librdkafka's own "(after 3ms in state CONNECT, 2 identical
/// error(s) suppressed)" tail taken out, so repeats of one condition share a key.
fn shape_of(message: &str) -> String {
    let head = message.split(" (after ").next().unwrap_or(message);
    head.chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .collect()
}

/// Expected conditions librdkafka logs at WARN or ERROR while a group moves or a coordinator
/// starts; they heal by themselves.
const EXPECTED_LIBRDKAFKA: &[&str] = &[
    "generation id is not valid",
    "Coordinator load in progress",
    "rebalance in progress",
    "Unknown member",
    "Broker: Not coordinator",
    "member epoch",
];

/// One librdkafka log line. A broker that is down makes librdkafka log the same failure
/// several times a second: each distinct line (numbers aside) is logged once a minute, with
/// how many were held back counted in `replyd_librdkafka_logs_total`. Expected conditions of
/// a moving group are INFO, not paged on.
pub fn librdkafka_log(level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
    use rdkafka::config::RDKafkaLogLevel::*;
    let expected = EXPECTED_LIBRDKAFKA.iter().any(|e| message.contains(e));
    let severity = match level {
        _ if expected => "info",
        Emerg | Alert | Critical | Error => "error",
        Warning => "warn",
        Notice | Info => "info",
        Debug => "debug",
    };
    counter!(LIBRDKAFKA_LOGS, "level" => severity).increment(1);
    if severity == "debug" {
        tracing::debug!(target: "librdkafka", fac, "{message}");
        return;
    }
    if !once_a_minute(&format!("{fac}:{}", shape_of(message))) {
        return;
    }
    match severity {
        "error" => {
            tracing::error!(target: "librdkafka", fac, "{message} (repeats are held back for a minute)")
        }
        "warn" => {
            tracing::warn!(target: "librdkafka", fac, "{message} (repeats are held back for a minute)")
        }
        _ => tracing::info!(target: "librdkafka", fac, "{message}"),
    }
}

/// A client error event (librdkafka's error callback): expected ones at INFO, once a minute.
pub fn kafka_client_error(error: &rdkafka::error::KafkaError, reason: &str) {
    counter!(CONSUMER_ERRORS).increment(1);
    if is_expected_in_rebalance(error) {
        if once_a_minute("client-expected") {
            tracing::info!(target: "librdkafka", error = %error, reason, "expected while the group moves (logged once a minute)");
        }
    } else if once_a_minute(&format!("client:{}", shape_of(reason))) {
        tracing::warn!(target: "librdkafka", error = %error, reason, "client error (repeats are held back for a minute)");
    }
}

/// An error the consumer's poll returned (a broker connection lost, say): librdkafka raises
/// the same one on every retry, so it is logged like its client errors, once a minute.
pub fn consumer_error(error: &rdkafka::error::KafkaError) {
    kafka_client_error(error, &error.to_string());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_of_one_condition_share_a_shape() {
        let first = "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 0ms in state CONNECT)";
        let again = "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 12ms in state CONNECT, 3 identical error(s) suppressed)";
        assert_eq!(shape_of(first), shape_of(again));
        assert_eq!(
            shape_of("1/1 brokers are down"),
            shape_of("0/1 brokers are down")
        );
        assert_ne!(
            shape_of("Connect to ipv4#127.0.0.1:1 failed"),
            shape_of("Failed to resolve 'kafka.internal:9092'")
        );
    }

    #[test]
    fn a_repeated_line_passes_once_a_minute() {
        let key = format!("test-{}", uuid::Uuid::new_v4());
        assert!(once_a_minute(&key));
        assert!(!once_a_minute(&key));
    }

    #[test]
    fn the_chain_says_each_cause_once() {
        let inner = std::io::Error::other("Connection refused (os error 111)");
        #[derive(Debug, thiserror::Error)]
        #[error("error connecting to server: {0}")]
        struct Outer(#[source] std::io::Error);
        assert_eq!(
            chain(&Outer(inner)),
            "error connecting to server: Connection refused (os error 111)"
        );
    }
}
