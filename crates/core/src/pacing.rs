//! The shared capacity budget's arithmetic, pure: when each waiting call may go, and how the
//! limit a deployment learned from the provider moves. No I/O: the SQL functions `replyd_pace`
//! (migration V16) and `replyd_capacity_learned_*` (V31), called by `replyd_capacity_grant` and
//! `_refused`, do the same on the model's bucket row, under its lock, and the service's
//! `tests/it/store_functions/` (`capacity.rs`, `learned_rate.rs`) holds the two together over
//! generated inputs.
//!
//! Calls are paced, not burst: a limit of `L` requests a second sends one every `1/L` seconds
//! (GCRA's virtual scheduling with no burst tolerance: `tat`, the theoretical arrival time of
//! the next unit, is all the state). Hosted LLM APIs enforce their per-minute limits to the
//! second, over a sliding window, so a paced deployment is never over in any second, where a
//! bucket that let a second's worth go at once could be over by a whole second's worth.
//! Tokens are paced the same way, each call taking its tokens' share of time (`tokens / L`)
//! from when it goes. A worker takes its schedule ahead, for at most [`HORIZON_SECONDS`]: the
//! send time of each of its waiting calls, in order.

/// How far ahead one grant schedules calls: past it, a worker asks again (and another worker
/// may be served first).
pub const HORIZON_SECONDS: f64 = 0.25;

/// The share of a limit kept free for the time between a call's send and its arrival. The
/// provider counts arrivals over a sliding second, and calls sent exactly `1/L` apart reach it
/// a little bunched (the network, a busy scheduler): `L + 1` of them then land inside one
/// second and the last is refused, without doing work but after taking its place in the
/// schedule. Paced at `L × (1 − 0.02)`, any `L + 1` sends span `1/0.98` s, so arrivals may
/// bunch by 20 ms, at any rate, before one second holds more than `L`.
pub const ARRIVAL_HEADROOM: f64 = 0.02;

/// The rate a configured limit of `per_second` is paced at: [`ARRIVAL_HEADROOM`] below it. (A
/// limit the provider reports is paced as reported: the learned rate's own cuts and regrowth
/// find its headroom.)
pub fn paced(per_second: f64) -> f64 {
    per_second * (1.0 - ARRIVAL_HEADROOM)
}

/// The bucket's schedules and limits as one grant reads them. A `None` limit is no limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    pub requests_tat: Option<f64>,
    pub tokens_tat: Option<f64>,
    /// Requests a second.
    pub requests_per_second: Option<f64>,
    /// Tokens a second.
    pub tokens_per_second: Option<f64>,
}

/// What one grant decided: when each granted call goes, and the schedules after them.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// Seconds from now until each granted call may go, in the waiters' order; the first
    /// `delays.len()` waiters are granted.
    pub delays: Vec<f64>,
    pub requests_tat: Option<f64>,
    pub tokens_tat: Option<f64>,
    /// When nothing was granted: seconds until the first waiter could be.
    pub wait: f64,
}

/// Schedules `waiters` (each a call's tokens, in arrival order) at `now`: each goes when both
/// its request and its tokens are due, and no call is scheduled past `now + HORIZON_SECONDS`.
/// Each schedule then moves on from when its call goes, so consecutive calls are at least
/// `1/requests_per_second` apart, and a call of `t` tokens is followed by `t / tokens_per_second`
/// of no other call's tokens.
pub fn schedule(budget: Budget, now: f64, waiters: &[u64]) -> Schedule {
    let mut requests_tat = budget.requests_tat;
    let mut tokens_tat = budget.tokens_tat;
    let mut delays = Vec::new();
    let mut wait = 0.0;
    for &tokens in waiters {
        let due = |tat: Option<f64>, rate: Option<f64>| match rate {
            Some(_) => tat.map_or(now, |tat| tat.max(now)),
            None => now,
        };
        let at = due(requests_tat, budget.requests_per_second)
            .max(due(tokens_tat, budget.tokens_per_second));
        if at > now + HORIZON_SECONDS {
            if delays.is_empty() {
                wait = at - HORIZON_SECONDS - now;
            }
            break;
        }
        if let Some(rate) = budget.requests_per_second {
            requests_tat = Some(at + 1.0 / rate);
        }
        if let Some(rate) = budget.tokens_per_second {
            tokens_tat = Some(at + tokens as f64 / rate);
        }
        delays.push(at - now);
    }
    Schedule {
        delays,
        requests_tat,
        tokens_tat,
        wait,
    }
}

/// The smallest rate a learned limit falls to, requests a second.
pub const MIN_LEARNED_PER_SECOND: f64 = 0.5;

/// The share of what got through in the last second that a refusal with no reported limit
/// cuts to. What got through is the provider's limit as it stands (it took that many and
/// refused the rest); a little below it leaves room for calls that reach it bunched.
pub const CUT_TO_THROUGH: f64 = 0.95;

/// The share of a reported limit's rate that a refusal cuts to: pacing at the report, a refusal
/// is a call that arrived a moment early.
pub const CUT_REPORTED: f64 = 0.9;

/// The calls that went and the calls refused, counted in one-second windows: the current one,
/// and the rates of the one before, from which the last second's counts are estimated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub start: f64,
    /// Calls that went in this window: granted, or let go freely by a worker.
    pub granted: u64,
    /// Calls the provider refused for capacity in this window.
    pub refused: u64,
    /// Calls that went, and calls refused, a second in the window before this one.
    pub previous_granted_rate: f64,
    pub previous_refused_rate: f64,
}

impl Window {
    pub fn new(now: f64) -> Self {
        Self {
            start: now,
            granted: 0,
            refused: 0,
            previous_granted_rate: 0.0,
            previous_refused_rate: 0.0,
        }
    }

    /// At `now`: a window a second old or more becomes the previous one, as rates.
    pub fn rolled(self, now: f64) -> Self {
        if now < self.start + 1.0 {
            return self;
        }
        let elapsed = now - self.start;
        // A window left long ago says nothing of the current rate.
        let rate = |count: u64| {
            if elapsed < 2.0 {
                count as f64 / elapsed
            } else {
                0.0
            }
        };
        Self {
            start: now,
            granted: 0,
            refused: 0,
            previous_granted_rate: rate(self.granted),
            previous_refused_rate: rate(self.refused),
        }
    }

    /// Calls that went and calls refused in the second before `now`, in a window rolled at
    /// `now`: this window's, and the previous one's at its rate over the part of the second
    /// before this one began.
    pub fn last_second(&self, now: f64) -> (f64, f64) {
        let before = (1.0 - (now - self.start)).clamp(0.0, 1.0);
        (
            self.granted as f64 + self.previous_granted_rate * before,
            self.refused as f64 + self.previous_refused_rate * before,
        )
    }
}

/// A limit learned from the provider, where none is configured: the rate the provider reports
/// as its limit (its rate-limit headers), the rate allowed now (None: not limited yet), and
/// what it moves from.
///
/// Without a report, a refusal cuts the rate to [`CUT_TO_THROUGH`] of what got through in the
/// last second (the calls that went less those refused), at most once a second after the
/// previous cut; every second without a refusal then doubles it back towards what got through
/// before that cut, and past it probes up by 10 % (at least one request a second). The
/// provider took what got through, so the rate goes back there at once; a cut from a fixed
/// share of the rate instead (70 %, earlier) fell at every overload and took half a minute to
/// climb back at 10 % a second, and the deployment worked at about 60 % of the limit. With a
/// report, the report is the rate and the ceiling: a refusal cuts it to [`CUT_REPORTED`] of
/// it, and it regrows the same way, never past the report.
///
/// Every call that went counts, those a worker let go freely while nothing was known too (it
/// tells them with its next grant or refusal, [`Learned::sent`]): the first refusal then cuts
/// from what was sent, not from nothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Learned {
    pub reported: Option<f64>,
    pub per_second: Option<f64>,
    /// When `per_second` last moved (a cut, a regrowth step, a report): regrowth steps are a
    /// second apart.
    pub changed_at: f64,
    /// When a cut (or a report) last set the rate: cuts are a second apart however it regrew
    /// since, as one overload answers many calls in flight at once. Were regrowth to move it
    /// too, a rate regrown every second would never be cut again.
    pub cut_at: f64,
    /// The last refusal: regrowth waits for a whole second without one.
    pub refused_at: f64,
    /// What got through in the second before the last cut, at most the rate then: regrowth
    /// doubles back up to it before it probes. 0: nothing known.
    pub good_per_second: f64,
    pub window: Window,
}

impl Learned {
    pub fn new(now: f64) -> Self {
        Self {
            reported: None,
            per_second: None,
            changed_at: now,
            cut_at: now,
            refused_at: now,
            good_per_second: 0.0,
            window: Window::new(now),
        }
    }

    /// Counts `calls` that went at `now` (granted, or let go freely) into the windows.
    pub fn sent(self, now: f64, calls: u64) -> Self {
        let mut window = self.window.rolled(now);
        window.granted += calls;
        Self { window, ..self }
    }

    /// Counts `granted` calls at `now` into the windows, and, a second after the rate last
    /// moved and a second after the last refusal, regrows a learned rate: doubled, up to what
    /// got through before the last cut (the provider took that much then), and past it by
    /// 10 % (at least one request a second) to probe for more; never past what the provider
    /// reports.
    pub fn granted(self, now: f64, granted: u64) -> Self {
        let next = self.sent(now, granted);
        let Some(rate) = self.per_second else {
            return next;
        };
        if now < self.changed_at + 1.0 || now < self.refused_at + 1.0 {
            return next;
        }
        let ceiling = self.reported.unwrap_or(f64::INFINITY);
        let back_to = self.good_per_second.min(ceiling);
        let grown = if rate < back_to {
            (rate * 2.0).min(back_to)
        } else {
            (rate + (rate * 0.1).max(1.0)).min(ceiling)
        };
        Self {
            per_second: Some(grown),
            changed_at: now,
            ..next
        }
    }

    /// The provider reported its limit (`x-ratelimit-limit-requests`, a minute's worth, as a
    /// rate a second): that is the rate, unless a refusal has cut below it since an earlier
    /// report, in which case it is what the regrowth goes back up to. A first report replaces
    /// whatever was learned before it: the provider knows its limit better than a rate
    /// measured from refusals.
    pub fn reported(self, now: f64, per_second: f64) -> Self {
        let per_second = per_second.max(MIN_LEARNED_PER_SECOND);
        let below = self.reported.is_some() && self.per_second.is_some_and(|p| p < per_second);
        if below {
            return Self {
                reported: Some(per_second),
                ..self
            };
        }
        Self {
            reported: Some(per_second),
            per_second: Some(per_second),
            changed_at: now,
            cut_at: now,
            ..self
        }
    }

    /// After the provider refused a call for capacity at `now`: the refusal is counted, and
    /// the rate is cut, at most once a second after the last cut, since one overload answers
    /// many calls in flight at once. Pacing at a limit the provider reported, to
    /// [`CUT_REPORTED`] of it. Without one, to [`CUT_TO_THROUGH`] of what got through in the
    /// last second, never above the rate it had; what got through is then what regrowth
    /// doubles back to.
    pub fn refused(self, now: f64) -> Self {
        let mut window = self.window.rolled(now);
        window.refused += 1;
        let next = Self {
            window,
            refused_at: now,
            ..self
        };
        if self.per_second.is_some() && now < self.cut_at + 1.0 {
            return next;
        }
        let (went, refused) = window.last_second(now);
        let through = (went - refused).max(0.0);
        let rate = self.per_second.unwrap_or(f64::INFINITY);
        let cut = match (self.reported, self.per_second) {
            (Some(_), Some(rate)) => rate * CUT_REPORTED,
            _ => (through * CUT_TO_THROUGH).min(rate),
        };
        Self {
            per_second: Some(cut.max(MIN_LEARNED_PER_SECOND)),
            changed_at: now,
            cut_at: now,
            good_per_second: through.min(rate),
            ..next
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn budget(rps: Option<f64>, tps: Option<f64>) -> Budget {
        Budget {
            requests_tat: None,
            tokens_tat: None,
            requests_per_second: rps,
            tokens_per_second: tps,
        }
    }

    #[test]
    fn calls_are_paced_at_the_limit_within_the_horizon() {
        // 3,000 a minute: one every 20 ms, 13 within 250 ms (0, 20, …, 240).
        let first = schedule(budget(Some(50.0), None), 100.0, &[10; 40]);
        assert_eq!(first.delays.len(), 13, "{first:?}");
        assert!((first.delays[1] - 0.02).abs() < 1e-9);
        assert!((first.requests_tat.unwrap() - 100.26).abs() < 1e-9);
        // Asked again at once: the schedule goes on where it ended.
        let again = schedule(
            Budget {
                requests_tat: first.requests_tat,
                ..budget(Some(50.0), None)
            },
            100.0,
            &[10; 40],
        );
        assert!(again.delays.is_empty());
        assert!((again.wait - 0.01).abs() < 1e-9, "{again:?}");
    }

    #[test]
    fn a_large_call_takes_its_tokens_share_of_time() {
        // 60,000 tokens a minute: 1,000 a second. A call of 4,000 tokens goes now; the next
        // only after four seconds, past the horizon.
        let s = schedule(budget(None, Some(1_000.0)), 10.0, &[4_000, 10]);
        assert_eq!(s.delays, vec![0.0]);
        assert!((s.tokens_tat.unwrap() - 14.0).abs() < 1e-9);
        assert!((s.wait - 0.0).abs() < 1e-9);
        let next = schedule(
            Budget {
                tokens_tat: s.tokens_tat,
                ..budget(None, Some(1_000.0))
            },
            13.8,
            &[10],
        );
        assert!((next.delays[0] - 0.2).abs() < 1e-9, "{next:?}");
    }

    #[test]
    fn no_limit_lets_every_waiter_go_now() {
        let s = schedule(budget(None, None), 5.0, &[1, 2, 3]);
        assert_eq!(s.delays, vec![0.0, 0.0, 0.0]);
        assert_eq!((s.requests_tat, s.tokens_tat), (None, None));
    }

    fn close(learned: Learned, expected: f64) -> bool {
        learned
            .per_second
            .is_some_and(|rate| (rate - expected).abs() < 1e-9)
    }

    #[test]
    fn a_first_refusal_cuts_from_the_calls_let_go_freely_not_from_nothing() {
        // 100 calls let go freely in the first second, told with the refusal that follows.
        let cut = Learned::new(0.0).sent(0.5, 100).refused(1.0);
        // 99 got through: 95 % of them.
        assert!(close(cut, 99.0 * CUT_TO_THROUGH), "{cut:?}");
        assert_eq!(cut.good_per_second, 99.0);
    }

    #[test]
    fn a_refusal_cuts_to_what_got_through_at_most_once_a_second_after_a_cut() {
        let cut = Learned::new(0.0).sent(0.5, 100).refused(1.0);
        // The same overload's other refusals are counted, and do not cut again.
        let mut overload = cut.granted(1.5, 60);
        for _ in 0..10 {
            overload = overload.refused(1.6);
        }
        assert_eq!(overload.per_second, cut.per_second);
        // A second after the cut: 60 went and 12 were refused in the last second.
        let again = overload.refused(2.0);
        assert!(close(again, 48.0 * CUT_TO_THROUGH), "{again:?}");
        assert_eq!(again.good_per_second, 48.0);
    }

    #[test]
    fn a_rate_regrown_a_moment_ago_is_cut_a_second_after_the_last_cut() {
        let cut = Learned::new(0.0)
            .sent(0.5, 100)
            .refused(1.0)
            .granted(1.5, 60)
            .refused(2.0);
        // A quiet second takes it back to the 58 that got through (60 went, 2 refused).
        let regrown = cut.granted(3.0, 20);
        assert!(close(regrown, 58.0), "{regrown:?}");
        // A refusal 0.2 s later cuts all the same: the last cut was over a second ago. In the
        // last second 20 went, and 1.8 were refused (this window's one, and the previous
        // window's one at its rate over the 0.8 s of it inside the second).
        let again = regrown.refused(3.2);
        assert!(close(again, 18.2 * CUT_TO_THROUGH), "{again:?}");
        // Within a second of that cut, no other.
        assert_eq!(again.refused(3.5).per_second, again.per_second);
    }

    #[test]
    fn quiet_seconds_take_the_rate_back_to_what_got_through_then_probe_by_a_tenth() {
        // 9 got through before the cut, to 8.55.
        let cut = Learned::new(0.0).sent(0.5, 10).refused(1.0);
        assert!(close(cut, 8.55), "{cut:?}");
        // No regrowth within a second of a refusal, even one that did not cut.
        let refused_again = cut.refused(1.5);
        assert_eq!(refused_again.granted(2.2, 1).per_second, cut.per_second);
        // Then, a step a second: back to 9 (doubling, at most to it), then 10 % up, at least
        // one request a second.
        let mut rate = refused_again;
        let mut rates = Vec::new();
        for t in [2.5, 3.0, 3.5, 4.5, 5.5, 6.5] {
            rate = rate.granted(t, 1);
            rates.push(rate.per_second.unwrap());
        }
        let expected = [9.0, 9.0, 10.0, 11.0, 12.1, 13.31];
        for (got, want) in rates.iter().zip(expected) {
            assert!((got - want).abs() < 1e-9, "{rates:?}");
        }
    }

    #[test]
    fn a_learned_rate_never_falls_below_the_floor() {
        let mut low = Learned::new(0.0).refused(0.0);
        for t in 1..50 {
            low = low.refused(f64::from(t));
        }
        assert_eq!(low.per_second, Some(MIN_LEARNED_PER_SECOND));
    }

    #[test]
    fn a_reported_limit_is_the_rate_and_the_ceiling_of_the_regrowth() {
        let told = Learned::new(0.0).reported(0.0, 50.0);
        assert_eq!(told.per_second, Some(50.0));
        // A refusal within a second of the report does not cut: the calls in flight were sent
        // before it.
        assert_eq!(told.refused(0.5).per_second, Some(50.0));
        // A refusal cuts it by 10 %, whatever got through.
        let cut = told.refused(1.5);
        assert!(close(cut, 50.0 * CUT_REPORTED), "{cut:?}");
        // Told again: it stays cut, and regrows towards the report, never past it.
        let again = cut.reported(1.6, 50.0);
        assert_eq!(again.per_second, cut.per_second);
        let mut grown = again;
        for t in 1..20 {
            grown = grown.granted(f64::from(t) + 0.5, 1);
        }
        assert_eq!(grown.per_second, Some(50.0));
    }

    #[test]
    fn a_first_report_replaces_a_rate_learned_before_it() {
        // A refusal before any report, with nothing counted to measure: the floor.
        let guessed = Learned::new(0.0).refused(0.2);
        assert_eq!(guessed.per_second, Some(MIN_LEARNED_PER_SECOND));
        let told = guessed.reported(0.3, 50.0);
        assert_eq!(told.per_second, Some(50.0));
        assert_eq!((told.changed_at, told.cut_at), (0.3, 0.3));
    }

    proptest! {
        /// Whatever the waiters and the timing of the asks, the calls a paced budget sends
        /// are never more than the limit in any one-second window (half open, as a provider's
        /// sliding window counts them), and never more tokens than the limit plus one call's.
        #[test]
        fn no_second_ever_holds_more_than_the_limit(
            per_minute in 60u64..20_000,
            tokens_per_minute in proptest::option::of(6_000u64..2_000_000),
            asks in proptest::collection::vec((0.0f64..0.4, proptest::collection::vec(1u64..3_000, 0..20)), 1..60),
        ) {
            let mut b = budget(Some(per_minute as f64 / 60.0), tokens_per_minute.map(|t| t as f64 / 60.0));
            let mut now = 1_000.0;
            let mut sent: Vec<(f64, u64)> = Vec::new();
            for (dt, waiters) in asks {
                now += dt;
                let s = schedule(b, now, &waiters);
                for (delay, tokens) in s.delays.iter().zip(&waiters) {
                    prop_assert!(*delay >= 0.0 && *delay <= HORIZON_SECONDS + 1e-9);
                    sent.push((now + delay, *tokens));
                }
                b.requests_tat = s.requests_tat;
                b.tokens_tat = s.tokens_tat;
            }
            sent.sort_by(|a, b| a.0.total_cmp(&b.0));
            let limit = per_minute as f64 / 60.0;
            for (i, (from, _)) in sent.iter().enumerate() {
                let window: Vec<_> = sent[i..].iter().take_while(|(at, _)| *at < from + 1.0 - 1e-9).collect();
                prop_assert!(window.len() as f64 <= limit.ceil(), "{} calls in a second, limit {limit}", window.len());
                if let Some(tpm) = tokens_per_minute {
                    let tokens: u64 = window.iter().map(|(_, t)| t).sum();
                    let biggest = window.iter().map(|(_, t)| *t).max().unwrap_or(0);
                    prop_assert!(tokens as f64 <= tpm as f64 / 60.0 + biggest as f64 + 1e-6);
                }
            }
        }

        /// Whatever the calls, refusals and reports, and their timing, a learned rate stays
        /// between the floor and the provider's report, and only a refusal lowers it.
        #[test]
        fn a_learned_rate_stays_between_the_floor_and_the_report(
            steps in proptest::collection::vec((0u32..160, 0u8..4, 0u64..200), 1..80),
        ) {
            let mut learned = Learned::new(0.0);
            let mut now = 0.0;
            for (sixty_fourths, kind, n) in steps {
                now += f64::from(sixty_fourths) / 64.0;
                let before = learned;
                learned = match kind {
                    0 => learned.sent(now, n),
                    1 => learned.granted(now, n),
                    2 => learned.refused(now),
                    _ => learned.reported(now, n as f64 / 4.0),
                };
                if let Some(rate) = learned.per_second {
                    prop_assert!(rate >= MIN_LEARNED_PER_SECOND, "{learned:?}");
                    if let Some(report) = learned.reported {
                        prop_assert!(rate <= report + 1e-9, "{learned:?}");
                    }
                }
                if kind < 2 {
                    prop_assert!(learned.per_second >= before.per_second, "{before:?} -> {learned:?}");
                }
            }
        }

        /// With the headroom, arrivals bunched by up to 20 ms (each call delayed on its way by
        /// anything from 0 to 20 ms) still put no more than the limit in any second.
        #[test]
        fn arrivals_bunched_by_up_to_20_ms_stay_within_the_limit_when_paced_with_headroom(
            per_second in 1u64..400,
            asks in proptest::collection::vec((0.0f64..0.3, 1usize..40), 1..80),
            jitter_seed in any::<u64>(),
        ) {
            let limit = per_second as f64;
            let mut b = budget(Some(paced(limit)), None);
            let mut rng = jitter_seed;
            let mut now = 1_000.0;
            let mut arrived: Vec<f64> = Vec::new();
            for (dt, n) in asks {
                now += dt;
                let s = schedule(b, now, &vec![1; n]);
                for delay in &s.delays {
                    // A small xorshift: the jitter, reproducible from the seed.
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let jitter = (rng % 20_000) as f64 / 1_000_000.0;
                    arrived.push(now + delay + jitter);
                }
                b.requests_tat = s.requests_tat;
            }
            arrived.sort_by(f64::total_cmp);
            for (i, from) in arrived.iter().enumerate() {
                let in_a_second = arrived[i..].iter().take_while(|at| **at < from + 1.0).count();
                prop_assert!(in_a_second as f64 <= limit, "{in_a_second} arrivals in a second, limit {limit}");
            }
        }
    }
}
