//! The catalogue of metrics: every name as Prometheus shows it, the histograms' buckets, and
//! the families each process registers at zero on start.

use metrics::{counter, gauge, histogram};

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
    pub const CAPACITY_WORKSPACE_WAIT_SECONDS: &str = "replyd_capacity_workspace_wait_seconds";
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
    pub const FETCH_RESTARTS: &str = "replyd_fetch_restarts_total";
    pub const DRAIN_LEFTOVERS: &str = "replyd_drain_cancelled_records_total";
    pub const CONSUMER_ERRORS: &str = "replyd_consumer_errors_total";
    pub const WATCHED_TASKS: &str = "replyd_watched_tasks";
    pub const WAKE_UPS: &str = "replyd_parked_wake_ups_total";
    pub const LISTENER_CONNECTS: &str = "replyd_listener_connects_total";
    pub const LISTENER_LOSSES: &str = "replyd_listener_losses_total";
    pub const LISTENER_IDLE_ENDS: &str = "replyd_listener_idle_ends_total";
    pub const TASKS_FAILED_AT_CLAIM: &str = "replyd_tasks_failed_at_claim_total";
    pub const LIBRDKAFKA_LOGS: &str = "replyd_librdkafka_logs_total";
    pub const API_REFUSALS: &str = "replyd_api_refusals_total";
    pub const SUBMISSIONS: &str = "replyd_api_submissions_total";
    pub const CANCELS: &str = "replyd_api_cancels_total";
    pub const HISTORY_DROPPED: &str = "replyd_api_history_messages_dropped_total";
    pub const END_USER_TOKENS: &str = "replyd_api_end_user_tokens_issued_total";
    pub const HTTP_REQUEST_SECONDS: &str = "replyd_http_request_duration_seconds";
    pub const OUTBOX_PUBLISHED: &str = "replyd_outbox_published_total";
    pub const OUTBOX_PUBLISH_ERRORS: &str = "replyd_outbox_publish_errors_total";
    pub const OUTBOX_REFUSED: &str = "replyd_outbox_refused_total";
    pub const OUTBOX_PURGED: &str = "replyd_outbox_purged_total";
    pub const OUTBOX_UNPUBLISHED: &str = "replyd_outbox_unpublished";
    pub const OUTBOX_OLDEST_SECONDS: &str = "replyd_outbox_oldest_unpublished_seconds";
    pub const IDEMPOTENCY_KEYS_PURGED: &str = "replyd_idempotency_keys_purged_total";
    pub const TASKS_FORGOTTEN: &str = "replyd_tasks_forgotten_total";
    pub const FORGOTTEN_PURGED: &str = "replyd_forgotten_ids_purged_total";
    pub const QUOTA_RECONCILED: &str = "replyd_quota_reconciled_total";
    pub const QUOTA_REFUSED: &str = "replyd_quota_refused_total";
    pub const QUOTA_OVERDUE: &str = "replyd_quota_reservations_overdue";
    pub const SQS_RECEIVED: &str = "replyd_sqs_messages_received_total";
    pub const SQS_DUPLICATE_RECEIVES: &str = "replyd_sqs_duplicate_receives_total";
    pub const SQS_RECEIVED_AGE_SECONDS: &str = "replyd_sqs_received_message_age_seconds";
    pub const SQS_DELETED: &str = "replyd_sqs_messages_deleted_total";
    pub const SQS_HANDED_BACK: &str = "replyd_sqs_messages_handed_back_total";
    pub const SQS_VISIBILITY_EXTENSIONS: &str = "replyd_sqs_visibility_extensions_total";
    pub const SQS_ENTRIES_REFUSED: &str = "replyd_sqs_batch_entries_refused_total";
    pub const SQS_ERRORS: &str = "replyd_sqs_errors_total";
    pub const SQS_QUEUE_MESSAGES: &str = "replyd_sqs_queue_messages";
    pub const LIVE_PIECES: &str = "replyd_live_text_pieces_total";
    pub const LIVE_BYTES: &str = "replyd_live_text_bytes_total";
    pub const PROVIDER_STREAMS: &str = "replyd_provider_streams_total";
    pub const API_LIVE_EVENTS: &str = "replyd_api_live_events_total";
}

use names::*;

/// Upper bounds of the provider-call latency buckets, in seconds.
pub const PROVIDER_SECONDS_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Upper bounds of the API's request latency buckets, in seconds: an intake is one short
/// transaction, so the fine buckets are under a second.
pub const HTTP_REQUEST_SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
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

/// Each histogram and the upper bounds of its buckets.
pub const HISTOGRAM_BUCKETS: &[(&str, &[f64])] = &[
    (PROVIDER_SECONDS, PROVIDER_SECONDS_BUCKETS),
    (HTTP_REQUEST_SECONDS, HTTP_REQUEST_SECONDS_BUCKETS),
    (CAPACITY_WAIT_SECONDS, CAPACITY_WAIT_BUCKETS),
    (CAPACITY_WORKSPACE_WAIT_SECONDS, CAPACITY_WAIT_BUCKETS),
    (COMPLETION_BATCH_ROWS, COMPLETION_BATCH_ROWS_BUCKETS),
    (CLAIM_BATCH_ROWS, COMPLETION_BATCH_ROWS_BUCKETS),
    (RENEWAL_BATCH_ROWS, RENEWAL_BATCH_ROWS_BUCKETS),
];

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
    (CAPACITY_WORKSPACE_WAIT_SECONDS, Kind::Histogram),
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
    (FETCH_RESTARTS, Kind::Counter),
    (DRAIN_LEFTOVERS, Kind::Counter),
    (CONSUMER_ERRORS, Kind::Counter),
    (WATCHED_TASKS, Kind::Gauge),
    (WAKE_UPS, Kind::Counter),
    (LISTENER_CONNECTS, Kind::Counter),
    (LISTENER_LOSSES, Kind::Counter),
    (LISTENER_IDLE_ENDS, Kind::Counter),
    (TASKS_FAILED_AT_CLAIM, Kind::Counter),
    (LIBRDKAFKA_LOGS, Kind::Counter),
    (LIVE_PIECES, Kind::Counter),
    (LIVE_BYTES, Kind::Counter),
    (PROVIDER_STREAMS, Kind::Counter),
];

/// The metric families a worker whose source is SQS exports beside [`WORKER_METRICS`] (a relay
/// sending to SQS counts its refused entries and failed calls the same way).
pub const SQS_METRICS: &[(&str, Kind)] = &[
    (SQS_RECEIVED, Kind::Counter),
    (SQS_DUPLICATE_RECEIVES, Kind::Counter),
    (SQS_RECEIVED_AGE_SECONDS, Kind::Gauge),
    (SQS_DELETED, Kind::Counter),
    (SQS_HANDED_BACK, Kind::Counter),
    (SQS_VISIBILITY_EXTENSIONS, Kind::Counter),
    (SQS_ENTRIES_REFUSED, Kind::Counter),
    (SQS_ERRORS, Kind::Counter),
    (SQS_QUEUE_MESSAGES, Kind::Gauge),
];

/// The metric families the API exports.
pub const API_METRICS: &[(&str, Kind)] = &[
    (API_REFUSALS, Kind::Counter),
    (SUBMISSIONS, Kind::Counter),
    (CANCELS, Kind::Counter),
    (HISTORY_DROPPED, Kind::Counter),
    (END_USER_TOKENS, Kind::Counter),
    (API_LIVE_EVENTS, Kind::Counter),
    (HTTP_REQUEST_SECONDS, Kind::Histogram),
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
    (TASKS_FORGOTTEN, Kind::Counter),
    (FORGOTTEN_PURGED, Kind::Counter),
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
