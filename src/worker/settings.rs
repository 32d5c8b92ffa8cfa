//! `[worker]`: how the worker processes records. The settings tree (`crate::config`) holds
//! it; the consumer, the pipeline and the runner read it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::setting_problems::SettingProblems;
use crate::transport::Transport;
use crate::transport::source::Holding;
use replyd_core::domain::RecordRules;
use replyd_core::retry::RetrySettings;

/// How the worker processes records.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSettings {
    /// Where the worker takes records from: `kafka` (the consumer group of `[kafka]`) or
    /// `sqs` (the queue of `[sqs]`).
    pub source: Transport,
    /// Name of this worker (a pod's name with static membership). Empty means
    /// `<hostname>-<pid>`. Its leases and attempt rows name it with the process's incarnation,
    /// `<worker_id>#<token>`, so that a worker restarted under the same id takes over at once
    /// the live leases its previous incarnation left on its partitions.
    pub worker_id: String,
    /// Records of one partition processed at once; the partition is paused when full.
    pub partition_window: usize,
    /// Records processed at once over all partitions. A record whose call waits for its turn
    /// under a configured capacity limit gives its slot back while it waits (I10): the limit
    /// then bounds the calls in progress, and the window the records being read and claimed.
    pub global_window: usize,
    /// Records of one partition received and waiting for a window slot. When this many wait,
    /// the partition is paused; it resumes when half have started. Memory stays bounded by
    /// window + read-ahead records per partition. Unset: two partition windows, at least
    /// 512. It is what lets the worker see one workspace's records behind another's backlog
    /// and start them in their fair turn (I10): a backlog deeper than the read-ahead holds
    /// the records behind it back until it drains to half. Pausing also drops what the Kafka
    /// client had fetched for the partition, so each resume fetches again: half a read-ahead
    /// must cover that refetch at the rate the window finishes records, or the window runs
    /// dry (at 200 ms a call, window 64 kept 0.81 of its calls open with a read-ahead of one
    /// window and 0.97 with two; docs/BENCHMARKS.md).
    pub read_ahead: Option<usize>,
    /// Length of a task lease. A worker that stalls longer loses the task to another. A killed
    /// worker's tasks are taken over as soon as its partitions are given to another member (or
    /// back to it, restarted under the same id with static membership); only tasks claimed for
    /// no partition held alone (SQS) wait this long (at most) before another worker takes them. Raise
    /// it if the database can be away longer (a slow failover): a lease that runs out while
    /// the database is away costs a second generation of each call in flight.
    pub lease_ms: u64,
    /// How often a running call renews its lease; well under `lease_ms`.
    pub renew_interval_ms: u64,
    /// How often, between renewals, the worker reads whether the leases of its calls running
    /// longer than this still hold (one statement for all of them), so that a user's Stop or a
    /// takeover cuts a call short within about this. 0: each running call listens for its
    /// task's changes instead (heard at once, but the worker's session then listens whenever a
    /// call runs, and every notifying commit of the database wakes it). Needs
    /// `database.batch_renewals`; without it, calls listen. At least 50 when set; at or above
    /// `renew_interval_ms` the renewals themselves are the checks. Default 250.
    pub lease_check_ms: u64,
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
    /// How long a streamed answer's text gathers before the worker writes it for the task's
    /// followers (one statement and one notification each time): the followers see the text
    /// grow in steps of this, and a reply costs about its duration divided by this in
    /// statements. 0 forwards nothing: answers are then asked for whole, unless
    /// `provider.stream` is `true`. Between 20 and 1000 when set. Default 75.
    pub live_text_interval_ms: u64,
}

impl Default for WorkerSettings {
    fn default() -> Self {
        let rules = RecordRules::default();
        Self {
            source: Transport::Kafka,
            worker_id: String::new(),
            partition_window: 64,
            global_window: 256,
            read_ahead: None,
            lease_ms: 10_000,
            renew_interval_ms: 2_000,
            lease_check_ms: 250,
            drain_timeout_ms: 10_000,
            commit_interval_ms: 1_000,
            max_prompt_bytes: rules.max_prompt_bytes,
            default_max_attempts: rules.default_max_attempts,
            max_attempts_limit: rules.max_attempts_limit,
            io_retry_ms: 500,
            live_text_interval_ms: 75,
        }
    }
}

/// The smallest default read-ahead: enough to hide a refetch at small windows, and to see a
/// few hundred records past another workspace's backlog.
pub const MIN_READ_AHEAD: usize = 512;

impl WorkerSettings {
    /// How long a task of `attempts` attempts can keep being retried once claimed: every
    /// attempt a whole lease and the longest backoff, and its refusals (which spend no attempt)
    /// their own budget.
    pub fn retry_horizon(&self, attempts: u32, retry: &RetrySettings) -> Duration {
        Duration::from_millis(
            u64::from(attempts)
                .saturating_mul(self.lease_ms.saturating_add(retry.max_delay_ms))
                .saturating_add(retry.refusal_budget_ms),
        )
    }

    /// `worker.max_prompt_bytes` against the largest record the API may write
    /// (`kafka.max_record_bytes`): the API refuses a record over it, so a prompt limit that the
    /// largest ids push over it would make the API refuse prompts the worker takes.
    pub fn prompt_problems(&self, max_record_bytes: usize) -> Vec<(&'static str, String)> {
        let largest = replyd_core::domain::limits::largest_record_bytes(self.max_prompt_bytes);
        if largest <= max_record_bytes {
            return Vec::new();
        }
        let fits = max_record_bytes.saturating_sub(largest - self.max_prompt_bytes);
        vec![(
            "worker.max_prompt_bytes",
            format!(
                "{} does not fit kafka.max_record_bytes ({max_record_bytes}): with the longest ids the API takes, a task's Kafka record can be {largest} bytes; lower worker.max_prompt_bytes to at most {fits} or raise kafka.max_record_bytes",
                self.max_prompt_bytes
            ),
        )]
    }

    /// What is wrong with `[worker]` on its own: windows, the renewal against the lease, the attempt budget, the commit interval. Each problem names its setting.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = SettingProblems::default();
        if self.partition_window == 0 || self.global_window == 0 {
            out.refuse(
                "worker.partition_window",
                "windows must be at least 1".into(),
            );
        }
        if self.partition_window > self.global_window {
            out.refuse(
                "worker.partition_window",
                format!(
                    "{} is larger than worker.global_window ({})",
                    self.partition_window, self.global_window
                ),
            );
        }
        if self.renew_interval_ms == 0 || self.renew_interval_ms * 2 > self.lease_ms {
            out.refuse(
                "worker.renew_interval_ms",
                format!(
                    "{} must be positive and at most half of worker.lease_ms ({}), so one lost renewal does not lose the lease",
                    self.renew_interval_ms, self.lease_ms
                ),
            );
        }
        if self.lease_check_ms != 0 && self.lease_check_ms < 50 {
            out.refuse(
                "worker.lease_check_ms",
                format!(
                    "{} must be 0 (listen instead) or at least 50: more often, the checks cost the database more than a listening session",
                    self.lease_check_ms
                ),
            );
        }
        if self.default_max_attempts == 0 || self.default_max_attempts > self.max_attempts_limit {
            out.refuse(
                "worker.default_max_attempts",
                format!(
                    "{} must be between 1 and worker.max_attempts_limit ({})",
                    self.default_max_attempts, self.max_attempts_limit
                ),
            );
        }
        if self.commit_interval_ms == 0 {
            out.refuse("worker.commit_interval_ms", "must be positive".into());
        }
        if self.live_text_interval_ms != 0 && !(20..=1000).contains(&self.live_text_interval_ms) {
            out.refuse(
                "worker.live_text_interval_ms",
                format!(
                    "{} must be 0 (forward nothing) or between 20 and 1000: below 20 a reply costs a statement for every few tokens, above 1000 the text no longer looks live",
                    self.live_text_interval_ms
                ),
            );
        }
        out.into()
    }

    /// How long live text gathers before it is written; None when none is forwarded.
    pub fn live_text_interval(&self) -> Option<Duration> {
        (self.live_text_interval_ms > 0).then(|| Duration::from_millis(self.live_text_interval_ms))
    }

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

    /// `read_ahead`, or its default: two partition windows (what hides a refetch), at least
    /// [`MIN_READ_AHEAD`] (what sees past a backlog at small windows). A large window gets no
    /// deeper read-ahead than it needs: the window itself already reaches far past a backlog.
    pub fn read_ahead(&self) -> usize {
        self.read_ahead
            .unwrap_or(self.partition_window.saturating_mul(2).max(MIN_READ_AHEAD))
    }

    pub fn renew_interval(&self) -> Duration {
        Duration::from_millis(self.renew_interval_ms)
    }

    /// How often the leases of running calls are checked between renewals; None: calls listen.
    pub fn lease_check(&self) -> Option<Duration> {
        (self.lease_check_ms > 0).then(|| Duration::from_millis(self.lease_check_ms))
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

    /// How this worker holds records, for the source it opens.
    pub fn holding(&self) -> Holding {
        Holding {
            global_window: self.global_window,
            partition_window: self.partition_window,
            read_ahead: self.read_ahead(),
            drain_timeout: self.drain_timeout(),
            commit_interval: self.commit_interval(),
            io_retry: self.io_retry(),
        }
    }

    /// The lease owner of a worker run: `worker_id`, `#`, and a new token (its incarnation);
    /// called once per run, which uses it for all its claims, renewals and writes. A claim for a record of a partition this consumer holds takes over a
    /// live lease of the same partition whose owner differs (a dead or zombie holder, also an
    /// earlier incarnation of this worker id); a lease of this very owner is respected, so a
    /// duplicate record in the same process parks (`lease::Claimer::may_take_over`).
    pub fn lease_owner(&self, worker_id: &str) -> String {
        format!("{worker_id}#{}", incarnation())
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

/// A new incarnation token: eight hex digits of a random id, drawn once per worker run.
/// Random rather than the start time, so that two processes started in the same instant under
/// one id (a misconfiguration) still tell their leases apart.
fn incarnation() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}
