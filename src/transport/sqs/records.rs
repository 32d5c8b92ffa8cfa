//! What `replyd check` reads of an SQS source: its queue's and dead-letter queue's depth, and
//! the open tasks handed to it (a producer's, which have no outbox row, and the API's whose
//! row the relay published), judged by I3's rule for a queue (`replyd_core::tally::QueueFacts`):
//! a queue keeps no history of the messages it delivered, so what it still holds is the
//! evidence.

use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::TaskStatus;
use replyd_core::tally::QueueFacts;

use super::settings::SqsSettings;
use super::{QueueDepth, Sqs};
use crate::transport::records::{ReadError, SourceRecords};

/// The queue's state and the open tasks handed to it, as I3's tallies.
pub(crate) async fn read(
    settings: &SqsSettings,
    sqs: &Sqs,
    client: &tokio_postgres::Client,
) -> Result<SourceRecords, ReadError> {
    let attributes = sqs.attributes(&settings.queue_url).await?;
    let in_queue = QueueDepth::of(&attributes).total();
    let dead_letter_url = sqs.dead_letter_queue(settings, &attributes).await?;
    let dead_letters = sqs.depth(&dead_letter_url).await?.total();
    let open_handed: i64 = client
        .query_one(
            "SELECT count(*) FROM reply_tasks t \
             WHERE t.status IN ($1, $2) \
               AND NOT EXISTS (SELECT 1 FROM outbox o \
                               WHERE o.task_id = t.task_id AND o.published_at IS NULL)",
            &[&TaskStatus::Pending.as_str(), &TaskStatus::Running.as_str()],
        )
        .await?
        .get(0);
    let queue = QueueFacts {
        in_queue: in_queue as i64,
        dead_letters: dead_letters as i64,
        open_handed,
    };
    Ok(SourceRecords {
        tallies: queue.tallies(),
        dead_lettered: queue.dead_letters,
    })
}
