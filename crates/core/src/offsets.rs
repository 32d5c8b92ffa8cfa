//! In-flight offsets per partition, and the commit point they allow. Pure: no I/O, and no clock
//! of its own (the caller says when a record was begun).
//!
//! Keeps I3 (nothing lost): the commit point of a partition is the lowest offset still in
//! flight, or, when nothing is in flight, one past the highest offset done. Committing it never
//! skips an unfinished record, however the records of one partition finish out of order.
//! Offsets need not be contiguous (compaction, transaction markers): only offsets that were
//! begun count.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// A topic partition, as the tracker keys it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionKey {
    pub topic: String,
    pub partition: i32,
}

impl PartitionKey {
    pub fn new(topic: impl Into<String>, partition: i32) -> Self {
        Self {
            topic: topic.into(),
            partition,
        }
    }
}

/// Why the tracker refused a call; each means the caller's bookkeeping is off, never the data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrackerError {
    #[error("partition {0:?} is not assigned")]
    NotAssigned(PartitionKey),
    #[error("offset {offset} begun after {highest} on one assignment: offsets must increase")]
    NotIncreasing { offset: i64, highest: i64 },
    #[error("offset {0} is not in flight")]
    NotInFlight(i64),
}

/// One partition's offsets within one assignment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PartitionOffsets {
    /// Offsets in flight, with when each was begun.
    in_flight: BTreeMap<i64, Instant>,
    highest_begun: Option<i64>,
    highest_done: Option<i64>,
}

impl PartitionOffsets {
    /// Records that work on `offset` started. Within one assignment a partition's records
    /// arrive in increasing offset order; anything else is refused.
    pub fn begin(&mut self, offset: i64, at: Instant) -> Result<(), TrackerError> {
        if let Some(highest) = self.highest_begun.filter(|h| offset <= *h) {
            return Err(TrackerError::NotIncreasing { offset, highest });
        }
        self.in_flight.insert(offset, at);
        self.highest_begun = Some(offset);
        Ok(())
    }

    /// Records that `offset` is finished: its outcome is durable (terminal task or DLQ copy).
    pub fn done(&mut self, offset: i64) -> Result<(), TrackerError> {
        if self.in_flight.remove(&offset).is_none() {
            return Err(TrackerError::NotInFlight(offset));
        }
        self.highest_done = Some(self.highest_done.map_or(offset, |h| h.max(offset)));
        Ok(())
    }

    /// The offset to commit: the group resumes there. `None` until something is done.
    pub fn commit_point(&self) -> Option<i64> {
        match self.in_flight.first_key_value() {
            // Nothing below the lowest unfinished offset is unfinished; if nothing was done
            // yet there is nothing to commit.
            Some((&lowest, _)) => self.highest_done.map(|_| lowest),
            None => self.highest_done.map(|h| h + 1),
        }
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// One past the last offset begun in this assignment: where reading goes on. None before
    /// the first record.
    pub fn next_to_read(&self) -> Option<i64> {
        self.highest_begun.map(|h| h + 1)
    }

    /// When the oldest record still in flight was begun: the lowest offset's, since offsets
    /// are begun in increasing order. It holds the commit point back, so its age is how long
    /// the partition's progress has waited.
    pub fn oldest_in_flight(&self) -> Option<Instant> {
        self.in_flight.first_key_value().map(|(_, at)| *at)
    }
}

/// The in-flight offsets of every assigned partition.
#[derive(Debug, Clone, Default)]
pub struct InFlightOffsets {
    partitions: HashMap<PartitionKey, PartitionOffsets>,
}

impl InFlightOffsets {
    /// Starts a fresh record of `key` for a new assignment, forgetting any earlier one: after
    /// a reassignment the group resumes from the committed offset, not from our memory.
    pub fn assign(&mut self, key: PartitionKey) {
        self.partitions.insert(key, PartitionOffsets::default());
    }

    /// Forgets `key` (revoked or lost).
    pub fn revoke(&mut self, key: &PartitionKey) -> Option<PartitionOffsets> {
        self.partitions.remove(key)
    }

    pub fn is_assigned(&self, key: &PartitionKey) -> bool {
        self.partitions.contains_key(key)
    }

    pub fn begin(
        &mut self,
        key: &PartitionKey,
        offset: i64,
        at: Instant,
    ) -> Result<(), TrackerError> {
        self.partition_mut(key)?.begin(offset, at)
    }

    pub fn done(&mut self, key: &PartitionKey, offset: i64) -> Result<(), TrackerError> {
        self.partition_mut(key)?.done(offset)
    }

    pub fn partition(&self, key: &PartitionKey) -> Option<&PartitionOffsets> {
        self.partitions.get(key)
    }

    /// Commit points of every assigned partition that has one.
    pub fn commit_points(&self) -> Vec<(PartitionKey, i64)> {
        let mut points: Vec<_> = self
            .partitions
            .iter()
            .filter_map(|(k, p)| p.commit_point().map(|o| (k.clone(), o)))
            .collect();
        points.sort();
        points
    }

    /// Records in flight over all partitions.
    pub fn total_in_flight(&self) -> usize {
        self.partitions
            .values()
            .map(PartitionOffsets::in_flight)
            .sum()
    }

    pub fn assigned(&self) -> impl Iterator<Item = &PartitionKey> {
        self.partitions.keys()
    }

    fn partition_mut(&mut self, key: &PartitionKey) -> Result<&mut PartitionOffsets, TrackerError> {
        self.partitions
            .get_mut(key)
            .ok_or_else(|| TrackerError::NotAssigned(key.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_oldest_in_flight_is_the_lowest_offset_still_running() {
        let start = Instant::now();
        let at = |ms| start + std::time::Duration::from_millis(ms);
        let mut p = PartitionOffsets::default();
        assert_eq!(p.oldest_in_flight(), None);
        p.begin(10, at(0)).unwrap();
        p.begin(11, at(5)).unwrap();
        p.begin(12, at(9)).unwrap();
        p.done(11).unwrap();
        assert_eq!(p.oldest_in_flight(), Some(at(0)));
        p.done(10).unwrap();
        assert_eq!(p.oldest_in_flight(), Some(at(9)), "11 is done, 12 is next");
        p.done(12).unwrap();
        assert_eq!(p.oldest_in_flight(), None);
    }

    /// A partition with `offsets` begun now, in order.
    fn begun(offsets: impl IntoIterator<Item = i64>) -> PartitionOffsets {
        let mut p = PartitionOffsets::default();
        for offset in offsets {
            p.begin(offset, Instant::now()).unwrap();
        }
        p
    }

    /// Marks `offset` done and answers the commit point after it.
    fn finish(p: &mut PartitionOffsets, offset: i64) -> Option<i64> {
        p.done(offset).unwrap();
        p.commit_point()
    }

    #[test]
    fn commit_point_waits_for_the_slowest_record() {
        assert_eq!(PartitionOffsets::default().commit_point(), None);
        let mut p = begun(41..=44);
        p.done(42).unwrap();
        p.done(44).unwrap();
        assert_eq!(p.commit_point(), Some(41), "41 is unfinished");
        assert_eq!(finish(&mut p, 41), Some(43));
        assert_eq!(finish(&mut p, 43), Some(45));
    }

    #[test]
    fn gaps_between_offsets_are_skipped() {
        let mut p = begun([10, 15]);
        assert_eq!(finish(&mut p, 10), Some(15));
        assert_eq!(finish(&mut p, 15), Some(16));
    }

    #[test]
    fn misuse_is_refused_without_changing_state() {
        let mut p = begun([5]);
        assert_eq!(
            p.begin(5, Instant::now()),
            Err(TrackerError::NotIncreasing {
                offset: 5,
                highest: 5
            })
        );
        assert_eq!(p.done(6), Err(TrackerError::NotInFlight(6)));
        assert_eq!(p.in_flight(), 1);
        let mut all = InFlightOffsets::default();
        let key = PartitionKey::new("t", 0);
        assert_eq!(
            all.begin(&key, 1, Instant::now()),
            Err(TrackerError::NotAssigned(key.clone()))
        );
    }

    #[test]
    fn reassignment_starts_from_nothing() {
        let mut all = InFlightOffsets::default();
        let key = PartitionKey::new("t", 3);
        all.assign(key.clone());
        all.begin(&key, 7, Instant::now()).unwrap();
        all.assign(key.clone());
        assert_eq!(all.partition(&key).unwrap().in_flight(), 0);
        // After a reassignment the group may resume below what this member saw before.
        all.begin(&key, 2, Instant::now()).unwrap();
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Begin the next offset, `gap` past the previous one.
        Begin { gap: i64 },
        /// Finish the in-flight offset at this index (modulo the count).
        Done { pick: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1i64..4).prop_map(|gap| Op::Begin { gap }),
            any::<usize>().prop_map(|pick| Op::Done { pick }),
        ]
    }

    proptest! {
        /// The state machine against a model: the commit point never passes an unfinished
        /// offset (so every begun offset below it is done) and never goes backwards within an
        /// assignment.
        #[test]
        fn commit_point_never_passes_unfinished_work(ops in proptest::collection::vec(op(), 1..200)) {
            let mut p = PartitionOffsets::default();
            let mut next = 0i64;
            let mut unfinished: Vec<i64> = Vec::new();
            let mut finished: Vec<i64> = Vec::new();
            let mut last_point: Option<i64> = None;
            for op in ops {
                match op {
                    Op::Begin { gap } => {
                        next += gap;
                        p.begin(next, Instant::now()).unwrap();
                        unfinished.push(next);
                    }
                    Op::Done { pick } => {
                        if unfinished.is_empty() {
                            continue;
                        }
                        let offset = unfinished.remove(pick % unfinished.len());
                        p.done(offset).unwrap();
                        finished.push(offset);
                    }
                }
                let point = p.commit_point();
                if let Some(point) = point {
                    prop_assert!(unfinished.iter().all(|&o| o >= point), "passed unfinished work");
                }
                prop_assert!(point >= last_point, "went backwards: {last_point:?} -> {point:?}");
                prop_assert_eq!(point.is_some(), !finished.is_empty(), "a point exists once something is done");
                last_point = point;
                prop_assert_eq!(p.in_flight(), unfinished.len());
            }
        }
    }
}
