//! Which records run now, pure: each partition's window, the global window, the bounded
//! read-ahead behind them, and the fair order between workspaces (I10). The consumer tells it
//! what arrives (and whose it is), what ends and what is assigned or taken away, and does
//! what it answers: start records, pause or resume a partition. Keeping these rules here lets
//! a property test hold them over any sequence of events, and lets every source of records
//! run by the same rules.
//!
//! The rules:
//! - at most `partition` records of one partition run at once, and at most `global` in all;
//! - a record that arrives waits; [`Windows::take_ready`] starts waiting records while the
//!   windows have room, in weighted fair order by workspace ([`crate::fair`]): a workspace
//!   whose records arrive behind another's backlog starts its next record at the next free
//!   slot that record fits, not behind the backlog;
//! - records of one partition and one workspace start in the order they arrived; a partition
//!   whose window is full holds back only its own records;
//! - a partition whose waiting records reach `read_ahead` is paused, and resumed once they have
//!   drained to half: memory stays bounded by window + read-ahead records a partition. The
//!   read-ahead is what lets a newcomer's records be seen past another workspace's backlog, so
//!   it is several windows deep;
//! - a running record that only waits (for the provider's capacity) gives its slot back
//!   ([`Windows::park`]) and counts against no window until it ends: a workspace whose calls
//!   wait cannot hold the windows from the others' records;
//! - every assignment of a partition is a new epoch: a record of an earlier assignment that
//!   ends late frees nothing in the new one;
//! - a partition taken away (or everything, at shutdown) drops its waiting records: never
//!   started, so never committed past, they are read again by the partition's next owner.

use std::collections::BTreeMap;
use std::hash::Hash;

use crate::fair::FairQueue;

/// The windows' sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowLimits {
    /// Records of one partition running at once.
    pub partition: usize,
    /// Records running at once in all.
    pub global: usize,
    /// Records of one partition waiting for a slot before it is paused.
    pub read_ahead: usize,
}

/// One assignment of one partition.
#[derive(Debug)]
struct Lane<S> {
    epoch: u64,
    /// What the caller keeps with the assignment (its cancellation scope), handed back with
    /// every record started in it.
    scope: S,
    running: usize,
    paused: bool,
}

/// A record to start now, in the assignment `epoch` of partition `key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start<K, S, T> {
    pub key: K,
    pub epoch: u64,
    pub scope: S,
    pub item: T,
}

/// What became of an offered record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Offer<T> {
    /// It waits for [`Windows::take_ready`] (which may start it at once).
    Queued,
    /// Its partition is not assigned (any more): it is not taken.
    NotAssigned(T),
}

/// A partition taken away: what it held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released<S> {
    pub scope: S,
    /// Records still running; they no longer count against any window.
    pub running: usize,
    pub paused: bool,
}

/// Partitions to pause and to resume after a change of the waiting records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PauseChanges<K> {
    pub pause: Vec<K>,
    pub resume: Vec<K>,
    /// Partitions paused after the change.
    pub paused: usize,
}

/// The windows of one consumer: `K` a partition's key, `S` what the caller keeps with each
/// assignment, `T` a record, `C` whose a record is (a workspace).
pub struct Windows<K, S, T, C = String> {
    limits: WindowLimits,
    lanes: BTreeMap<K, Lane<S>>,
    waiting: FairQueue<C, K, T>,
    next_epoch: u64,
}

impl<K, S, T, C> Windows<K, S, T, C>
where
    K: Ord + Hash + Clone,
    S: Clone,
    C: Ord + Hash + Clone,
{
    pub fn new(limits: WindowLimits) -> Self {
        Self {
            limits,
            lanes: BTreeMap::new(),
            waiting: FairQueue::new(),
            next_epoch: 0,
        }
    }

    /// Partition `key` is assigned: a new epoch, nothing running or waiting, not paused. An
    /// assignment it replaces (the same partition given again without being taken away) is
    /// returned: its records no longer count, and the caller cancels its scope.
    pub fn assign(&mut self, key: K, scope: S) -> Option<Released<S>> {
        self.next_epoch += 1;
        let lane = Lane {
            epoch: self.next_epoch,
            scope,
            running: 0,
            paused: false,
        };
        self.waiting.drop_lane(&key);
        self.lanes.insert(key, lane).map(released)
    }

    /// Partition `key` is taken away: its lane is forgotten, waiting records dropped.
    pub fn release(&mut self, key: &K) -> Option<Released<S>> {
        self.waiting.drop_lane(key);
        self.lanes.remove(key).map(released)
    }

    /// Drops the waiting records of `key` (never started); its running ones go on.
    pub fn drop_waiting(&mut self, key: &K) {
        self.waiting.drop_lane(key);
    }

    /// Drops every partition's waiting records: nothing new starts (shutdown).
    pub fn drop_all_waiting(&mut self) {
        self.waiting.clear();
    }

    /// Takes a record of `key`, owned by `class` of `weight`: it waits for
    /// [`Windows::take_ready`], which the caller calls next.
    pub fn offer(&mut self, key: &K, class: C, weight: u32, item: T) -> Offer<T> {
        if !self.lanes.contains_key(key) {
            return Offer::NotAssigned(item);
        }
        self.waiting.push(class, key.clone(), weight, item);
        Offer::Queued
    }

    /// A record of assignment `epoch` of `key` stopped running. Whether it counted: one of an
    /// assignment that has since ended frees nothing.
    pub fn finish(&mut self, key: &K, epoch: u64) -> bool {
        match self.lanes.get_mut(key) {
            Some(lane) if lane.epoch == epoch && lane.running > 0 => {
                lane.running -= 1;
                true
            }
            _ => false,
        }
    }

    /// A running record of assignment `epoch` of `key` only waits now (for the provider's
    /// capacity): it gives its slot back, so that records of other workspaces can start while
    /// it waits (I10), and counts against no window until it ends. Whether it counted: one of
    /// an assignment that has since ended frees nothing. The caller then fills the slot
    /// ([`Windows::take_ready`]) and, when the record ends, does not [`Windows::finish`] it.
    pub fn park(&mut self, key: &K, epoch: u64) -> bool {
        self.finish(key, epoch)
    }

    /// Whether `epoch` is the current assignment of `key`: a parked record's end moves the
    /// commit point only then.
    pub fn holds(&self, key: &K, epoch: u64) -> bool {
        self.lanes.get(key).is_some_and(|lane| lane.epoch == epoch)
    }

    /// The waiting records that fit the free slots now, in fair order.
    pub fn take_ready(&mut self) -> Vec<Start<K, S, T>> {
        let mut ready = Vec::new();
        let mut running = self.running();
        let partition = self.limits.partition;
        while running < self.limits.global {
            let lanes = &self.lanes;
            let Some((_, key, item)) = self
                .waiting
                .pop(|key| lanes.get(key).is_some_and(|lane| lane.running < partition))
            else {
                break;
            };
            let Some(lane) = self.lanes.get_mut(&key) else {
                // Unreachable: a lane's records are dropped with it, and `pop` took an open
                // lane.
                continue;
            };
            lane.running += 1;
            running += 1;
            ready.push(Start {
                key,
                epoch: lane.epoch,
                scope: lane.scope.clone(),
                item,
            });
        }
        ready
    }

    /// Pauses the partitions whose waiting records reached `read_ahead`, resumes the paused
    /// ones drained to half.
    pub fn back_pressure(&mut self) -> PauseChanges<K> {
        let mut changes = PauseChanges {
            pause: Vec::new(),
            resume: Vec::new(),
            paused: 0,
        };
        for (key, lane) in self.lanes.iter_mut() {
            let waiting = self.waiting.len_of(key);
            if !lane.paused && waiting >= self.limits.read_ahead {
                lane.paused = true;
                changes.pause.push(key.clone());
            } else if lane.paused && waiting <= self.limits.read_ahead / 2 {
                lane.paused = false;
                changes.resume.push(key.clone());
            }
            changes.paused += usize::from(lane.paused);
        }
        changes
    }

    /// Records running now, in all.
    pub fn running(&self) -> usize {
        self.lanes.values().map(|lane| lane.running).sum()
    }

    /// Records of `keys` running now.
    pub fn running_of<'a>(&self, keys: impl IntoIterator<Item = &'a K>) -> usize
    where
        K: 'a,
    {
        keys.into_iter()
            .filter_map(|key| self.lanes.get(key))
            .map(|lane| lane.running)
            .sum()
    }

    /// Records of `key` waiting for a slot.
    pub fn waiting(&self, key: &K) -> usize {
        self.waiting.len_of(key)
    }

    /// Records waiting for a slot, by class.
    pub fn waiting_by_class(&self) -> BTreeMap<C, usize> {
        self.waiting.waiting_by_class()
    }

    pub fn is_assigned(&self, key: &K) -> bool {
        self.lanes.contains_key(key)
    }

    /// Whether `key` is assigned and paused by [`Self::back_pressure`].
    pub fn is_paused(&self, key: &K) -> bool {
        self.lanes.get(key).is_some_and(|lane| lane.paused)
    }

    /// The assigned partitions, by key.
    pub fn assigned(&self) -> impl Iterator<Item = &K> {
        self.lanes.keys()
    }
}

fn released<S>(lane: Lane<S>) -> Released<S> {
    Released {
        scope: lane.scope,
        running: lane.running,
        paused: lane.paused,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    const LIMITS: WindowLimits = WindowLimits {
        partition: 2,
        global: 3,
        read_ahead: 4,
    };

    /// A record: its partition, its workspace, and its place in what that partition delivered.
    type Record = (u8, u8, u32);

    /// Offers a record and starts what fits: what the consumer does with each arrival.
    fn arrive(w: &mut Windows<u8, (), Record, u8>, record: Record) -> Vec<Record> {
        assert_eq!(w.offer(&record.0, record.1, 1, record), Offer::Queued);
        w.take_ready().into_iter().map(|s| s.item).collect()
    }

    #[test]
    fn a_record_starts_at_once_only_when_both_windows_have_room() {
        let mut w: Windows<u8, (), Record, u8> = Windows::new(LIMITS);
        w.assign(0, ());
        w.assign(1, ());
        assert_eq!(arrive(&mut w, (0, 0, 0)), vec![(0, 0, 0)]);
        assert_eq!(arrive(&mut w, (0, 0, 1)), vec![(0, 0, 1)]);
        // The partition's window is full.
        assert_eq!(arrive(&mut w, (0, 0, 2)), vec![]);
        assert_eq!(arrive(&mut w, (1, 0, 0)), vec![(1, 0, 0)]);
        // The global window is full.
        assert_eq!(arrive(&mut w, (1, 0, 1)), vec![]);
        assert_eq!(w.offer(&2, 0, 1, (2, 0, 0)), Offer::NotAssigned((2, 0, 0)));
        assert_eq!(w.running(), 3);
    }

    #[test]
    fn a_workspace_behind_another_ones_backlog_takes_the_next_free_slots_in_turn() {
        let mut w: Windows<u8, (), Record, u8> = Windows::new(WindowLimits {
            partition: 4,
            global: 2,
            read_ahead: 100,
        });
        w.assign(0, ());
        w.assign(1, ());
        let epoch = w.lanes[&0].epoch;
        // Workspace 0's burst fills the window and waits behind it, on both partitions.
        for n in 0..6 {
            arrive(&mut w, (n as u8 % 2, 0, n));
        }
        assert_eq!(w.running(), 2);
        // Workspace 1 arrives behind it, on partition 0.
        assert_eq!(arrive(&mut w, (0, 1, 0)), vec![]);
        assert_eq!(arrive(&mut w, (0, 1, 1)), vec![]);
        // Each slot partition 0 frees goes to the next workspace in turn: 1, then 0, then 1.
        for next in [(0, 1, 0), (0, 0, 2), (0, 1, 1)] {
            assert!(w.finish(&0, epoch));
            let started: Vec<Record> = w.take_ready().into_iter().map(|s| s.item).collect();
            assert_eq!(started, vec![next]);
        }
        assert_eq!(w.waiting_by_class(), BTreeMap::from([(0, 3)]));
    }

    #[test]
    fn a_late_record_of_an_earlier_assignment_frees_nothing() {
        let mut w: Windows<u8, (), Record, u8> = Windows::new(LIMITS);
        w.assign(0, ());
        assert_eq!(arrive(&mut w, (0, 0, 0)), vec![(0, 0, 0)]);
        let old = w.lanes[&0].epoch;
        let replaced = w.assign(0, ()).expect("the first assignment is replaced");
        assert_eq!(replaced.running, 1);
        assert_eq!(arrive(&mut w, (0, 0, 1)), vec![(0, 0, 1)]);
        assert!(!w.finish(&0, old));
        assert_eq!(w.running(), 1);
    }

    #[derive(Debug, Clone)]
    enum Event {
        Assign(u8),
        Release(u8),
        DropWaiting(u8),
        DropAllWaiting,
        /// A record of the partition, of the workspace, arrives.
        Offer(u8, u8),
        /// The `n`-th counted running record (modulo how many) ends.
        Finish(usize),
        /// The `n`-th record of an assignment that has ended (modulo how many) ends late.
        FinishStale(usize),
        /// The `n`-th counted running record (modulo how many) starts waiting for capacity.
        Park(usize),
        /// The `n`-th parked record (modulo how many) ends.
        FinishParked(usize),
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            1 => (0u8..4).prop_map(Event::Assign),
            1 => (0u8..4).prop_map(Event::Release),
            1 => (0u8..4).prop_map(Event::DropWaiting),
            1 => Just(Event::DropAllWaiting),
            8 => (0u8..4, 0u8..3).prop_map(|(p, c)| Event::Offer(p, c)),
            6 => any::<usize>().prop_map(Event::Finish),
            2 => any::<usize>().prop_map(Event::FinishStale),
            3 => any::<usize>().prop_map(Event::Park),
            3 => any::<usize>().prop_map(Event::FinishParked),
        ]
    }

    fn limits() -> impl Strategy<Value = WindowLimits> {
        (1usize..4, 1usize..7, 1usize..6).prop_map(|(partition, global, read_ahead)| WindowLimits {
            partition,
            global,
            read_ahead,
        })
    }

    /// The consumer's model: what it believes runs and waits, checked against the windows.
    #[derive(Default)]
    struct Model {
        /// Records running and counted: (partition, epoch, record).
        running: Vec<(u8, u64, Record)>,
        /// Records still running whose assignment ended: they count against no window.
        displaced: Vec<(u8, u64, Record)>,
        /// Records that gave their slot back to wait: they count against no window.
        parked: Vec<(u8, u64, Record)>,
        waiting: BTreeMap<u8, Vec<Record>>,
        assigned: BTreeSet<u8>,
        paused: BTreeSet<u8>,
        delivered: BTreeMap<u8, u32>,
        started: BTreeSet<Record>,
        /// The last record started of each partition's assignment and workspace.
        last_started: BTreeMap<(u8, u64, u8), u32>,
        /// Records that ended: finished, dropped unstarted, or refused.
        ended: BTreeSet<Record>,
        /// Assignments that ended (replaced or released).
        ended_epochs: BTreeSet<(u8, u64)>,
        /// The current epoch of each assigned partition, as the model saw it start records.
        epochs: BTreeMap<u8, u64>,
    }

    impl Model {
        fn start(&mut self, s: Start<u8, u8, Record>) -> Result<(), TestCaseError> {
            prop_assert_eq!(s.scope, s.key, "a record carries its assignment's scope");
            prop_assert!(self.started.insert(s.item), "{:?} started twice", s.item);
            let class = s.item.1;
            if let Some(&last) = self.last_started.get(&(s.key, s.epoch, class)) {
                prop_assert!(s.item.2 > last, "{:?} started after {}", s.item, last);
            }
            self.last_started.insert((s.key, s.epoch, class), s.item.2);
            let queue = self.waiting.entry(s.key).or_default();
            let pos = queue.iter().position(|r| *r == s.item);
            prop_assert!(pos.is_some(), "{:?} started without having waited", s.item);
            if let Some(pos) = pos {
                prop_assert!(
                    queue[..pos].iter().all(|r| r.1 != class),
                    "{:?} jumped its partition's queue of its workspace",
                    s.item
                );
                queue.remove(pos);
            }
            self.epochs.insert(s.key, s.epoch);
            self.running.push((s.key, s.epoch, s.item));
            Ok(())
        }

        /// Partition `p`'s assignment ended: its running records go on, counted by no window,
        /// and its waiting ones are dropped.
        fn end_assignment(&mut self, p: u8) {
            if let Some(epoch) = self.epochs.remove(&p) {
                self.ended_epochs.insert((p, epoch));
            }
            // Parked ones of any ended epoch: marked through ended_epochs.
            for (q, epoch, _) in &self.parked {
                if *q == p {
                    self.ended_epochs.insert((p, *epoch));
                }
            }
            self.displaced
                .extend(self.running.extract_if(.., |r| r.0 == p));
            let dropped = self.waiting.remove(&p).unwrap_or_default();
            self.ended.extend(dropped);
            self.paused.remove(&p);
        }
    }

    proptest! {
        /// Over any sequence of arrivals, ends, assignments and revocations, driven as the
        /// consumer drives it (free slots filled when a record arrives or ends): the windows are
        /// never exceeded; a partition's records of one workspace start in the order they
        /// arrived; no record is
        /// started twice or lost (each one runs, waits, or ended: finished, dropped unstarted
        /// or refused); a slot freed by an end is given to a record that fits it; records
        /// never wait with nothing running that could free a slot; and a partition is paused
        /// at `read_ahead` waiting records and resumed at half.
        #[test]
        fn the_windows_hold_over_any_sequence(limits in limits(), events in prop::collection::vec(event(), 1..200)) {
            let mut w: Windows<u8, u8, Record, u8> = Windows::new(limits);
            let mut m = Model::default();
            for event in events {
                let mut ended_a_record = false;
                let mut freed_or_arrived = false;
                match event {
                    Event::Assign(p) => {
                        let replaced = w.assign(p, p);
                        prop_assert_eq!(replaced.is_some(), m.assigned.contains(&p));
                        if let Some(old) = replaced {
                            prop_assert_eq!(old.running, m.running.iter().filter(|r| r.0 == p).count());
                        }
                        m.end_assignment(p);
                        m.assigned.insert(p);
                    }
                    Event::Release(p) => {
                        let released = w.release(&p);
                        prop_assert_eq!(released.is_some(), m.assigned.remove(&p));
                        m.end_assignment(p);
                    }
                    Event::DropWaiting(p) => {
                        w.drop_waiting(&p);
                        let dropped = m.waiting.remove(&p).unwrap_or_default();
                        m.ended.extend(dropped);
                    }
                    Event::DropAllWaiting => {
                        w.drop_all_waiting();
                        for (_, queue) in std::mem::take(&mut m.waiting) {
                            m.ended.extend(queue);
                        }
                    }
                    Event::Offer(p, class) => {
                        let n = m.delivered.entry(p).or_default();
                        let record = (p, class, *n);
                        *n += 1;
                        match w.offer(&p, class, 1 + u32::from(class), record) {
                            Offer::Queued => {
                                prop_assert!(m.assigned.contains(&p));
                                m.waiting.entry(p).or_default().push(record);
                                // The consumer starts what fits after each arrival.
                                for s in w.take_ready() {
                                    m.start(s)?;
                                }
                                freed_or_arrived = true;
                            }
                            Offer::NotAssigned(r) => {
                                prop_assert_eq!(r, record);
                                prop_assert!(!m.assigned.contains(&p));
                                m.ended.insert(r);
                            }
                        }
                    }
                    Event::Finish(n) => {
                        if !m.running.is_empty() {
                            let (p, epoch, record) = m.running.remove(n % m.running.len());
                            prop_assert!(w.finish(&p, epoch));
                            m.ended.insert(record);
                            ended_a_record = true;
                        }
                    }
                    Event::Park(n) => {
                        if !m.running.is_empty() {
                            let (p, epoch, record) = m.running.remove(n % m.running.len());
                            prop_assert!(w.park(&p, epoch), "a counted record's park frees its slot");
                            m.parked.push((p, epoch, record));
                            ended_a_record = true;
                        }
                    }
                    Event::FinishParked(n) => {
                        if !m.parked.is_empty() {
                            let (p, epoch, record) = m.parked.remove(n % m.parked.len());
                            prop_assert_eq!(
                                w.holds(&p, epoch),
                                m.assigned.contains(&p) && !m.ended_epochs.contains(&(p, epoch)),
                                "a parked record's end counts only in its assignment"
                            );
                            m.ended.insert(record);
                        }
                    }
                    Event::FinishStale(n) => {
                        if !m.displaced.is_empty() {
                            let (p, epoch, record) = m.displaced.remove(n % m.displaced.len());
                            prop_assert!(!w.finish(&p, epoch), "a record of an ended assignment freed a slot");
                            m.ended.insert(record);
                            ended_a_record = true;
                        }
                    }
                }
                // The consumer fills freed slots when a record ends, fresh or late.
                if ended_a_record {
                    for s in w.take_ready() {
                        m.start(s)?;
                    }
                    freed_or_arrived = true;
                }
                let changes = w.back_pressure();
                for p in &changes.pause {
                    prop_assert!(m.paused.insert(*p));
                }
                for p in &changes.resume {
                    prop_assert!(m.paused.remove(p));
                }
                prop_assert_eq!(changes.paused, m.paused.len());

                prop_assert_eq!(w.running(), m.running.len());
                prop_assert!(m.running.len() <= limits.global);
                let mut waiting_in_all = 0;
                for p in 0u8..4 {
                    let of_p = m.running.iter().filter(|r| r.0 == p).count();
                    prop_assert!(of_p <= limits.partition);
                    prop_assert_eq!(w.running_of([&p]), of_p);
                    let queued = m.waiting.get(&p).map_or(0, Vec::len);
                    prop_assert_eq!(w.waiting(&p), queued);
                    waiting_in_all += queued;
                    if freed_or_arrived && queued > 0 {
                        prop_assert!(
                            m.running.len() == limits.global || of_p == limits.partition,
                            "partition {} has {} waiting beside a free slot", p, queued
                        );
                    }
                    if queued >= limits.read_ahead {
                        prop_assert!(m.paused.contains(&p));
                    }
                    if queued <= limits.read_ahead / 2 {
                        prop_assert!(!m.paused.contains(&p));
                    }
                }
                // Waiting records always have an end to come that will look for them.
                if waiting_in_all > 0 {
                    prop_assert!(!m.running.is_empty() || !m.displaced.is_empty(), "records wait with nothing running");
                }
            }
            // Every record delivered is accounted for exactly once.
            let mut all = m.ended.clone();
            for (_, _, r) in m.running.iter().chain(&m.displaced).chain(&m.parked) {
                prop_assert!(all.insert(*r), "{:?} both running and ended", r);
            }
            for r in m.waiting.values().flatten() {
                prop_assert!(all.insert(*r), "{:?} both waiting and elsewhere", r);
            }
            let total: u32 = m.delivered.values().sum();
            prop_assert_eq!(all.len(), total as usize);
        }
    }
}
