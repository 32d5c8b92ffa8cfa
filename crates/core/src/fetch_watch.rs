//! Whether a partition's fetching has stopped while records wait in Kafka, from the
//! consumer's periodic statistics and what the worker itself knows.
//!
//! The worker pauses a partition whose read-ahead is full and resumes it once drained, and a
//! partition can be revoked and given back while paused. The Kafka client is then trusted to
//! fetch again from where the worker stopped reading; were it ever not to (a resume that
//! finds the fetcher in a state that does not restart it), the partition would sit still with
//! records in it for good, its commit point stuck, and nothing would say so. This watch sees
//! it: a partition the worker has not paused, with nothing of it waiting in the windows,
//! whose readable end is past the next offset to read, and which gave the worker no record
//! between two statistics reports, is stalled. The worker then seeks it to that offset, which
//! restarts its fetcher there: no record is skipped (nothing past the last record taken was
//! taken) and none is read twice.

use std::collections::HashMap;
use std::hash::Hash;

/// One statistics report's view of one partition, beside the worker's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sighting {
    /// Where the records a consumer may read end: the last stable offset under
    /// `read_committed` (a transaction still open holds back what follows it), else the high
    /// watermark; negative while the client does not know it.
    pub readable_end: i64,
    /// The next offset the worker reads: one past the last record the client handed it in
    /// this assignment (control records of transactions included, which the client skips),
    /// or, before any, [`first_to_read`]: negative when the worker cannot tell.
    pub next_to_read: i64,
    /// Whether the worker paused the partition (its read-ahead is full): not fetching is then
    /// what it asked for.
    pub paused: bool,
    /// Records of the partition waiting in the windows: the client delivered them, so it
    /// fetches.
    pub waiting: usize,
}

impl Sighting {
    /// Records are in Kafka that the worker has not read, and nothing of its own holds them
    /// back.
    fn starved(&self) -> bool {
        !self.paused
            && self.waiting == 0
            && self.next_to_read >= 0
            && self.readable_end > self.next_to_read
    }
}

/// Where the worker reads a partition first in an assignment, before the client has handed it
/// any record: the group's `committed` offset, or, when the group never committed one (a
/// partition revoked before any of its records was done, then given back), where the reset
/// policy starts: the log start when `uncommitted_from_start` (`earliest`), offset 0 while the
/// log start is unknown (a seek below it is reset to it by that same policy). Negative when
/// the worker cannot tell (`latest` starts wherever the log ends when the client asks).
pub fn first_to_read(committed: i64, log_start: i64, uncommitted_from_start: bool) -> i64 {
    if committed >= 0 || !uncommitted_from_start {
        committed
    } else {
        log_start.max(0)
    }
}

/// What the watch concludes from one report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Fetching, paused by the worker, or caught up.
    Flowing,
    /// Starved for the first report: the next report decides.
    Watching,
    /// Starved for two reports in a row with no record taken in between: restart fetching at
    /// `from`.
    Stalled { from: i64 },
}

/// The last report's sighting of each partition.
#[derive(Debug, Clone)]
pub struct FetchWatch<K> {
    last: HashMap<K, Sighting>,
}

impl<K> Default for FetchWatch<K> {
    fn default() -> Self {
        Self {
            last: HashMap::new(),
        }
    }
}

impl<K: Eq + Hash + Clone> FetchWatch<K> {
    /// Judges `key` by this report's sighting and the previous one. A stall is reported once:
    /// the next report starts watching afresh, so a restart that did not help is tried again
    /// one report later, never in a loop within one.
    pub fn observe(&mut self, key: &K, now: Sighting) -> Verdict {
        if !now.starved() {
            self.last.remove(key);
            return Verdict::Flowing;
        }
        match self.last.remove(key) {
            Some(before) if before.starved() && before.next_to_read == now.next_to_read => {
                Verdict::Stalled {
                    from: now.next_to_read,
                }
            }
            _ => {
                self.last.insert(key.clone(), now);
                Verdict::Watching
            }
        }
    }

    /// Forgets `key`: revoked, lost or newly assigned, its next sighting starts afresh.
    pub fn forget(&mut self, key: &K) {
        self.last.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn starved(next_to_read: i64) -> Sighting {
        Sighting {
            readable_end: next_to_read + 3,
            next_to_read,
            paused: false,
            waiting: 0,
        }
    }

    /// The verdicts on partition 0 starved at each of `next_to_read`, one sighting after another.
    fn verdicts(next_to_read: &[i64]) -> Vec<Verdict> {
        let mut watch = FetchWatch::default();
        next_to_read
            .iter()
            .map(|&next| watch.observe(&0, starved(next)))
            .collect()
    }

    #[test]
    fn two_starved_reports_without_progress_are_a_stall_at_the_next_offset() {
        // Reported once; the next report watches afresh.
        assert_eq!(
            verdicts(&[11, 11, 11, 11]),
            [
                Verdict::Watching,
                Verdict::Stalled { from: 11 },
                Verdict::Watching,
                Verdict::Stalled { from: 11 },
            ]
        );
    }

    #[test]
    fn a_record_taken_between_reports_is_progress() {
        assert_eq!(
            verdicts(&[11, 12, 12]),
            [
                Verdict::Watching,
                Verdict::Watching,
                Verdict::Stalled { from: 12 },
            ]
        );
    }

    #[test]
    fn paused_waiting_caught_up_or_unknown_partitions_flow() {
        let mut watch = FetchWatch::default();
        let cases = [
            Sighting {
                paused: true,
                ..starved(5)
            },
            Sighting {
                waiting: 1,
                ..starved(5)
            },
            Sighting {
                readable_end: 5,
                ..starved(5)
            },
            Sighting {
                readable_end: -1,
                ..starved(5)
            },
            Sighting {
                next_to_read: -1001,
                readable_end: 4,
                ..starved(5)
            },
        ];
        for case in cases {
            assert_eq!(watch.observe(&0, starved(5)), Verdict::Watching);
            // One report that flows clears the watch: no stall on the next starved one.
            assert_eq!(watch.observe(&0, case), Verdict::Flowing, "{case:?}");
            assert_eq!(watch.observe(&0, starved(5)), Verdict::Watching, "{case:?}");
            watch.forget(&0);
        }
    }

    #[test]
    fn a_partition_never_committed_is_read_from_where_the_reset_policy_starts() {
        const NONE: i64 = -1001;
        assert_eq!(first_to_read(7, 3, true), 7);
        assert_eq!(first_to_read(7, 3, false), 7);
        assert_eq!(first_to_read(NONE, 3, true), 3);
        assert_eq!(first_to_read(NONE, -1, true), 0, "log start not known yet");
        assert_eq!(first_to_read(NONE, 3, false), NONE);
        // Given back with records in it and never fetched: a stall at its start, which a
        // negative next offset would hide for good.
        let mut watch = FetchWatch::default();
        let never_fetched = Sighting {
            readable_end: 10,
            next_to_read: first_to_read(NONE, 0, true),
            paused: false,
            waiting: 0,
        };
        assert_eq!(watch.observe(&1, never_fetched), Verdict::Watching);
        assert_eq!(
            watch.observe(&1, never_fetched),
            Verdict::Stalled { from: 0 }
        );
    }

    #[test]
    fn partitions_are_watched_apart_and_a_forgotten_one_starts_afresh() {
        let mut watch = FetchWatch::default();
        assert_eq!(watch.observe(&0, starved(1)), Verdict::Watching);
        assert_eq!(watch.observe(&1, starved(1)), Verdict::Watching);
        watch.forget(&0);
        assert_eq!(watch.observe(&0, starved(1)), Verdict::Watching);
        assert_eq!(watch.observe(&1, starved(1)), Verdict::Stalled { from: 1 });
    }
}
