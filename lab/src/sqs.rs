//! An SQS-compatible server as the tests, the chaos harness and the demo use it: a queue with
//! a dead-letter queue behind its `RedrivePolicy`, created as a team on AWS would, and reply
//! tasks sent to it as a producer would (the record in base64, `replyd::transport::sqs::message`).
//! Credentials are fixed test ones: the local server checks none, and the SDK signs anyway.

use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sqs::types::{QueueAttributeName, SendMessageBatchRequestEntry};
use prost::Message as _;

use replyd::transport::sqs::Sqs;
use replyd::transport::sqs::message::encode_body;
use replyd_core::domain::TaskSpec;

/// The credentials and region the local server's clients (and the workers under test) use.
pub const TEST_ENV: [(&str, &str); 3] = [
    ("AWS_ACCESS_KEY_ID", "replyd-test"),
    ("AWS_SECRET_ACCESS_KEY", "replyd-test"),
    ("AWS_REGION", "us-east-1"),
];

/// A client of the server at `endpoint` with the test credentials.
pub fn connect(endpoint: &str) -> Sqs {
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .credentials_provider(Credentials::new(
            TEST_ENV[0].1,
            TEST_ENV[1].1,
            None,
            None,
            "replyd-lab",
        ))
        .region(Region::new(TEST_ENV[2].1))
        .endpoint_url(endpoint)
        .http_client(replyd::transport::sqs::https_client())
        .build();
    Sqs::from_client(aws_sdk_sqs::Client::from_conf(config), endpoint)
}

/// A queue and its dead-letter queue.
#[derive(Debug, Clone)]
pub struct Queues {
    pub url: String,
    pub dead_letter_url: String,
}

/// Creates `name` and `name-dlq`; the first moves a message to the second after
/// `max_receive_count` receives (its `RedrivePolicy`).
pub async fn create_queues(
    sqs: &Sqs,
    name: &str,
    max_receive_count: u32,
) -> anyhow::Result<Queues> {
    let client = sqs.client();
    let dead_letter_url = client
        .create_queue()
        .queue_name(format!("{name}-dlq"))
        .send()
        .await?
        .queue_url
        .ok_or_else(|| anyhow::anyhow!("no URL for {name}-dlq"))?;
    let arn = client
        .get_queue_attributes()
        .queue_url(&dead_letter_url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await?
        .attributes
        .and_then(|mut a| a.remove(&QueueAttributeName::QueueArn))
        .ok_or_else(|| anyhow::anyhow!("no ARN for {name}-dlq"))?;
    let policy = serde_json::json!({
        "deadLetterTargetArn": arn,
        "maxReceiveCount": max_receive_count.to_string(),
    });
    let url = client
        .create_queue()
        .queue_name(name)
        .attributes(QueueAttributeName::RedrivePolicy, policy.to_string())
        .send()
        .await?
        .queue_url
        .ok_or_else(|| anyhow::anyhow!("no URL for {name}"))?;
    Ok(Queues {
        url,
        dead_letter_url,
    })
}

/// A record as a message body. SQS itself refuses an empty body and one over its size limit,
/// so such a record (a broken producer's) goes as text that is not base64 at all.
pub fn body_of(record: &[u8]) -> String {
    if record.is_empty() || record.len() > 150 * 1024 {
        format!("not a reply task: {} bytes", record.len())
    } else {
        encode_body(record)
    }
}

/// Sends each body as a message, ten to a call.
pub async fn send_bodies(sqs: &Sqs, queue: &str, bodies: &[String]) -> anyhow::Result<()> {
    for chunk in bodies.chunks(10) {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, body)| {
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(body)
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let answer = sqs
            .client()
            .send_message_batch()
            .queue_url(queue)
            .set_entries(Some(entries))
            .send()
            .await?;
        if let Some(failed) = answer.failed.first() {
            anyhow::bail!(
                "SQS refused a message: {}: {:?}",
                failed.code,
                failed.message
            );
        }
    }
    Ok(())
}

/// Sends each task `copies` times, each copy a message of its own.
pub async fn send_tasks(
    sqs: &Sqs,
    queue: &str,
    tasks: &[TaskSpec],
    copies: usize,
) -> anyhow::Result<()> {
    let bodies: Vec<String> = (0..copies)
        .flat_map(|_| tasks.iter())
        .map(|task| encode_body(&task.to_proto().encode_to_vec()))
        .collect();
    send_bodies(sqs, queue, &bodies).await
}

/// What a queue holds, as the server approximates it: visible, in flight, delayed.
pub async fn depth(sqs: &Sqs, queue: &str) -> anyhow::Result<replyd::transport::sqs::QueueDepth> {
    Ok(sqs.depth(queue).await?)
}
