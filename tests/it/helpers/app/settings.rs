//! The settings files of a test's processes: the workers' TOML with the routes applied (direct
//! or through a fault proxy, on Kafka or SQS), and the files and commands an operator runs
//! against the test's parts.

use std::path::PathBuf;
use std::process::Command;

use super::{Routes, TestApp};

impl TestApp {
    /// The `[sqs]` table and the source and sink that use it, on a test on SQS.
    pub(super) fn sqs_toml(&self) -> String {
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

    pub(super) fn worker_toml(&self, name: &str) -> String {
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
live_text_interval_ms = {live_text}

[provider]
base_url = "{mock}"
request_timeout_ms = {timeout}
api = "{api}"
poll_interval_ms = 100
{stream}
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
            // Unset: `"auto"`, as shipped.
            stream = c
                .stream
                .map(|stream| format!("stream = {stream}\n"))
                .unwrap_or_default(),
            live_text = c.live_text_interval_ms,
            token_key = crate::helpers::api::TOKEN_KEY,
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
    pub(super) fn worker_database_url(&self) -> String {
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

    pub(super) fn direct_toml(&self) -> String {
        let routes = std::mem::take(&mut *self.routes.lock().unwrap_or_else(|p| p.into_inner()));
        let text = self.worker_toml("operator");
        *self.routes.lock().unwrap_or_else(|p| p.into_inner()) = routes;
        text
    }
}
