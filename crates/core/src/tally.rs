//! I3's rule for the source's records, kept pure: what each record must have left behind once
//! its consumer committed past it, and the tallies the records fold into, so `replyd check`
//! reads a topic of any length in batches and keeps only the counts; and what an SQS queue's
//! state says of the same rule, a queue keeping no history of what it delivered.

/// What the checker learned about one record of the source topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordFacts {
    /// The worker's rules make a task of it (else it is a bad record).
    pub has_task: bool,
    /// The group has committed past it.
    pub below_commit: bool,
    /// A dead-letter copy of it exists.
    pub dead_lettered: bool,
    /// Its task exists and is completed or failed.
    pub terminal: bool,
}

/// The source records, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordTallies {
    pub records: i64,
    /// Records the worker's rules make no task of.
    pub bad: i64,
    /// Records the group has not committed past yet.
    pub uncommitted: i64,
    /// Records committed past with neither a terminal task nor a dead-letter copy (I3).
    pub lost: i64,
}

impl RecordTallies {
    /// Counts one record.
    pub fn add(&mut self, record: RecordFacts) {
        self.records += 1;
        if !record.has_task {
            self.bad += 1;
        }
        if !record.below_commit {
            self.uncommitted += 1;
            return;
        }
        // Below the commit point: it must have left an outcome behind.
        let outcome = record.dead_lettered || (record.has_task && record.terminal);
        if !outcome {
            self.lost += 1;
        }
    }
}

/// What the checker reads of an SQS source (`worker.source = "sqs"`). A queue keeps no history
/// of the messages it delivered, so I3 is judged from what it still holds: every task handed
/// to the queue (a producer's message, or an outbox row the relay published) that is not
/// terminal needs a message of its own still in the queue (visible, in flight or delayed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFacts {
    /// Messages in the queue, in any state.
    pub in_queue: i64,
    /// Messages in its dead-letter queue.
    pub dead_letters: i64,
    /// Tasks handed to the queue and not terminal.
    pub open_handed: i64,
}

impl QueueFacts {
    /// The queue's messages as tallies: each still in the queue is not acknowledged yet, and
    /// each open task beyond them has lost its message (exact once the queue is drained, a
    /// lower bound before).
    pub fn tallies(&self) -> RecordTallies {
        RecordTallies {
            records: self.in_queue + self.dead_letters,
            bad: self.dead_letters,
            uncommitted: self.in_queue,
            lost: (self.open_handed - self.in_queue).max(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        has_task: bool,
        below_commit: bool,
        dead_lettered: bool,
        terminal: bool,
    ) -> RecordFacts {
        RecordFacts {
            has_task,
            below_commit,
            dead_lettered,
            terminal,
        }
    }

    #[test]
    fn a_record_committed_past_without_an_outcome_is_lost() {
        let mut tallies = RecordTallies::default();
        // A done task; a bad record with its dead-letter copy; a record committed past while
        // its task still runs; one not committed past yet; a bad record committed past with
        // no copy.
        for r in [
            record(true, true, false, true),
            record(false, true, true, false),
            record(true, true, false, false),
            record(true, false, false, false),
            record(false, true, false, false),
        ] {
            tallies.add(r);
        }
        assert_eq!(
            tallies,
            RecordTallies {
                records: 5,
                bad: 2,
                uncommitted: 1,
                lost: 2,
            }
        );
    }

    #[test]
    fn an_open_task_without_a_message_left_in_the_queue_is_lost() {
        // (in the queue, dead letters, open tasks handed) → (lost, bad, uncommitted).
        for (in_queue, dead_letters, open_handed, expected) in [
            // Drained: the open task's message is gone.
            (0, 2, 1, (1, 2, 0)),
            // Each open task may still have its message in the queue.
            (5, 0, 5, (0, 0, 5)),
            (3, 0, 5, (2, 0, 3)),
        ] {
            let queue = QueueFacts {
                in_queue,
                dead_letters,
                open_handed,
            };
            let tallies = queue.tallies();
            assert_eq!(
                (tallies.lost, tallies.bad, tallies.uncommitted),
                expected,
                "{queue:?}"
            );
        }
    }
}
