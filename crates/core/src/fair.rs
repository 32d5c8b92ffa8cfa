//! Weighted fair order between workspaces (I10), pure: which waiting item goes next when
//! several workspaces wait for the same thing (a window slot, a capacity permit).
//!
//! Virtual-time fair queuing: each class has a finish tag, advanced by one cost unit divided
//! by its weight each time one of its items goes. The item that goes next is the head of the
//! class whose tag, the later of its finish tag and the queue's virtual time, is smallest (the
//! oldest arrival among equals), and the virtual time becomes that tag. So:
//! - a class alone takes everything, one item after the other: no idle capacity while work
//!   waits;
//! - classes that all wait take turns in proportion to their weights, over any stretch of
//!   grants (a class of weight 2 goes twice for each turn of a class of weight 1);
//! - a class that arrives late starts at the virtual time, not at the back of what the others
//!   queued before it: a burst of 2,000 items of one class delays a newcomer by at most one
//!   turn of each other class, not by the burst;
//! - a class that waited for nothing earns no credit while idle (its tag is at least the
//!   virtual time), so it cannot take a burst of turns back later.
//!
//! Items also carry a lane (a partition, or nothing): items of one class and lane leave in the
//! order they came, and a caller skips lanes that have no room now ([`FairQueue::pop`] takes
//! a test of the lane), which is how a full partition window holds back only its own records.
//! Tags are taken when an item goes, not when it arrives: a lane that was full for a while
//! has not kept a burst's early tags, so when it frees a slot a newcomer behind the burst in
//! that lane gets its turn there too.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::Hash;

/// What one item of weight 1 costs in virtual time. Integer tags: no float comparisons, and
/// 2^44 items of weight 1 before they wrap.
const UNIT: u64 = 1 << 20;

/// The weights a class may have: 1 to 1,000 (a weight of 0 would never be served; more than a
/// thousand to one is not a share any more).
pub const MAX_WEIGHT: u32 = 1_000;

/// A class's weight, clamped to `1..=MAX_WEIGHT`.
pub fn clamp_weight(weight: u32) -> u32 {
    weight.clamp(1, MAX_WEIGHT)
}

/// A class's standing: its finish tag, its weight (the latest an item brought), and the lane
/// its last item left from.
#[derive(Debug, Clone)]
struct Standing<L> {
    finish: u64,
    weight: u32,
    last_lane: Option<L>,
}

/// A queue that may go next: its index among the queues, its class and lane, and its head's
/// arrival number.
type Candidate<'q, C, L> = (usize, &'q C, &'q L, u64);

/// One class's items in one lane, each with its arrival number.
type Fifo<T> = VecDeque<(u64, T)>;

/// Waiting items of classes `C` in lanes `L`, served in weighted fair order.
pub struct FairQueue<C, L, T> {
    /// One FIFO per class and lane, each item with its arrival number.
    queues: BTreeMap<(C, L), Fifo<T>>,
    classes: HashMap<C, Standing<L>>,
    virtual_time: u64,
    seq: u64,
    len: usize,
    per_lane: BTreeMap<L, usize>,
}

impl<C, L, T> Default for FairQueue<C, L, T> {
    fn default() -> Self {
        Self {
            queues: BTreeMap::new(),
            classes: HashMap::new(),
            virtual_time: 0,
            seq: 0,
            len: 0,
            per_lane: BTreeMap::new(),
        }
    }
}

impl<C, L, T> FairQueue<C, L, T>
where
    C: Ord + Hash + Clone,
    L: Ord + Hash + Clone,
{
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues `item` of `class` (of `weight`, clamped to 1..=[`MAX_WEIGHT`]) in `lane`.
    pub fn push(&mut self, class: C, lane: L, weight: u32, item: T) {
        let weight = clamp_weight(weight);
        let now = self.virtual_time;
        self.classes
            .entry(class.clone())
            .and_modify(|s| s.weight = weight)
            .or_insert(Standing {
                finish: now,
                weight,
                last_lane: None,
            });
        self.seq += 1;
        self.queues
            .entry((class, lane.clone()))
            .or_default()
            .push_back((self.seq, item));
        self.len += 1;
        *self.per_lane.entry(lane).or_default() += 1;
    }

    /// The tag of `class`'s next item: its finish tag, or the virtual time if later.
    fn tag(classes: &HashMap<C, Standing<L>>, virtual_time: u64, class: &C) -> u64 {
        classes
            .get(class)
            .map_or(virtual_time, |s| s.finish.max(virtual_time))
    }

    /// Which of `candidates` (a queue's index, its class and lane, its head's arrival; in the
    /// queues' order, so a class's lanes in lane order) goes next, and its tag: the class with
    /// the smallest tag (the oldest head among equals), and of its lanes the one after the
    /// lane it last went from, in turn, so that one class's items free every lane's slots
    /// evenly rather than one lane's after another's.
    fn choose<'c, 'q>(
        classes: &HashMap<C, Standing<L>>,
        virtual_time: u64,
        candidates: &'c [Candidate<'q, C, L>],
    ) -> Option<(&'c Candidate<'q, C, L>, u64)> {
        let (_, class, _, _) = candidates
            .iter()
            .min_by_key(|(_, class, _, seq)| (Self::tag(classes, virtual_time, class), *seq))?;
        let tag = Self::tag(classes, virtual_time, class);
        let last = classes.get(*class).and_then(|s| s.last_lane.as_ref());
        let mut lanes = candidates.iter().filter(|(_, c, _, _)| c == class);
        let first = lanes.clone().next()?;
        let next = match last {
            Some(last) => lanes.find(|(_, _, lane, _)| *lane > last).unwrap_or(first),
            None => first,
        };
        Some((next, tag))
    }

    /// A class's item went at `tag` from `lane`: the virtual time and its standing move on.
    fn went(&mut self, class: &C, lane: &L, tag: u64) {
        self.virtual_time = tag;
        if let Some(standing) = self.classes.get_mut(class) {
            standing.finish = tag + UNIT / u64::from(standing.weight);
            standing.last_lane = Some(lane.clone());
        }
    }

    /// Takes the next item in fair order among the lanes `open` lets go; None when nothing
    /// waits there.
    pub fn pop(&mut self, mut open: impl FnMut(&L) -> bool) -> Option<(C, L, T)> {
        let candidates: Vec<Candidate<C, L>> = self
            .queues
            .iter()
            .enumerate()
            .filter(|(_, ((_, lane), _))| open(lane))
            .filter_map(|(i, ((class, lane), queue))| {
                queue.front().map(|(seq, _)| (i, class, lane, *seq))
            })
            .collect();
        let (&(_, class, lane, _), tag) =
            Self::choose(&self.classes, self.virtual_time, &candidates)?;
        let key = (class.clone(), lane.clone());
        let queue = self.queues.get_mut(&key)?;
        let (_, item) = queue.pop_front()?;
        if queue.is_empty() {
            self.queues.remove(&key);
        }
        let (class, lane) = key;
        self.went(&class, &lane, tag);
        self.len -= 1;
        self.lane_left(&lane, 1);
        self.forget_idle();
        Some((class, lane, item))
    }

    /// Forgets the standing of classes with nothing waiting whose finish the virtual time has
    /// passed: they would start from it anyway. Now and then, so it costs little.
    fn forget_idle(&mut self) {
        if self.classes.len() <= 64 || !self.seq.is_multiple_of(64) {
            return;
        }
        let waiting: std::collections::HashSet<&C> = self.queues.keys().map(|(c, _)| c).collect();
        let now = self.virtual_time;
        self.classes
            .retain(|class, s| s.finish > now || waiting.contains(class));
    }

    /// Drops every item of `lane` (a partition taken away): returns how many.
    pub fn drop_lane(&mut self, lane: &L) -> usize {
        let keys: Vec<(C, L)> = self
            .queues
            .keys()
            .filter(|(_, l)| l == lane)
            .cloned()
            .collect();
        let mut dropped = 0;
        for key in keys {
            if let Some(queue) = self.queues.remove(&key) {
                dropped += queue.len();
            }
        }
        self.len -= dropped;
        self.lane_left(lane, dropped);
        dropped
    }

    /// Drops everything waiting.
    pub fn clear(&mut self) {
        self.queues.clear();
        self.per_lane.clear();
        self.len = 0;
    }

    /// Keeps only the items `keep` says to keep (callers that gave up); returns how many left.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) -> usize {
        let mut left = 0;
        for (key, queue) in self.queues.iter_mut() {
            let before = queue.len();
            queue.retain(|(_, item)| keep(item));
            let gone = before - queue.len();
            if gone > 0 {
                left += gone;
                if let Some(count) = self.per_lane.get_mut(&key.1) {
                    *count -= gone;
                }
            }
        }
        self.queues.retain(|_, queue| !queue.is_empty());
        self.per_lane.retain(|_, n| *n > 0);
        self.len -= left;
        left
    }

    fn lane_left(&mut self, lane: &L, n: usize) {
        if let Some(count) = self.per_lane.get_mut(lane) {
            *count -= n;
            if *count == 0 {
                self.per_lane.remove(lane);
            }
        }
    }

    /// The first `n` items in the order [`FairQueue::pop`] would take them with every lane
    /// open (and nothing arriving meanwhile), without taking them.
    pub fn in_order(&self, n: usize) -> impl Iterator<Item = &T> {
        let mut classes = self.classes.clone();
        let mut virtual_time = self.virtual_time;
        let queues: Vec<(&(C, L), &Fifo<T>)> = self.queues.iter().collect();
        let mut cursor = vec![0usize; queues.len()];
        let mut out = Vec::with_capacity(n.min(self.len));
        while out.len() < n {
            let candidates: Vec<Candidate<C, L>> = queues
                .iter()
                .enumerate()
                .filter_map(|(i, ((class, lane), queue))| {
                    queue.get(cursor[i]).map(|(seq, _)| (i, class, lane, *seq))
                })
                .collect();
            let Some((&(i, ..), tag)) = Self::choose(&classes, virtual_time, &candidates) else {
                break;
            };
            let ((class, lane), queue) = queues[i];
            out.push(&queue[cursor[i]].1);
            cursor[i] += 1;
            virtual_time = tag;
            if let Some(standing) = classes.get_mut(class) {
                standing.finish = tag + UNIT / u64::from(standing.weight);
                standing.last_lane = Some(lane.clone());
            }
        }
        out.into_iter()
    }

    /// Items waiting, in all.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Items waiting in `lane`.
    pub fn len_of(&self, lane: &L) -> usize {
        self.per_lane.get(lane).copied().unwrap_or(0)
    }

    /// Classes with something waiting, each with how many of its items wait.
    pub fn waiting_by_class(&self) -> BTreeMap<C, usize> {
        let mut out = BTreeMap::new();
        for ((class, _), queue) in &self.queues {
            *out.entry(class.clone()).or_default() += queue.len();
        }
        out
    }
}

/// Jain's fairness index of `shares` (each a throughput divided by its weight): 1 when all are
/// equal, 1/n when one takes everything.
pub fn jain_index(shares: &[f64]) -> f64 {
    let n = shares.len() as f64;
    let sum: f64 = shares.iter().sum();
    let squares: f64 = shares.iter().map(|x| x * x).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (n * squares)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn drain(q: &mut FairQueue<&'static str, u8, u32>, n: usize) -> Vec<&'static str> {
        (0..n)
            .filter_map(|_| q.pop(|_| true).map(|(c, _, _)| c))
            .collect()
    }

    #[test]
    fn a_late_class_is_served_next_to_a_burst_not_behind_it() {
        let mut q = FairQueue::new();
        for i in 0..2_000 {
            q.push("a", 0, 1, i);
        }
        // 150 of the burst went before the newcomer arrived.
        assert_eq!(drain(&mut q, 150), vec!["a"; 150]);
        for i in 0..20 {
            q.push("b", 0, 1, i);
        }
        let next = drain(&mut q, 40);
        assert_eq!(next.iter().filter(|c| **c == "b").count(), 20, "{next:?}");
        // Turn by turn: never two of one class in a row while both wait.
        assert!(next.windows(2).all(|w| w[0] != w[1]), "{next:?}");
    }

    #[test]
    fn weights_hold_and_an_idle_class_banks_no_credit() {
        let mut q = FairQueue::new();
        for i in 0..300 {
            q.push("heavy", 0, 3, i);
            q.push("light", 0, 1, i);
        }
        let served = drain(&mut q, 200);
        let heavy = served.iter().filter(|c| **c == "heavy").count();
        assert!(
            (148..=152).contains(&heavy),
            "3:1 of 200 is 150, got {heavy}"
        );

        // "idle" waited for nothing for all of that; it arrives now with a burst of its own and
        // takes turns from here on, not 200 turns in a row.
        for i in 0..100 {
            q.push("idle", 0, 1, i);
        }
        let next = drain(&mut q, 50);
        let idle = next.iter().filter(|c| **c == "idle").count();
        assert!(
            idle <= 11,
            "one turn in five (3 + 1 + 1), got {idle} of 50: {next:?}"
        );
    }

    #[test]
    fn a_closed_lane_holds_back_only_its_own_items_and_each_lane_keeps_its_order() {
        let mut q = FairQueue::new();
        q.push("a", 1, 1, 10);
        q.push("a", 2, 1, 20);
        q.push("a", 1, 1, 11);
        q.push("b", 1, 1, 30);
        assert_eq!(q.pop(|lane| *lane != 1), Some(("a", 2, 20)));
        assert_eq!(q.pop(|lane| *lane != 1), None);
        assert_eq!(q.len_of(&1), 3);
        // "a" has had a turn (in lane 2): "b" goes first, then "a"'s lane 1 in its order.
        assert_eq!(q.pop(|_| true), Some(("b", 1, 30)));
        assert_eq!(q.pop(|_| true), Some(("a", 1, 10)));
        assert_eq!(q.pop(|_| true), Some(("a", 1, 11)));
        assert!(q.is_empty());
    }

    #[test]
    fn dropping_a_lane_and_giving_up_keep_the_counts() {
        let mut q = FairQueue::new();
        for i in 0..5 {
            q.push("a", 1, 1, i);
            q.push("b", 2, 1, 100 + i);
        }
        assert_eq!(q.drop_lane(&1), 5);
        assert_eq!((q.len(), q.len_of(&1), q.len_of(&2)), (5, 0, 5));
        assert_eq!(q.retain(|item| item % 2 == 0), 2);
        assert_eq!(q.len(), 3);
        let left: Vec<u32> = std::iter::from_fn(|| q.pop(|_| true).map(|(_, _, i)| i)).collect();
        assert_eq!(left, vec![100, 102, 104]);
        assert!(q.waiting_by_class().is_empty());
    }

    #[test]
    fn a_newcomer_in_a_lane_that_was_full_gets_that_lanes_next_turn() {
        // The burst fills lanes 1 and 2; lane 1 is full for a long while (its window holds
        // calls that wait), lane 2 goes on. When lane 1 frees a slot, the newcomer behind the
        // burst in lane 1 takes it, although the burst's items there came long before.
        let mut q = FairQueue::new();
        for i in 0..200 {
            q.push("a", 1 + (i % 2) as u8, 1, i);
        }
        for _ in 0..80 {
            q.pop(|lane| *lane == 2).unwrap();
        }
        q.push("b", 1, 1, 1_000);
        q.push("b", 1, 1, 1_001);
        assert_eq!(q.pop(|lane| *lane == 1), Some(("b", 1, 1_000)));
        assert_eq!(q.pop(|lane| *lane == 1).map(|(c, _, _)| c), Some("a"));
        assert_eq!(q.pop(|lane| *lane == 1), Some(("b", 1, 1_001)));
    }

    #[test]
    fn one_class_takes_its_lanes_in_turn() {
        // Its items came lane after lane; they go lane by lane in turn, so every lane's slots
        // free evenly.
        let mut q = FairQueue::new();
        for lane in 0..3u8 {
            for i in 0..3 {
                q.push("a", lane, 1, u32::from(lane) * 10 + i);
            }
        }
        let order: Vec<u32> = std::iter::from_fn(|| q.pop(|_| true).map(|(_, _, i)| i)).collect();
        assert_eq!(order, vec![0, 10, 20, 1, 11, 21, 2, 12, 22]);
    }

    #[test]
    fn in_order_shows_what_pop_would_take() {
        let mut q = FairQueue::new();
        for i in 0..6 {
            q.push("a", i % 2, 1, i);
        }
        for i in 10..13 {
            q.push("b", 0, 2, i);
        }
        let shown: Vec<u32> = q.in_order(100).copied().collect();
        let taken: Vec<u32> = std::iter::from_fn(|| q.pop(|_| true).map(|(_, _, i)| i)).collect();
        assert_eq!(shown, taken);
        assert_eq!(shown.len(), 9);
    }

    #[test]
    fn jain_is_one_for_equal_shares_and_one_over_n_for_one_taker() {
        assert!((jain_index(&[5.0, 5.0, 5.0]) - 1.0).abs() < 1e-9);
        assert!((jain_index(&[9.0, 0.0, 0.0]) - 1.0 / 3.0).abs() < 1e-9);
    }

    proptest! {
        /// While every class waits, over any stretch of consecutive grants each class's count
        /// stays within one turn of its weighted share (no class starves, weights hold), and
        /// items of one class and lane leave in the order they came.
        #[test]
        fn while_all_wait_every_stretch_of_grants_follows_the_weights(
            weights in proptest::collection::vec(1u32..6, 2..6),
            lanes in proptest::collection::vec(0u8..3, 50..400),
            skew in proptest::collection::vec(0usize..6, 0..200),
        ) {
            let mut q: FairQueue<usize, u8, (usize, u32)> = FairQueue::new();
            // Skewed arrivals first, so classes arrive with very different backlogs.
            let mut seq = vec![0u32; weights.len()];
            for s in &skew {
                let class = s % weights.len();
                q.push(class, lanes[seq[class] as usize % lanes.len()], weights[class], (class, seq[class]));
                seq[class] += 1;
            }
            // Then enough of every class that all stay backlogged while we watch.
            for (class, weight) in weights.iter().enumerate() {
                for _ in 0..(lanes.len() as u32 * weight) {
                    q.push(class, lanes[seq[class] as usize % lanes.len()], *weight, (class, seq[class]));
                    seq[class] += 1;
                }
            }
            let total: u32 = weights.iter().sum();
            let mut last_seen: HashMap<(usize, u8), u32> = HashMap::new();
            let mut served = Vec::new();
            // Watch only while every class is backlogged.
            while q.waiting_by_class().len() == weights.len() {
                let (class, lane, (c, n)) = q.pop(|_| true).unwrap();
                prop_assert_eq!(class, c);
                if let Some(prev) = last_seen.insert((class, lane), n) {
                    prop_assert!(prev < n, "class {} lane {} out of order", class, lane);
                }
                served.push(class);
            }
            // Skip the catch-up of the skewed start: from the first stretch where every class
            // has been served once, every window follows the weights.
            let warm = served
                .iter()
                .enumerate()
                .scan(std::collections::HashSet::new(), |seen, (i, c)| {
                    seen.insert(*c);
                    Some((i, seen.len()))
                })
                .find(|(_, n)| *n == weights.len())
                .map(|(i, _)| i + 1)
                .unwrap_or(served.len());
            let steady = &served[warm..];
            let len = total as usize * 4;
            for window in steady.windows(len.min(steady.len()).max(1)) {
                for (class, weight) in weights.iter().enumerate() {
                    let got = window.iter().filter(|c| **c == class).count() as f64;
                    let share = window.len() as f64 * f64::from(*weight) / f64::from(total);
                    prop_assert!(
                        (got - share).abs() <= f64::from(*weight) + 1.0,
                        "class {} got {} of {} where its share is {}", class, got, window.len(), share
                    );
                }
            }
        }
    }
}
