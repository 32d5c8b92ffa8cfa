//! The durable state read into plain values: PostgreSQL (tasks, attempts, the intake's tables,
//! the quota ledger), the source's records as its transport reads them
//! (`Transports::read_records`: a topic with its dead-letter twin and the group's committed
//! offsets, or a queue's depth), and the mock provider's counters. Every figure is read back; the verdict judges them.

use std::collections::BTreeMap;

use crate::config::Settings;
use crate::store::{connect_error, session_config, tls_connector};
use crate::transport::Transport;
use crate::transport::records::{ReadError, SourceRecords};
use crate::transport::sqs::Sqs;
use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::{AttemptOutcome, TaskStatus};
use replyd_core::tally::RecordTallies;

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
    #[error(transparent)]
    Sqs(#[from] crate::transport::sqs::SqsError),
    #[error("{0}")]
    Other(String),
}

impl CheckError {
    /// A source's read failing, named with the brokers it asked where they were Kafka's.
    fn of_read(error: ReadError, bootstrap: &str) -> Self {
        match error {
            ReadError::Database(e) => CheckError::Database(e),
            ReadError::Kafka(error) => CheckError::Kafka {
                bootstrap: bootstrap.to_owned(),
                error,
            },
            ReadError::Sqs(e) => CheckError::Sqs(e),
            ReadError::Other(why) => CheckError::Other(why),
        }
    }
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
    /// Where the workers take their records from: a topic, or an SQS queue.
    pub source: Transport,
    /// The source topic's records, judged one by one and counted (on SQS: the queue's and its
    /// dead-letter queue's messages, [`QueueFacts::tallies`](replyd_core::tally::QueueFacts::tallies)).
    pub records: RecordTallies,
    /// Source records with a dead-letter copy.
    pub dead_lettered: i64,
    pub statuses: StatusCounts,
    pub duplicate_replies: i64,
    pub fenced_rejections: i64,
    pub refused_calls: i64,
    /// Attempts per task (refusals aside): their sum and quantiles.
    pub attempts: AttemptStats,
    pub max_attempts_exceeded: i64,
    pub duplicate_tasks: i64,
    pub tasks_without_one_outbox_row: i64,
    pub outbox_unpublished: i64,
    pub quota: QuotaFacts,
    pub replies_by_worker: BTreeMap<String, i64>,
    pub mock: Option<MockCounts>,
}

/// Tasks by status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatusCounts {
    pub tasks: i64,
    pub completed: i64,
    pub failed: i64,
    /// Stopped by their users.
    pub cancelled: i64,
    /// Pending or running.
    pub open: i64,
}

/// The attempts of every task (refusals aside), by the nearest-rank method.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttemptStats {
    pub total: i64,
    pub p50: i64,
    pub p99: i64,
    pub max: i64,
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
    /// Reservations of cancelled tasks not settled by the Stop's rule: charged when a call
    /// may have run, released only when none can have started.
    pub cancelled_misettled: i64,
    pub charges_without_reply: i64,
    pub counter_mismatches: i64,
    pub token_charge_mismatches: i64,
}

/// Reads the topic, its dead-letter twin, the committed offsets, the task tables and the
/// mock's counters.
pub async fn read_facts(
    settings: &Settings,
    mock_url: Option<&str>,
    sqs: Option<Sqs>,
) -> Result<Facts, CheckError> {
    let config = session_config(&settings.database)?;
    let (client, connection) = config
        .connect(tls_connector(&settings.database)?)
        .await
        .map_err(|e| connect_error(&settings.database, &e))?;
    tokio::spawn(connection);
    let SourceRecords {
        tallies: records,
        dead_lettered,
    } = settings
        .transports()
        .read_records(
            settings.worker.source,
            settings.worker.record_rules(),
            &client,
            sqs,
        )
        .await
        .map_err(|e| CheckError::of_read(e, &settings.kafka.bootstrap_servers))?;
    let statuses = client
        .query_one(
            "SELECT count(*), \
               count(*) FILTER (WHERE status = $1), \
               count(*) FILTER (WHERE status = $2), \
               count(*) FILTER (WHERE status IN ($3, $4)), \
               count(*) FILTER (WHERE status = $5) \
             FROM reply_tasks",
            &[
                &TaskStatus::Completed.as_str(),
                &TaskStatus::Failed.as_str(),
                &TaskStatus::Pending.as_str(),
                &TaskStatus::Running.as_str(),
                &TaskStatus::Cancelled.as_str(),
            ],
        )
        .await?;
    let statuses = StatusCounts {
        tasks: statuses.get(0),
        completed: statuses.get(1),
        failed: statuses.get(2),
        open: statuses.get(3),
        cancelled: statuses.get(4),
    };
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
    // tasks), one outbox row per API-created task and per retry of a failed task, and every
    // row published after a drain.
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
            "SELECT count(*) FROM (SELECT task_id, created_at FROM idempotency_keys \
                                   UNION ALL SELECT task_id, created_at FROM reply_tasks \
                                   WHERE retry_of IS NOT NULL) k, \
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
                                    AND (r.charge_on_failure OR t.provider_may_have_run)) \
                                OR (t.status = 'cancelled' AND t.provider_may_have_run))), \
               (SELECT count(*) FROM quota_counters q WHERE (q.reserved, q.tokens_reserved) <> \
                  (SELECT count(*), coalesce(sum(o.token_ceiling), 0) FROM quota_reservations o \
                    WHERE o.workspace_id = q.workspace_id AND o.state = 'reserved')), \
               count(*) FILTER (WHERE r.state <> 'reserved' AND NOT (t.status = 'cancelled' \
                                AND r.state = 'charged' AND r.tokens_charged <= greatest(r.token_ceiling, \
                                    (SELECT coalesce(sum(a.prompt_tokens + a.completion_tokens), 0) \
                                       FROM reply_attempts a WHERE a.task_id = t.task_id))) \
                 AND r.tokens_charged IS DISTINCT FROM \
                 CASE WHEN r.state <> 'charged' THEN 0 \
                      ELSE coalesce((SELECT a.prompt_tokens + a.completion_tokens \
                                       FROM reply_attempts a \
                                      WHERE a.task_id = t.task_id \
                                        AND a.assignment_version = t.assignment_version \
                                        AND t.status = 'completed'), r.token_ceiling) END), \
               count(*) FILTER (WHERE t.status = 'cancelled' AND r.state <> \
                                CASE WHEN t.provider_may_have_run THEN 'charged' ELSE 'released' END) \
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
        cancelled_misettled: row.get(10),
    };
    // Nearest rank: percentile_disc(p) is the value at rank ceil(p × n).
    let attempts = client
        .query_one(
            "SELECT coalesce(sum(n), 0)::bigint, \
               coalesce(percentile_disc(0.5) WITHIN GROUP (ORDER BY n), 0), \
               coalesce(percentile_disc(0.99) WITHIN GROUP (ORDER BY n), 0), \
               coalesce(max(n), 0) \
             FROM (SELECT count(a.task_id) FILTER (WHERE a.outcome IS DISTINCT FROM 'refused') AS n \
                   FROM reply_tasks t LEFT JOIN reply_attempts a USING (task_id) \
                   GROUP BY t.task_id) per_task",
            &[],
        )
        .await?;
    let attempts = AttemptStats {
        total: attempts.get(0),
        p50: attempts.get(1),
        p99: attempts.get(2),
        max: attempts.get(3),
    };
    let replies_by_worker = client
        .query(
            // By worker id: a lease owner is the id and its run's incarnation (`w1#3f0c…`).
            "SELECT split_part(worker, '#', 1), count(*) FROM reply_attempts \
             WHERE outcome = $1 GROUP BY 1",
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
        source: settings.worker.source,
        records,
        dead_lettered,
        statuses,
        duplicate_replies,
        fenced_rejections,
        refused_calls,
        attempts,
        max_attempts_exceeded,
        duplicate_tasks,
        tasks_without_one_outbox_row,
        outbox_unpublished,
        quota,
        replies_by_worker,
        mock,
    })
}
