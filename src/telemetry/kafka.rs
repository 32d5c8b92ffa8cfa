//! Events of the Kafka consumer: records received, finished and dead-lettered, the windows
//! and lag, the group's rebalances, offset commits, and librdkafka's own logs and errors.

use metrics::{Counter, Gauge, counter, gauge};

use super::catalogue::names::*;
use super::kept::Kept;
use super::lines::{chain, once_a_minute, shape_of};
use replyd_core::offsets::PartitionKey;

pub fn record_received(key: &PartitionKey) {
    static KEPT: Kept<i32, Counter> = Kept::new();
    KEPT.get(
        &key.partition,
        || counter!(RECORDS_RECEIVED, "partition" => key.partition.to_string()),
    )
    .increment(1);
}

/// A record is finished; `how` says why.
pub fn record_done(key: &PartitionKey, offset: i64, how: replyd_core::domain::RecordEnd) {
    static KEPT: Kept<&'static str, Counter> = Kept::new();
    let how = how.as_str();
    tracing::debug!(partition = key.partition, offset, how, "record done");
    KEPT.get(&how, || counter!(RECORDS_DONE, "how" => how))
        .increment(1);
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

/// Partitions paused or resumed for back-pressure: at debug, so that a partition that stays
/// silent can be traced to its last pause or resume.
pub fn back_pressure(paused: &[PartitionKey], resumed: &[PartitionKey]) {
    if paused.is_empty() && resumed.is_empty() {
        return;
    }
    let list = |keys: &[PartitionKey]| keys.iter().map(|k| k.partition).collect::<Vec<_>>();
    tracing::debug!(paused = ?list(paused), resumed = ?list(resumed), "back-pressure");
}

pub fn in_flight(total: usize, paused: usize) {
    static KEPT: Kept<(), (Gauge, Gauge)> = Kept::new();
    let (in_flight, paused_partitions) =
        KEPT.one(|| (gauge!(IN_FLIGHT), gauge!(PAUSED_PARTITIONS)));
    in_flight.set(total as f64);
    paused_partitions.set(paused as f64);
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
/// A partition sat still with records in Kafka past the next offset to read, unpaused, for
/// two statistics reports (`replyd_core::fetch_watch`): its fetcher is restarted there. What
/// librdkafka said of it is logged, so the stall can be explained.
pub fn fetch_restarted(partition: &PartitionKey, from: i64, client: &str) {
    tracing::warn!(
        partition = partition.partition,
        from,
        client,
        "partition not fetched while records wait; fetching restarted at the next offset"
    );
    counter!(FETCH_RESTARTS).increment(1);
}

pub fn fetch_restart_failed(partition: &PartitionKey, error: &dyn std::error::Error) {
    tracing::warn!(partition = partition.partition, error = %chain(error), "fetch restart failed; the next report tries again");
}

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
