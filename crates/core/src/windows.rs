//! Which records run now, pure: each partition's window, the global window, and the bounded
//! read-ahead behind them. The consumer tells it what arrives, what ends and what is assigned
//! or taken away, and does what it answers: start a record, queue it, pause or resume a
//! partition. Keeping these rules here lets a property test hold them over any sequence of
//! events, and lets every source of records run by the same rules.
//!
//! The rules:
//! - at most `partition` records of one partition run at once, and at most `global` in all;
//! - a record starts at once only when its partition's window and the global one have room
//!   and nothing of its partition waits before it: a partition's records start in the order
//!   they arrived;
//! - a freed slot goes to the waiting records, partitions taken in turn (by key), so one busy
//!   partition cannot starve the others of the global window;
//! - a partition whose waiting records reach `read_ahead` is paused, and resumed once they have
//!   drained to half: memory stays bounded by window + read-ahead records a partition;
//! - every assignment of a partition is a new epoch: a record of an earlier assignment that
//!   ends late frees nothing in the new one;
//! - a partition taken away (or everything, at shutdown) drops its waiting records: never
//!   started, so never committed past, they are read again by the partition's next owner.

use std::collections::{BTreeMap, VecDeque};

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
struct Lane<S, T> {
    epoch: u64,
    /// What the caller keeps with the assignment (its cancellation scope), handed back with
    /// every record started in it.
    scope: S,
    running: usize,
    backlog: VecDeque<T>,
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
pub enum Offer<K, S, T> {
    /// Start it now.
    Start(Start<K, S, T>),
    /// It waits for a slot.
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
/// assignment, `T` a record.
#[derive(Debug)]
pub struct Windows<K, S, T> {
    limits: WindowLimits,
    lanes: BTreeMap<K, Lane<S, T>>,
    next_epoch: u64,
}

impl<K: Ord + Clone, S: Clone, T> Windows<K, S, T> {
    pub fn new(limits: WindowLimits) -> Self {
        Self {
            limits,
            lanes: BTreeMap::new(),
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
            backlog: VecDeque::new(),
            paused: false,
        };
        self.lanes.insert(key, lane).map(released)
    }

    /// Partition `key` is taken away: its lane is forgotten, waiting records dropped.
    pub fn release(&mut self, key: &K) -> Option<Released<S>> {
        self.lanes.remove(key).map(released)
    }

    /// Drops the waiting records of `key` (never started); its running ones go on.
    pub fn drop_waiting(&mut self, key: &K) {
        if let Some(lane) = self.lanes.get_mut(key) {
            lane.backlog.clear();
        }
    }

    /// Drops every partition's waiting records: nothing new starts (shutdown).
    pub fn drop_all_waiting(&mut self) {
        for lane in self.lanes.values_mut() {
            lane.backlog.clear();
        }
    }

    /// Takes a record of `key`: starts it if the windows have room and nothing of its
    /// partition waits before it, else queues it.
    pub fn offer(&mut self, key: &K, item: T) -> Offer<K, S, T> {
        let room = self.running() < self.limits.global;
        let Some(lane) = self.lanes.get_mut(key) else {
            return Offer::NotAssigned(item);
        };
        if room && lane.running < self.limits.partition && lane.backlog.is_empty() {
            lane.running += 1;
            Offer::Start(Start {
                key: key.clone(),
                epoch: lane.epoch,
                scope: lane.scope.clone(),
                item,
            })
        } else {
            lane.backlog.push_back(item);
            Offer::Queued
        }
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

    /// The waiting records that fit the free slots now, partitions taken in turn.
    pub fn take_ready(&mut self) -> Vec<Start<K, S, T>> {
        let mut ready = Vec::new();
        let mut keys: Vec<K> = self
            .lanes
            .iter()
            .filter(|(_, lane)| !lane.backlog.is_empty())
            .map(|(key, _)| key.clone())
            .collect();
        let mut running = self.running();
        while running < self.limits.global && !keys.is_empty() {
            keys.retain(|key| {
                if running >= self.limits.global {
                    return false;
                }
                let Some(lane) = self.lanes.get_mut(key) else {
                    return false;
                };
                if lane.running >= self.limits.partition {
                    return false;
                }
                let Some(item) = lane.backlog.pop_front() else {
                    return false;
                };
                lane.running += 1;
                running += 1;
                ready.push(Start {
                    key: key.clone(),
                    epoch: lane.epoch,
                    scope: lane.scope.clone(),
                    item,
                });
                !lane.backlog.is_empty()
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
            let waiting = lane.backlog.len();
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
        self.lanes.get(key).map_or(0, |lane| lane.backlog.len())
    }

    pub fn is_assigned(&self, key: &K) -> bool {
        self.lanes.contains_key(key)
    }

    /// The assigned partitions, by key.
    pub fn assigned(&self) -> impl Iterator<Item = &K> {
        self.lanes.keys()
    }
}

fn released<S, T>(lane: Lane<S, T>) -> Released<S> {
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

    /// A record: its partition and its place in what that partition delivered.
    type Record = (u8, u32);

    #[test]
    fn a_record_starts_at_once_only_when_both_windows_have_room() {
        let mut w: Windows<u8, (), Record> = Windows::new(LIMITS);
        w.assign(0, ());
        w.assign(1, ());
        assert!(matches!(w.offer(&0, (0, 0)), Offer::Start(_)));
        assert!(matches!(w.offer(&0, (0, 1)), Offer::Start(_)));
        // The partition's window is full.
        assert_eq!(w.offer(&0, (0, 2)), Offer::Queued);
        assert!(matches!(w.offer(&1, (1, 0)), Offer::Start(_)));
        // The global window is full.
        assert_eq!(w.offer(&1, (1, 1)), Offer::Queued);
        assert_eq!(w.offer(&2, (2, 0)), Offer::NotAssigned((2, 0)));
        assert_eq!(w.running(), 3);
    }

    #[test]
    fn a_freed_slot_goes_to_the_partitions_in_turn() {
        let mut w: Windows<u8, (), Record> = Windows::new(WindowLimits {
            partition: 4,
            global: 2,
            read_ahead: 100,
        });
        w.assign(0, ());
        w.assign(1, ());
        let epoch = match w.offer(&0, (0, 0)) {
            Offer::Start(start) => start.epoch,
            other => panic!("{other:?}"),
        };
        assert!(matches!(w.offer(&0, (0, 1)), Offer::Start(_)));
        for n in 2..5 {
            w.offer(&0, (0, n));
        }
        w.offer(&1, (1, 0));
        assert!(w.finish(&0, epoch));
        assert!(w.finish(&0, epoch));
        let started: Vec<Record> = w.take_ready().into_iter().map(|s| s.item).collect();
        assert_eq!(started, vec![(0, 2), (1, 0)]);
    }

    #[test]
    fn a_late_record_of_an_earlier_assignment_frees_nothing() {
        let mut w: Windows<u8, (), Record> = Windows::new(LIMITS);
        w.assign(0, ());
        let old = match w.offer(&0, (0, 0)) {
            Offer::Start(start) => start.epoch,
            other => panic!("{other:?}"),
        };
        let replaced = w.assign(0, ()).expect("the first assignment is replaced");
        assert_eq!(replaced.running, 1);
        assert!(matches!(w.offer(&0, (0, 1)), Offer::Start(_)));
        assert!(!w.finish(&0, old));
        assert_eq!(w.running(), 1);
    }

    #[derive(Debug, Clone)]
    enum Event {
        Assign(u8),
        Release(u8),
        DropWaiting(u8),
        DropAllWaiting,
        /// A record of the partition arrives.
        Offer(u8),
        /// The `n`-th counted running record (modulo how many) ends.
        Finish(usize),
        /// The `n`-th record of an assignment that has ended (modulo how many) ends late.
        FinishStale(usize),
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            1 => (0u8..4).prop_map(Event::Assign),
            1 => (0u8..4).prop_map(Event::Release),
            1 => (0u8..4).prop_map(Event::DropWaiting),
            1 => Just(Event::DropAllWaiting),
            8 => (0u8..4).prop_map(Event::Offer),
            6 => any::<usize>().prop_map(Event::Finish),
            2 => any::<usize>().prop_map(Event::FinishStale),
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
        waiting: BTreeMap<u8, Vec<Record>>,
        assigned: BTreeSet<u8>,
        paused: BTreeSet<u8>,
        delivered: BTreeMap<u8, u32>,
        started: BTreeSet<Record>,
        last_started: BTreeMap<(u8, u64), u32>,
        /// Records that ended: finished, dropped unstarted, or refused.
        ended: BTreeSet<Record>,
    }

    impl Model {
        fn start(&mut self, s: Start<u8, u8, Record>) -> Result<(), TestCaseError> {
            prop_assert_eq!(s.scope, s.key, "a record carries its assignment's scope");
            prop_assert!(self.started.insert(s.item), "{:?} started twice", s.item);
            if let Some(&last) = self.last_started.get(&(s.key, s.epoch)) {
                prop_assert!(s.item.1 > last, "{:?} started after {}", s.item, last);
            }
            self.last_started.insert((s.key, s.epoch), s.item.1);
            let queue = self.waiting.entry(s.key).or_default();
            if let Some(pos) = queue.iter().position(|r| *r == s.item) {
                prop_assert_eq!(pos, 0, "{:?} jumped its partition's queue", s.item);
                queue.remove(pos);
            }
            self.running.push((s.key, s.epoch, s.item));
            Ok(())
        }

        /// Partition `p`'s assignment ended: its running records go on, counted by no window,
        /// and its waiting ones are dropped.
        fn end_assignment(&mut self, p: u8) {
            self.displaced
                .extend(self.running.extract_if(.., |r| r.0 == p));
            let dropped = self.waiting.remove(&p).unwrap_or_default();
            self.ended.extend(dropped);
            self.paused.remove(&p);
        }
    }

    proptest! {
        /// Over any sequence of arrivals, ends, assignments and revocations, driven as the
        /// consumer drives it (freed slots filled when a record ends): the windows are never
        /// exceeded; a partition's records start in the order they arrived; no record is
        /// started twice or lost (each one runs, waits, or ended: finished, dropped unstarted
        /// or refused); a slot freed by an end is given to a record that fits it; records
        /// never wait with nothing running that could free a slot; and a partition is paused
        /// at `read_ahead` waiting records and resumed at half.
        #[test]
        fn the_windows_hold_over_any_sequence(limits in limits(), events in prop::collection::vec(event(), 1..200)) {
            let mut w: Windows<u8, u8, Record> = Windows::new(limits);
            let mut m = Model::default();
            for event in events {
                let mut ended_a_record = false;
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
                    Event::Offer(p) => {
                        let n = m.delivered.entry(p).or_default();
                        let record = (p, *n);
                        *n += 1;
                        match w.offer(&p, record) {
                            Offer::Start(s) => {
                                prop_assert!(
                                    m.waiting.get(&p).is_none_or(Vec::is_empty),
                                    "{:?} started before its partition's waiting records", record
                                );
                                m.start(s)?;
                            }
                            Offer::Queued => {
                                prop_assert!(m.assigned.contains(&p));
                                m.waiting.entry(p).or_default().push(record);
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
                    if ended_a_record && queued > 0 {
                        prop_assert!(
                            m.running.len() == limits.global || of_p == limits.partition,
                            "partition {} has {} waiting beside a slot an end freed", p, queued
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
            for (_, _, r) in m.running.iter().chain(&m.displaced) {
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
