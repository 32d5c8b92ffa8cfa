//! `[sqs]`: the SQS Standard queue a worker receives from (`worker.source = "sqs"`) and the relay
//! sends to (`relay.sink = "sqs"`). The settings tree (`crate::config`) holds it.
//!
//! Credentials are not settings: they come from the usual AWS chain (the environment, the shared
//! profile files, web identity, the container and instance metadata endpoints), as every AWS tool
//! finds them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::setting_problems::SettingProblems;

/// The most messages one receive, delete, visibility or send call carries (SQS's own limit).
pub const SQS_BATCH_LIMIT: usize = 10;
/// The longest long-poll wait SQS allows, in seconds.
pub const MAX_WAIT_TIME_SECONDS: u32 = 20;
/// The longest a message may stay hidden, in seconds (12 hours; SQS's own limit).
pub const MAX_VISIBILITY_TIMEOUT_SECONDS: u32 = 43_200;

/// The queue and how it is read.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SqsSettings {
    /// The queue's URL (`https://sqs.<region>.amazonaws.com/<account>/<name>`). Required when
    /// `worker.source` or `relay.sink` is `sqs`.
    pub queue_url: String,
    /// Where refused messages (undecodable, missing fields, too large) are copied with the
    /// reason before they are deleted. Empty: the dead-letter queue of the queue's own
    /// `RedrivePolicy`; a worker without either refuses to start.
    pub dead_letter_queue_url: String,
    /// The AWS region. Empty: the AWS chain's (`AWS_REGION`, the profile), else the region
    /// named in `sqs.queue_url`'s host.
    pub region: String,
    /// Sends every call here instead of the region's SQS endpoint (a VPC endpoint, an
    /// SQS-compatible server). Empty: the region's.
    pub endpoint_url: String,
    /// Messages asked for per receive call (1..=10).
    pub batch_size: u32,
    /// How long a receive call waits for messages when the queue is empty (long polling,
    /// 0..=20 s).
    pub wait_time_seconds: u32,
    /// How long a received message stays hidden from other workers. The worker extends it
    /// every third of this while the message's task runs, so it only matters when a worker
    /// dies or stalls: its messages are delivered again this long after its last extension.
    pub visibility_timeout_seconds: u32,
    /// Messages held at once by this worker (received and not yet deleted or handed back).
    /// Unset: `worker.global_window`.
    pub max_in_flight: Option<usize>,
    /// Deadline of one SQS call other than a receive (whose deadline is its wait plus this).
    pub call_timeout_ms: u64,
}

impl Default for SqsSettings {
    fn default() -> Self {
        Self {
            queue_url: String::new(),
            dead_letter_queue_url: String::new(),
            region: String::new(),
            endpoint_url: String::new(),
            batch_size: 10,
            wait_time_seconds: 20,
            visibility_timeout_seconds: 60,
            max_in_flight: None,
            call_timeout_ms: 10_000,
        }
    }
}

impl SqsSettings {
    /// What is wrong with `[sqs]` on its own, for a process that uses the queue. Each problem
    /// names its setting.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = SettingProblems::default();
        if self.queue_url.trim().is_empty() {
            out.refuse(
                "sqs.queue_url",
                "is required when worker.source or relay.sink is \"sqs\"".into(),
            );
        } else if let Err(e) = url_of(&self.queue_url) {
            out.refuse("sqs.queue_url", e);
        }
        if !self.dead_letter_queue_url.is_empty()
            && let Err(e) = url_of(&self.dead_letter_queue_url)
        {
            out.refuse("sqs.dead_letter_queue_url", e);
        }
        if !self.endpoint_url.is_empty()
            && let Err(e) = url_of(&self.endpoint_url)
        {
            out.refuse("sqs.endpoint_url", e);
        }
        if self.batch_size == 0 || self.batch_size as usize > SQS_BATCH_LIMIT {
            out.refuse(
                "sqs.batch_size",
                format!(
                    "{} must be between 1 and {SQS_BATCH_LIMIT} (SQS's limit per call)",
                    self.batch_size
                ),
            );
        }
        if self.wait_time_seconds > MAX_WAIT_TIME_SECONDS {
            out.refuse(
                "sqs.wait_time_seconds",
                format!(
                    "{} must be at most {MAX_WAIT_TIME_SECONDS} (SQS's longest long poll)",
                    self.wait_time_seconds
                ),
            );
        }
        if !(3..=MAX_VISIBILITY_TIMEOUT_SECONDS).contains(&self.visibility_timeout_seconds) {
            out.refuse(
                "sqs.visibility_timeout_seconds",
                format!(
                    "{} must be between 3 and {MAX_VISIBILITY_TIMEOUT_SECONDS}: it is extended every third of itself, in whole seconds",
                    self.visibility_timeout_seconds
                ),
            );
        }
        if self.max_in_flight == Some(0) {
            out.refuse("sqs.max_in_flight", "must be positive".into());
        }
        if self.call_timeout_ms == 0 {
            out.refuse("sqs.call_timeout_ms", "must be positive".into());
        }
        out.into()
    }

    /// The region to use when neither this setting nor the AWS chain names one: the one in
    /// an AWS queue URL's host (`sqs.eu-west-1.amazonaws.com`).
    pub fn region_of_queue_url(&self) -> Option<String> {
        let url = url_of(&self.queue_url).ok()?;
        let host = url.host_str()?;
        let mut labels = host.split('.');
        match (labels.next(), labels.next()) {
            (Some("sqs"), Some(region)) if host.ends_with(".amazonaws.com") => {
                Some(region.to_owned())
            }
            _ => None,
        }
    }

    /// The queue's name: the last segment of its URL.
    pub fn queue_name(&self) -> &str {
        name_of_queue_url(&self.queue_url)
    }

    pub fn max_in_flight(&self, global_window: usize) -> usize {
        self.max_in_flight.unwrap_or(global_window).max(1)
    }

    pub fn visibility_timeout(&self) -> Duration {
        Duration::from_secs(u64::from(self.visibility_timeout_seconds))
    }

    /// How often the visibility of the messages in flight is extended.
    pub fn extend_interval(&self) -> Duration {
        self.visibility_timeout() / 3
    }

    pub fn call_timeout(&self) -> Duration {
        Duration::from_millis(self.call_timeout_ms)
    }
}

/// The last segment of a queue URL, its name.
pub fn name_of_queue_url(url: &str) -> &str {
    url.trim_end_matches('/').rsplit('/').next().unwrap_or(url)
}

fn url_of(text: &str) -> Result<reqwest::Url, String> {
    let url = reqwest::Url::parse(text).map_err(|e| format!("`{text}` is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("`{text}` is not an http or https URL"));
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> SqsSettings {
        SqsSettings {
            queue_url: "https://sqs.eu-west-1.amazonaws.com/123456789012/reply-tasks".into(),
            ..SqsSettings::default()
        }
    }

    #[test]
    fn a_queue_url_is_required_and_each_limit_is_named() {
        assert!(valid().problems().is_empty(), "{:?}", valid().problems());
        let bad = SqsSettings {
            queue_url: String::new(),
            endpoint_url: "localhost:9324".into(),
            batch_size: 11,
            wait_time_seconds: 21,
            visibility_timeout_seconds: 2,
            max_in_flight: Some(0),
            ..SqsSettings::default()
        };
        let named: Vec<&str> = bad.problems().iter().map(|(s, _)| *s).collect();
        assert_eq!(
            named,
            [
                "sqs.queue_url",
                "sqs.endpoint_url",
                "sqs.batch_size",
                "sqs.wait_time_seconds",
                "sqs.visibility_timeout_seconds",
                "sqs.max_in_flight",
            ]
        );
    }

    #[test]
    fn the_region_and_the_name_come_from_an_aws_queue_url() {
        assert_eq!(valid().region_of_queue_url().as_deref(), Some("eu-west-1"));
        assert_eq!(valid().queue_name(), "reply-tasks");
        let local = SqsSettings {
            queue_url: "http://127.0.0.1:9324/000000000000/tasks".into(),
            ..SqsSettings::default()
        };
        assert_eq!(local.region_of_queue_url(), None);
        assert_eq!(local.queue_name(), "tasks");
    }
}
