//! `[kafka]`: where the records come from, how the group behaves, and how every Kafka client
//! of replyd reaches the brokers (`[kafka.security]`). The settings tree (`crate::config`)
//! holds it; the consumer, the relay, the dead-letter producer and the checker read it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::setting_problems::SettingProblems;
use replyd_core::secret::Secret;

/// Kafka: where the records come from and how the group behaves.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
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
    /// `session.timeout.ms` for the classic protocol (unset: librdkafka's default, 45000).
    /// Refused with the `consumer` protocol, whose session timeout is the broker's
    /// `group.consumer.session.timeout.ms`.
    pub session_timeout_ms: Option<u64>,
    /// `group.instance.id`: static membership (KIP-345). A worker that restarts with the
    /// same id within the session timeout gets its partitions back without a rebalance of the
    /// group, so a rolling restart moves nothing. Each worker needs its own id that survives
    /// its restarts (the chart's StatefulSet uses the pod's name); empty: dynamic membership.
    /// A static member that leaves for good holds its partitions until its session expires.
    pub group_instance_id: String,
    /// How long start-up keeps retrying to reach the brokers before giving up.
    pub startup_retry_ms: u64,
    /// Where records that cannot become tasks go. Empty means `<topic>.dlq`.
    pub dead_letter_topic: String,
    /// Any other librdkafka consumer property, passed through as is (e.g.
    /// `"fetch.max.bytes" = "1048576"`). Properties replyd sets itself (`enable.auto.commit`,
    /// `enable.auto.offset.store`, `group.id`, `group.protocol`) are refused here. Its
    /// defaults may be set here: `auto.offset.reset` (`earliest`), `statistics.interval.ms`
    /// (5000), with the classic protocol `partition.assignment.strategy` (`cooperative-sticky`),
    /// and `queued.min.messages` (four times `worker.read_ahead`, at least 8192, where
    /// librdkafka's own default of 100000 a partition holds up to 64 MiB of fetched records).
    pub librdkafka: BTreeMap<String, String>,
    /// librdkafka properties for the producers (dead-letter copies, the relay, `replyd-lab
    /// produce`). `bootstrap.servers`, `enable.idempotence` and `acks` are set by replyd.
    pub producer_librdkafka: BTreeMap<String, String>,
    /// How every Kafka client of replyd (the group consumer, the producers, the relay, the
    /// checker) reaches the brokers: TLS and SASL.
    pub security: KafkaSecurity,
    /// The largest record replyd publishes, in bytes, as librdkafka counts it (key, value,
    /// headers and framing). The relay's producer takes it as `message.max.bytes`, and the
    /// API refuses (`422`) a request whose task record would be larger, since the relay could
    /// never publish it; `worker.max_prompt_bytes` must fit in it with the largest ids the
    /// API takes (validated). Keep it at most the topic's `max.message.bytes` (the broker's
    /// default is 1048588). librdkafka default: 1000000.
    pub max_record_bytes: usize,
}

/// TLS and SASL for the brokers. The properties it sets are refused in the pass-through maps,
/// so there is one place to read them, and the password is never shown.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, Default, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaSecurity {
    /// `security.protocol`: `plaintext`, `ssl`, `sasl_plaintext` or `sasl_ssl`.
    pub protocol: SecurityProtocol,
    /// `ssl.ca.location`: a PEM file of the CAs that sign the brokers' certificates. Empty:
    /// the system's store. The brokers' host names are always verified.
    pub ca_file: String,
    /// `sasl.mechanisms`: `SCRAM-SHA-256`, `SCRAM-SHA-512` or `PLAIN`.
    pub sasl_mechanism: SaslMechanism,
    /// `sasl.username`.
    pub sasl_username: String,
    /// `sasl.password`; never logged, `config show` prints `***`. Default: none.
    pub sasl_password: Option<Secret>,
}

/// librdkafka's `security.protocol`.
#[derive(
    Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum SecurityProtocol {
    #[default]
    Plaintext,
    Ssl,
    SaslPlaintext,
    SaslSsl,
}

impl SecurityProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plaintext => "plaintext",
            Self::Ssl => "ssl",
            Self::SaslPlaintext => "sasl_plaintext",
            Self::SaslSsl => "sasl_ssl",
        }
    }

    pub(crate) fn uses_sasl(self) -> bool {
        matches!(self, Self::SaslPlaintext | Self::SaslSsl)
    }

    pub(crate) fn uses_tls(self) -> bool {
        matches!(self, Self::Ssl | Self::SaslSsl)
    }
}

/// librdkafka's `sasl.mechanisms` that take a user name and a password.
#[derive(
    Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default, schemars::JsonSchema,
)]
pub enum SaslMechanism {
    #[default]
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    #[serde(rename = "PLAIN")]
    Plain,
}

impl SaslMechanism {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ScramSha512 => "SCRAM-SHA-512",
            Self::ScramSha256 => "SCRAM-SHA-256",
            Self::Plain => "PLAIN",
        }
    }
}

/// The librdkafka properties `kafka.security` owns.
const SECURITY_LIBRDKAFKA: &[&str] = &[
    "security.protocol",
    "ssl.ca.location",
    "sasl.mechanism",
    "sasl.mechanisms",
    "sasl.username",
    "sasl.password",
];

impl KafkaSecurity {
    /// The librdkafka properties, the password among them (for a client, never for display).
    pub fn properties(&self) -> Vec<(&'static str, String)> {
        let mut out = vec![("security.protocol", self.protocol.as_str().to_owned())];
        if self.protocol.uses_tls() {
            // Verify the brokers' names, whatever librdkafka's default of the day.
            out.push(("ssl.endpoint.identification.algorithm", "https".into()));
            if !self.ca_file.is_empty() {
                out.push(("ssl.ca.location", self.ca_file.clone()));
            }
        }
        if self.protocol.uses_sasl() {
            out.push(("sasl.mechanisms", self.sasl_mechanism.as_str().into()));
            out.push(("sasl.username", self.sasl_username.clone()));
            if let Some(password) = &self.sasl_password {
                out.push(("sasl.password", password.expose().to_owned()));
            }
        }
        out
    }
}

/// Group protocol choice.
#[derive(
    Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default, schemars::JsonSchema,
)]
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
            group_instance_id: String::new(),
            group_protocol: GroupProtocol::Classic,
            session_timeout_ms: None,
            startup_retry_ms: 60_000,
            dead_letter_topic: String::new(),
            librdkafka: BTreeMap::new(),
            producer_librdkafka: BTreeMap::new(),
            security: KafkaSecurity::default(),
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
        }
    }
}

/// librdkafka's `message.max.bytes` default.
pub const DEFAULT_MAX_RECORD_BYTES: usize = 1_000_000;

/// The range librdkafka takes for `message.max.bytes`.
const MESSAGE_MAX_BYTES_RANGE: std::ops::RangeInclusive<usize> = 1_000..=1_000_000_000;

/// librdkafka's `session.timeout.ms` default.
pub const DEFAULT_SESSION_TIMEOUT_MS: u64 = 45_000;

/// The broker's `group.consumer.session.timeout.ms` default (KIP-848 groups).
pub const BROKER_CONSUMER_SESSION_TIMEOUT_MS: u64 = 45_000;

impl KafkaSettings {
    /// What is wrong with `[kafka]` on its own: empty names, pass-through properties replyd owns or that hold secrets (each property checked by librdkafka itself), security that contradicts itself, the record size. Each problem names its setting.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = SettingProblems::default();
        if self.bootstrap_servers.trim().is_empty() {
            out.refuse("kafka.bootstrap_servers", "is empty".into());
        }
        if self.topic.trim().is_empty() {
            out.refuse("kafka.topic", "is empty".into());
        }
        if self.dead_letter_topic() == self.topic {
            out.refuse(
                "kafka.dead_letter_topic",
                "must differ from kafka.topic, or bad records would be read again".into(),
            );
        }
        if self.group_id.trim().is_empty() {
            out.refuse("kafka.group_id", "is empty".into());
        }
        for key in self.librdkafka.keys() {
            if key == "group.instance.id" {
                out.refuse(
                    "kafka.librdkafka",
                    "`group.instance.id` is kafka.group_instance_id (settable from the environment, one per worker)".into(),
                );
            } else if RESERVED_LIBRDKAFKA.contains(&key.as_str()) {
                out.refuse(
                    "kafka.librdkafka",
                    format!("`{key}` is set by replyd itself and cannot be overridden"),
                );
            } else if self.group_protocol == GroupProtocol::Consumer
                && CLASSIC_ONLY_LIBRDKAFKA.contains(&key.as_str())
            {
                out.refuse(
                    "kafka.librdkafka",
                    format!(
                        "`{key}` does not apply to group_protocol = \"consumer\" (KIP-848): the broker decides it"
                    ),
                );
            }
        }
        for (setting, map) in [
            ("kafka.librdkafka", &self.librdkafka),
            ("kafka.producer_librdkafka", &self.producer_librdkafka),
        ] {
            for (key, value) in map {
                if RESERVED_LIBRDKAFKA.contains(&key.as_str()) && setting == "kafka.librdkafka" {
                    continue; // reported above
                }
                if SECURITY_LIBRDKAFKA.contains(&key.as_str()) {
                    out.refuse(
                        setting,
                        format!("`{key}` belongs in [kafka.security], which every client reads"),
                    );
                    continue;
                }
                if key.contains("password") || key.contains("secret") {
                    // A pass-through value is printed by `config show`: no secret goes there.
                    out.refuse(
                        setting,
                        format!(
                            "`{key}` is a secret, and pass-through values are shown by `replyd config show`"
                        ),
                    );
                    continue;
                }
                // librdkafka checks names and values when a configuration is built, with no
                // client and no network: a typo is refused here, before anything connects.
                if let Err(e) = rdkafka::ClientConfig::new()
                    .set(key, value)
                    .create_native_config()
                {
                    out.refuse(setting, format!("`{key}` = {value:?}: {e}"));
                }
            }
        }
        let security = &self.security;
        if security.protocol.uses_sasl()
            && (security.sasl_username.is_empty() || security.sasl_password.is_none())
        {
            out.refuse(
                "kafka.security.sasl_username",
                format!(
                    "protocol = \"{}\" needs sasl_username and sasl_password",
                    security.protocol.as_str()
                ),
            );
        }
        if !security.ca_file.is_empty() {
            if !security.protocol.uses_tls() {
                out.refuse(
                    "kafka.security.ca_file",
                    format!(
                        "protocol = \"{}\" does not use TLS: set protocol to ssl or sasl_ssl, or remove ca_file",
                        security.protocol.as_str()
                    ),
                );
            } else if let Err(e) = std::fs::metadata(&security.ca_file) {
                out.refuse(
                    "kafka.security.ca_file",
                    format!("{}: {e}", security.ca_file),
                );
            }
        }
        if self.group_protocol == GroupProtocol::Consumer && self.session_timeout_ms.is_some() {
            out.refuse(
                "kafka.session_timeout_ms",
                "does not apply to group_protocol = \"consumer\" (KIP-848): the broker's group.consumer.session.timeout.ms decides it; remove the setting".into(),
            );
        }
        if !MESSAGE_MAX_BYTES_RANGE.contains(&self.max_record_bytes) {
            out.refuse(
                "kafka.max_record_bytes",
                format!(
                    "{} is outside librdkafka's range for message.max.bytes, {} to {}",
                    self.max_record_bytes,
                    MESSAGE_MAX_BYTES_RANGE.start(),
                    MESSAGE_MAX_BYTES_RANGE.end()
                ),
            );
        }
        if let Some(set) = self.producer_librdkafka.get("message.max.bytes")
            && set.trim() != self.max_record_bytes.to_string()
        {
            out.refuse(
                "kafka.producer_librdkafka",
                format!(
                    "`message.max.bytes` = {set:?} contradicts kafka.max_record_bytes ({}), which sets it for the relay: set kafka.max_record_bytes instead",
                    self.max_record_bytes
                ),
            );
        }
        out.into()
    }

    /// What every Kafka client of replyd starts from: the brokers and `kafka.security`. Each
    /// client adds its own properties on top.
    pub fn client_config(&self) -> rdkafka::ClientConfig {
        let mut config = rdkafka::ClientConfig::new();
        config.set("bootstrap.servers", &self.bootstrap_servers);
        for (key, value) in self.security.properties() {
            config.set(key, value);
        }
        config
    }

    /// What every producer of replyd starts from (the relay's, the dead-letter copies', the
    /// replay's): [`Self::client_config`], the pass-through producer properties, then
    /// idempotent writes that all in-sync replicas acknowledged. A record is durable before
    /// what depends on it moves on (an outbox row marked, an offset committed), and a retried
    /// send never writes it twice.
    pub fn producer_config(&self) -> rdkafka::ClientConfig {
        let mut config = self.client_config();
        for (key, value) in &self.producer_librdkafka {
            config.set(key, value);
        }
        config.set("enable.idempotence", "true").set("acks", "all");
        config
    }

    /// The classic protocol's session timeout: the setting, or librdkafka's default.
    pub fn session_timeout_ms(&self) -> u64 {
        self.session_timeout_ms
            .unwrap_or(DEFAULT_SESSION_TIMEOUT_MS)
    }

    /// How long the group may take to notice a vanished member: the classic session timeout,
    /// or under KIP-848 the broker's `group.consumer.session.timeout.ms`, which replyd cannot
    /// read and takes at its default.
    pub fn group_session_timeout_ms(&self) -> u64 {
        match self.group_protocol {
            GroupProtocol::Classic => self.session_timeout_ms(),
            GroupProtocol::Consumer => BROKER_CONSUMER_SESSION_TIMEOUT_MS,
        }
    }

    pub fn dead_letter_topic(&self) -> String {
        if self.dead_letter_topic.is_empty() {
            format!("{}.dlq", self.topic)
        } else {
            self.dead_letter_topic.clone()
        }
    }
}

/// librdkafka properties replyd owns; overriding them would break I3.
const RESERVED_LIBRDKAFKA: &[&str] = &[
    "enable.auto.commit",
    "enable.auto.offset.store",
    "group.id",
    "group.instance.id",
    "group.protocol",
    "bootstrap.servers",
];

/// librdkafka properties of the classic protocol that KIP-848 moves to the broker.
const CLASSIC_ONLY_LIBRDKAFKA: &[&str] = &[
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "partition.assignment.strategy",
];
