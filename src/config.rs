//! Settings: one typed tree, read from a TOML file and then `REPLYD_*` environment variables
//! (`REPLYD_KAFKA__TOPIC=x` sets `kafka.topic`), then checked by [`Settings::validate`], which
//! refuses contradictions with a message naming the setting. Secrets live in [`Secret`], whose
//! `Debug` and `Display` never show the value, so a settings dump cannot leak a password.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::Deserialize;

use crate::domain::RecordRules;
use crate::provider::OpenAiSettings;
use crate::retry::RetrySettings;

/// A value that must never be logged (database URLs with passwords, API keys).
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself, for the one place that needs it (a connection, a request header).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// How replyd talks to PostgreSQL.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseSettings {
    /// libpq-style URL, e.g. `postgres://user:pass@127.0.0.1:5432/replyd`. A `?options=-c
    /// search_path=...` parameter is honoured (the tests use it to give each test a schema).
    pub url: Secret,
    /// Connections in the pool. Every in-flight record holds one only for the length of one
    /// short statement or transaction, never across a provider call (I4).
    pub pool_size: usize,
    /// `lock_timeout` of every session: a statement that waits longer on a row lock (say, one
    /// held by a stalled process) fails instead of hanging a worker.
    pub lock_timeout_ms: u64,
    /// `idle_in_transaction_session_timeout`: the server ends a session that sits inside a
    /// transaction this long, so a stopped (SIGSTOP) worker cannot keep row locks.
    pub idle_in_transaction_session_timeout_ms: u64,
    /// `statement_timeout` of every session.
    pub statement_timeout_ms: u64,
    /// Keep one session that `LISTEN`s for task status changes, so a record parked on a task
    /// leased elsewhere wakes as soon as that task is done. Turn off where LISTEN cannot work
    /// (behind a transaction-pooling PgBouncer): parked records then wait out the lease.
    pub listen: bool,
    /// How long start-up keeps retrying to reach PostgreSQL before giving up.
    pub startup_retry_ms: u64,
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: Secret::new("postgres://replyd:replyd@127.0.0.1:5432/replyd"),
            pool_size: 16,
            lock_timeout_ms: 5_000,
            idle_in_transaction_session_timeout_ms: 10_000,
            statement_timeout_ms: 30_000,
            listen: true,
            startup_retry_ms: 60_000,
        }
    }
}

impl DatabaseSettings {
    pub fn lock_timeout(&self) -> Duration {
        Duration::from_millis(self.lock_timeout_ms)
    }
}

/// Everything `replyd worker` reads.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    pub database: DatabaseSettings,
    pub kafka: KafkaSettings,
    pub worker: WorkerSettings,
    pub observability: ObservabilitySettings,
    pub provider: OpenAiSettings,
    pub retry: RetrySettings,
}

/// Kafka: where the records come from and how the group behaves.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaSettings {
    /// `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// Topic of reply-task records.
    pub topic: String,
    /// Consumer group id.
    pub group_id: String,
    /// Group protocol: `classic` (with the cooperative-sticky assignor) or `consumer`
    /// (KIP-848, where the broker decides the session timeout). librdkafka default: classic.
    pub group_protocol: GroupProtocol,
    /// `session.timeout.ms` for the classic protocol (librdkafka default 45000). Ignored by
    /// the `consumer` protocol, whose session timeout is the broker's
    /// `group.consumer.session.timeout.ms`.
    pub session_timeout_ms: u64,
    /// Where records that cannot become tasks go. Empty means `<topic>.dlq`.
    pub dead_letter_topic: String,
    /// Any other librdkafka consumer property, passed through as is (e.g.
    /// `"fetch.max.bytes" = "1048576"`). Properties replyd sets itself (`enable.auto.commit`,
    /// `enable.auto.offset.store`, `group.id`, `group.protocol`) are refused here.
    pub librdkafka: BTreeMap<String, String>,
    /// librdkafka properties for the producers (dead-letter copies, `replyd produce`), e.g.
    /// security settings. `bootstrap.servers`, `enable.idempotence` and `acks` are set by replyd.
    pub producer_librdkafka: BTreeMap<String, String>,
}

/// Group protocol choice.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum GroupProtocol {
    #[default]
    Classic,
    Consumer,
}

impl GroupProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            GroupProtocol::Classic => "classic",
            GroupProtocol::Consumer => "consumer",
        }
    }
}

impl Default for KafkaSettings {
    fn default() -> Self {
        Self {
            bootstrap_servers: "127.0.0.1:9092".into(),
            topic: "reply-tasks".into(),
            group_id: "replyd".into(),
            group_protocol: GroupProtocol::Classic,
            session_timeout_ms: 45_000,
            dead_letter_topic: String::new(),
            librdkafka: BTreeMap::new(),
            producer_librdkafka: BTreeMap::new(),
        }
    }
}

impl KafkaSettings {
    pub fn dead_letter_topic(&self) -> String {
        if self.dead_letter_topic.is_empty() {
            format!("{}.dlq", self.topic)
        } else {
            self.dead_letter_topic.clone()
        }
    }
}

/// How the worker processes records.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSettings {
    /// Name of this worker in leases and attempt rows. Empty means `<hostname>-<pid>`.
    pub worker_id: String,
    /// Records of one partition processed at once; the partition is paused when full.
    pub partition_window: usize,
    /// Records processed at once over all partitions.
    pub global_window: usize,
    /// Records of one partition received and waiting for a window slot. When this many wait,
    /// the partition is paused; it resumes when half have started. Memory stays bounded by
    /// window + read-ahead records per partition, and the read-ahead hides the refetch delay
    /// after a resume.
    pub read_ahead: usize,
    /// Length of a task lease. A worker that stalls longer loses the task to another.
    pub lease_ms: u64,
    /// How often a running call renews its lease; well under `lease_ms`.
    pub renew_interval_ms: u64,
    /// How long a revoked partition's in-flight records may run before their offsets are
    /// committed and the partition let go; what is left is cancelled (and fenced, I2).
    pub drain_timeout_ms: u64,
    /// How often each partition's done prefix is committed.
    pub commit_interval_ms: u64,
    /// Largest prompt a record may carry (bytes); larger records are dead-lettered.
    pub max_prompt_bytes: usize,
    /// Attempt budget of records that do not set one.
    pub default_max_attempts: u32,
    /// Largest attempt budget a record may ask for.
    pub max_attempts_limit: u32,
    /// Wait before retrying a database or dead-letter write that failed.
    pub io_retry_ms: u64,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        let rules = RecordRules::default();
        Self {
            worker_id: String::new(),
            partition_window: 64,
            global_window: 256,
            read_ahead: 64,
            lease_ms: 30_000,
            renew_interval_ms: 10_000,
            drain_timeout_ms: 10_000,
            commit_interval_ms: 1_000,
            max_prompt_bytes: rules.max_prompt_bytes,
            default_max_attempts: rules.default_max_attempts,
            max_attempts_limit: rules.max_attempts_limit,
            io_retry_ms: 500,
        }
    }
}

impl WorkerSettings {
    pub fn record_rules(&self) -> RecordRules {
        RecordRules {
            default_max_attempts: self.default_max_attempts,
            max_attempts_limit: self.max_attempts_limit,
            max_prompt_bytes: self.max_prompt_bytes,
        }
    }

    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }

    pub fn renew_interval(&self) -> Duration {
        Duration::from_millis(self.renew_interval_ms)
    }

    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }

    pub fn commit_interval(&self) -> Duration {
        Duration::from_millis(self.commit_interval_ms)
    }

    pub fn io_retry(&self) -> Duration {
        Duration::from_millis(self.io_retry_ms)
    }

    /// The configured id, or `<hostname>-<pid>`.
    pub fn resolved_worker_id(&self) -> String {
        if !self.worker_id.is_empty() {
            return self.worker_id.clone();
        }
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "replyd".into());
        format!("{host}-{}", std::process::id())
    }
}

/// Metrics and health endpoints, logs.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ObservabilitySettings {
    /// Address of `/metrics`, `/healthz` and `/readyz`. Port 0 picks a free port (logged).
    pub listen: SocketAddr,
}

impl Default for ObservabilitySettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
        }
    }
}

/// A setting that contradicts another or cannot work; the message names the setting.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read settings: {0}")]
    Load(#[from] Box<figment::Error>),
    #[error("{setting}: {reason}")]
    Invalid {
        setting: &'static str,
        reason: String,
    },
}

fn invalid(setting: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        setting,
        reason: reason.into(),
    }
}

/// librdkafka properties replyd owns; overriding them would break I3.
const RESERVED_LIBRDKAFKA: &[&str] = &[
    "enable.auto.commit",
    "enable.auto.offset.store",
    "group.id",
    "group.protocol",
    "bootstrap.servers",
];

/// librdkafka properties of the classic protocol that KIP-848 moves to the broker.
const CLASSIC_ONLY_LIBRDKAFKA: &[&str] = &[
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "partition.assignment.strategy",
];

impl Settings {
    /// Reads `file` (if given) and then `REPLYD_*` variables (`__` separates levels), and
    /// validates the result.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut figment = Figment::new();
        if let Some(file) = file {
            if !file.exists() {
                return Err(invalid(
                    "--config",
                    format!("{} does not exist", file.display()),
                ));
            }
            figment = figment.merge(Toml::file(file));
        }
        // Only nested keys (`REPLYD_KAFKA__TOPIC`) are settings; other `REPLYD_*` variables
        // (`REPLYD_LOG_JSON` for the CLI, the infra script's) are not ours to refuse.
        let settings: Settings = figment
            .merge(
                Env::prefixed("REPLYD_")
                    .filter(|key| key.as_str().contains("__"))
                    .split("__"),
            )
            .extract()
            .map_err(Box::new)?;
        settings.validate()?;
        Ok(settings)
    }

    /// Refuses settings that contradict each other or cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let w = &self.worker;
        let k = &self.kafka;
        if k.bootstrap_servers.trim().is_empty() {
            return Err(invalid("kafka.bootstrap_servers", "is empty"));
        }
        if k.topic.trim().is_empty() {
            return Err(invalid("kafka.topic", "is empty"));
        }
        if k.dead_letter_topic() == k.topic {
            return Err(invalid(
                "kafka.dead_letter_topic",
                "must differ from kafka.topic, or bad records would be read again",
            ));
        }
        if k.group_id.trim().is_empty() {
            return Err(invalid("kafka.group_id", "is empty"));
        }
        if let Some(key) = k
            .librdkafka
            .keys()
            .find(|key| RESERVED_LIBRDKAFKA.contains(&key.as_str()))
        {
            return Err(invalid(
                "kafka.librdkafka",
                format!("`{key}` is set by replyd itself and cannot be overridden"),
            ));
        }
        if k.group_protocol == GroupProtocol::Consumer
            && let Some(key) = k
                .librdkafka
                .keys()
                .find(|key| CLASSIC_ONLY_LIBRDKAFKA.contains(&key.as_str()))
        {
            return Err(invalid(
                "kafka.librdkafka",
                format!(
                    "`{key}` does not apply to group_protocol = \"consumer\" (KIP-848): the broker decides it"
                ),
            ));
        }
        if w.partition_window == 0 || w.global_window == 0 {
            return Err(invalid(
                "worker.partition_window",
                "windows must be at least 1",
            ));
        }
        if w.partition_window > w.global_window {
            return Err(invalid(
                "worker.partition_window",
                format!(
                    "{} is larger than worker.global_window ({})",
                    w.partition_window, w.global_window
                ),
            ));
        }
        if w.renew_interval_ms == 0 || w.renew_interval_ms * 2 > w.lease_ms {
            return Err(invalid(
                "worker.renew_interval_ms",
                format!(
                    "{} must be positive and at most half of worker.lease_ms ({}), so one lost renewal does not lose the lease",
                    w.renew_interval_ms, w.lease_ms
                ),
            ));
        }
        if k.group_protocol == GroupProtocol::Classic && w.drain_timeout_ms >= k.session_timeout_ms
        {
            return Err(invalid(
                "worker.drain_timeout_ms",
                format!(
                    "{} must be below kafka.session_timeout_ms ({}): a revoke that drains longer than the session is fenced by the group anyway",
                    w.drain_timeout_ms, k.session_timeout_ms
                ),
            ));
        }
        if w.default_max_attempts == 0 || w.default_max_attempts > w.max_attempts_limit {
            return Err(invalid(
                "worker.default_max_attempts",
                format!(
                    "{} must be between 1 and worker.max_attempts_limit ({})",
                    w.default_max_attempts, w.max_attempts_limit
                ),
            ));
        }
        if self.retry.base_delay_ms == 0 || self.retry.base_delay_ms > self.retry.max_delay_ms {
            return Err(invalid(
                "retry.base_delay_ms",
                format!(
                    "{} must be positive and at most retry.max_delay_ms ({})",
                    self.retry.base_delay_ms, self.retry.max_delay_ms
                ),
            ));
        }
        if w.commit_interval_ms == 0 {
            return Err(invalid("worker.commit_interval_ms", "must be positive"));
        }
        if self.database.pool_size == 0 {
            return Err(invalid("database.pool_size", "must be at least 1"));
        }
        Ok(())
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        Settings::default().validate().unwrap();
    }

    #[test]
    fn contradictions_name_the_setting() {
        let mut s = Settings::default();
        s.worker.drain_timeout_ms = s.kafka.session_timeout_ms;
        let err = s.validate().unwrap_err().to_string();
        assert!(err.starts_with("worker.drain_timeout_ms:"), "{err}");

        let mut s = Settings::default();
        s.worker.renew_interval_ms = s.worker.lease_ms;
        assert!(
            s.validate()
                .unwrap_err()
                .to_string()
                .starts_with("worker.renew_interval_ms:")
        );

        let mut s = Settings::default();
        s.kafka
            .librdkafka
            .insert("enable.auto.commit".into(), "true".into());
        assert!(
            s.validate()
                .unwrap_err()
                .to_string()
                .contains("enable.auto.commit")
        );

        let mut s = Settings::default();
        s.kafka.group_protocol = GroupProtocol::Consumer;
        s.kafka
            .librdkafka
            .insert("heartbeat.interval.ms".into(), "500".into());
        assert!(
            s.validate()
                .unwrap_err()
                .to_string()
                .contains("heartbeat.interval.ms")
        );

        let mut s = Settings::default();
        s.kafka.dead_letter_topic = s.kafka.topic.clone();
        assert!(
            s.validate()
                .unwrap_err()
                .to_string()
                .starts_with("kafka.dead_letter_topic:")
        );
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's test jail returns its own error type
    fn file_then_environment_with_unknown_keys_refused() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "replyd.toml",
                r#"
                [kafka]
                topic = "from-file"
                [kafka.librdkafka]
                "fetch.wait.max.ms" = "50"
                [worker]
                partition_window = 8
                "#,
            )?;
            jail.set_env("REPLYD_KAFKA__TOPIC", "from-env");
            jail.set_env("REPLYD_LOG_JSON", "true");
            let s = Settings::load(Some(Path::new("replyd.toml"))).unwrap();
            assert_eq!(s.kafka.topic, "from-env");
            assert_eq!(s.worker.partition_window, 8);
            assert_eq!(s.kafka.librdkafka["fetch.wait.max.ms"], "50");

            jail.create_file("bad.toml", "[worker]\nparition_window = 8\n")?;
            let err = Settings::load(Some(Path::new("bad.toml")))
                .unwrap_err()
                .to_string();
            assert!(err.contains("parition_window"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn the_example_file_is_valid_and_shows_the_defaults() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/replyd.example.toml");
        let from_file: Settings = Figment::new()
            .merge(Toml::file(path))
            .extract()
            .expect("the example parses");
        assert_eq!(from_file, Settings::default());
    }

    #[test]
    fn secrets_never_print_their_value() {
        let settings = DatabaseSettings {
            url: Secret::new("postgres://u:hunter2@db/replyd"),
            ..DatabaseSettings::default()
        };
        let shown = format!("{settings:?} {}", settings.url);
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
