//! SQS Standard as a second source and sink of reply tasks: the worker receives from a queue
//! ([`source`]), the relay sends the outbox to it ([`publish`]), and bad messages are copied to
//! the queue's dead-letter queue ([`dead_letter`]). This file is the client: built once from
//! `[sqs]` and the AWS chain, and every call's failure said with the queue, the endpoint and
//! the setting that names them.
//!
//! What SQS changes and what it does not: a message is hidden, not removed, while a worker holds
//! it; the worker extends its visibility while its task runs and deletes it only once the task
//! is terminal (or the message is kept as a dead letter), so I3 reads "a message is deleted only
//! past a durable outcome". A Standard queue may deliver a message twice, even within its
//! visibility window, and a message may come back after a worker died or stalled: the task id,
//! not the message, is the identity of the work, and the claim and the fenced write decide
//! what runs (I1, I2, I5), as they do for Kafka's redeliveries.

pub mod dead_letter;
pub mod inflight;
pub mod message;
pub mod open;
pub mod publish;
pub mod records;
pub mod settings;
pub mod source;

use std::time::Duration;

use aws_config::BehaviorVersion;
use aws_config::timeout::TimeoutConfig;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::QueueAttributeName;
use aws_smithy_http_client::tls;

use settings::SqsSettings;

/// A failed SQS call, said with what it was for and where it went.
#[derive(Debug, thiserror::Error)]
pub enum SqsError {
    #[error(
        "no AWS region for SQS: set sqs.region or AWS_REGION (sqs.queue_url `{queue}` names none)"
    )]
    NoRegion { queue: String },
    #[error(
        "cannot reach SQS at {endpoint} for {operation} on `{queue}` (sqs.queue_url): {detail}"
    )]
    Unreachable {
        operation: &'static str,
        queue: String,
        endpoint: String,
        detail: String,
    },
    #[error("SQS at {endpoint} refused {operation} on `{queue}` (sqs.queue_url): {code}: {detail}")]
    Refused {
        operation: &'static str,
        queue: String,
        endpoint: String,
        code: String,
        detail: String,
    },
    #[error(
        "queue `{queue}` has no dead-letter queue: set sqs.dead_letter_queue_url, or give the queue a RedrivePolicy naming one"
    )]
    NoDeadLetterQueue { queue: String },
}

impl SqsError {
    /// Whether trying again later may work: the endpoint did not answer (a refusal is an
    /// answer: a missing queue, a denied credential).
    pub fn is_transient(&self) -> bool {
        matches!(self, SqsError::Unreachable { .. })
    }

    /// The SQS error code of a refusal (`AWS.SimpleQueueService.NonExistentQueue`).
    pub fn code(&self) -> Option<&str> {
        match self {
            SqsError::Refused { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// The SDK's hyper 1 HTTPS client on rustls with ring (the crypto rustls already uses here).
pub fn https_client() -> aws_sdk_sqs::config::SharedHttpClient {
    aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https()
}

/// One SQS client and where its calls go.
#[derive(Clone, Debug)]
pub struct Sqs {
    client: aws_sdk_sqs::Client,
    /// The endpoint as an operator would look for it, with the setting that names it.
    endpoint: String,
}

impl Sqs {
    /// Builds the client: credentials from the AWS chain, the region from `sqs.region`, else
    /// the chain, else the queue URL's host; each attempt of a call within
    /// `sqs.call_timeout_ms` (a receive's within its wait plus that, [`Sqs::receive_timeouts`]),
    /// and the SDK's standard retries of a throttled or failed call. Over the HTTPS client rustls already brings (ring), not the SDK's default.
    pub async fn connect(settings: &SqsSettings) -> Result<Self, SqsError> {
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(https_client())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(settings.call_timeout().min(Duration::from_secs(5)))
                    .operation_attempt_timeout(settings.call_timeout())
                    .build(),
            );
        if !settings.region.is_empty() {
            loader = loader.region(aws_config::Region::new(settings.region.clone()));
        }
        if !settings.endpoint_url.is_empty() {
            loader = loader.endpoint_url(settings.endpoint_url.clone());
        }
        let mut config = loader.load().await;
        if config.region().is_none() {
            let region = settings
                .region_of_queue_url()
                .ok_or_else(|| SqsError::NoRegion {
                    queue: settings.queue_url.clone(),
                })?;
            config = config
                .into_builder()
                .region(aws_config::Region::new(region))
                .build();
        }
        let endpoint = if settings.endpoint_url.is_empty() {
            format!(
                "the SQS endpoint of {} (sqs.region)",
                config.region().map(|r| r.as_ref()).unwrap_or("?")
            )
        } else {
            format!("{} (sqs.endpoint_url)", settings.endpoint_url)
        };
        Ok(Self {
            client: aws_sdk_sqs::Client::new(&config),
            endpoint,
        })
    }

    /// A client built elsewhere (a tool's, with its own credentials), said as `endpoint`.
    pub fn from_client(client: aws_sdk_sqs::Client, endpoint: &str) -> Self {
        Self {
            client,
            endpoint: endpoint.to_owned(),
        }
    }

    pub fn client(&self) -> &aws_sdk_sqs::Client {
        &self.client
    }

    /// The timeouts of a receive: its long poll's wait, plus what any call may take.
    pub fn receive_timeouts(settings: &SqsSettings) -> aws_sdk_sqs::config::Builder {
        let deadline = Duration::from_secs(u64::from(settings.wait_time_seconds))
            .saturating_add(settings.call_timeout());
        aws_sdk_sqs::config::Builder::default().timeout_config(
            TimeoutConfig::builder()
                .operation_attempt_timeout(deadline)
                .build(),
        )
    }

    /// Says a failed call with the queue, the endpoint and, for a refusal, SQS's code.
    pub fn error<E, R>(
        &self,
        operation: &'static str,
        queue: &str,
        error: SdkError<E, R>,
    ) -> SqsError
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug + Send + Sync + 'static,
    {
        let queue = queue.to_owned();
        let endpoint = self.endpoint.clone();
        match &error {
            SdkError::ServiceError(service) => {
                let e = service.err();
                SqsError::Refused {
                    operation,
                    queue,
                    endpoint,
                    code: e.code().unwrap_or("unknown").to_owned(),
                    detail: e.message().unwrap_or("no message").to_owned(),
                }
            }
            _ => SqsError::Unreachable {
                operation,
                queue,
                endpoint,
                detail: DisplayErrorContext(&error).to_string(),
            },
        }
    }

    /// The queue's attributes (`GetQueueAttributes`, all of them), by name.
    pub async fn attributes(&self, queue: &str) -> Result<Attributes, SqsError> {
        let answer = self
            .client
            .get_queue_attributes()
            .queue_url(queue)
            .attribute_names(QueueAttributeName::All)
            .send()
            .await
            .map_err(|e| self.error("GetQueueAttributes", queue, e))?;
        Ok(answer.attributes.unwrap_or_default())
    }

    /// What the queue holds now, as SQS approximates it.
    pub async fn depth(&self, queue: &str) -> Result<QueueDepth, SqsError> {
        Ok(QueueDepth::of(&self.attributes(queue).await?))
    }

    /// The dead-letter queue refused messages are copied to: `sqs.dead_letter_queue_url`, else
    /// the one the `RedrivePolicy` of the queue's `attributes` names.
    pub async fn dead_letter_queue(
        &self,
        settings: &SqsSettings,
        attributes: &Attributes,
    ) -> Result<String, SqsError> {
        if !settings.dead_letter_queue_url.is_empty() {
            return Ok(settings.dead_letter_queue_url.clone());
        }
        let queue = &settings.queue_url;
        let target = RedrivePolicy::of(attributes)
            .ok_or_else(|| SqsError::NoDeadLetterQueue {
                queue: queue.clone(),
            })?
            .dead_letter_queue_name;
        let answer = self
            .client
            .get_queue_url()
            .queue_name(&target)
            .send()
            .await
            .map_err(|e| {
                self.error(
                    "GetQueueUrl (the RedrivePolicy's dead-letter queue)",
                    queue,
                    e,
                )
            })?;
        answer.queue_url.ok_or_else(|| SqsError::NoDeadLetterQueue {
            queue: queue.clone(),
        })
    }
}

/// A queue's attributes, as `GetQueueAttributes` answers them.
pub type Attributes = std::collections::HashMap<QueueAttributeName, String>;

/// A queue's `RedrivePolicy`: where SQS moves a message, and after how many receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedrivePolicy {
    /// The dead-letter queue's name (the last part of its ARN).
    pub dead_letter_queue_name: String,
    pub max_receive_count: Option<u64>,
}

impl RedrivePolicy {
    /// The policy among `attributes`, if the queue has one.
    pub fn of(attributes: &Attributes) -> Option<Self> {
        let policy: serde_json::Value =
            serde_json::from_str(attributes.get(&QueueAttributeName::RedrivePolicy)?).ok()?;
        let arn = policy.get("deadLetterTargetArn")?.as_str()?;
        // SQS writes the count as a number; some tools as a string.
        let max_receive_count = policy.get("maxReceiveCount").and_then(|n| {
            n.as_u64()
                .or_else(|| n.as_str().and_then(|s| s.parse().ok()))
        });
        Some(Self {
            dead_letter_queue_name: arn.rsplit(':').next().unwrap_or(arn).to_owned(),
            max_receive_count,
        })
    }
}

/// A queue's messages by state (`ApproximateNumberOf...`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct QueueDepth {
    /// Waiting to be received.
    pub visible: u64,
    /// Received and neither deleted nor visible again.
    pub in_flight: u64,
    /// Sent with a delay (a handed-back message is in flight until it shows again).
    pub delayed: u64,
}

impl QueueDepth {
    /// The depth among `attributes`.
    pub fn of(attributes: &Attributes) -> Self {
        let count = |name: QueueAttributeName| {
            attributes
                .get(&name)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        Self {
            visible: count(QueueAttributeName::ApproximateNumberOfMessages),
            in_flight: count(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
            delayed: count(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
        }
    }

    pub fn total(&self) -> u64 {
        self.visible + self.in_flight + self.delayed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_redrive_policy_names_its_queue_and_count_as_sqs_or_a_tool_writes_them() {
        let with = |policy: &str| {
            Attributes::from([(QueueAttributeName::RedrivePolicy, policy.to_owned())])
        };
        let arn = "arn:aws:sqs:eu-west-1:123456789012:tasks-dlq";
        assert_eq!(
            RedrivePolicy::of(&with(&format!(
                r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":10}}"#
            ))),
            Some(RedrivePolicy {
                dead_letter_queue_name: "tasks-dlq".into(),
                max_receive_count: Some(10),
            })
        );
        assert_eq!(
            RedrivePolicy::of(&with(&format!(
                r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"7"}}"#
            )))
            .and_then(|p| p.max_receive_count),
            Some(7)
        );
        assert_eq!(RedrivePolicy::of(&Attributes::new()), None);
        assert_eq!(RedrivePolicy::of(&with("not json")), None);
    }
}
