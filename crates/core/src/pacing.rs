//! The shared capacity budget's arithmetic, pure: when each waiting call may go, and how the
//! limit a deployment learned from the provider moves. No I/O: the SQL function
//! `replyd_capacity_grant` (migration V16) does the same on the model's bucket row, under its
//! lock, and the service's `tests/it/store_functions.rs` holds the two together over
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

/// A limit learned from the provider, where none is configured: the rate the provider reports
/// as its limit (its rate-limit headers), the rate allowed now (None: not limited yet), when
/// that last changed, and what was granted in the current one-second window and the one before
/// (the rate to cut from at a first refusal the provider gave no limit for).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Learned {
    pub reported: Option<f64>,
    pub per_second: Option<f64>,
    pub changed_at: f64,
    pub window_start: f64,
    pub window_granted: u64,
    pub previous_rate: f64,
}

impl Learned {
    pub fn new(now: f64) -> Self {
        Self {
            reported: None,
            per_second: None,
            changed_at: now,
            window_start: now,
            window_granted: 0,
            previous_rate: 0.0,
        }
    }

    /// Counts `granted` requests at `now` into the one-second windows, and regrows a learned
    /// limit by 10 % (at least one request a second) for every second without a refusal, never
    /// past what the provider reports: slowly, so a limit a refusal found is probed again
    /// without a stampede.
    pub fn granted(self, now: f64, granted: u64) -> Self {
        let mut next = self;
        if now >= self.window_start + 1.0 {
            let elapsed = now - self.window_start;
            // A window left long ago says nothing of the current rate.
            next.previous_rate = if elapsed < 2.0 {
                self.window_granted as f64 / elapsed
            } else {
                0.0
            };
            next.window_start = now;
            next.window_granted = 0;
        }
        next.window_granted += granted;
        if let Some(limit) = self.per_second
            && now >= self.changed_at + 1.0
        {
            let grown = limit + (limit * 0.1).max(1.0);
            next.per_second = Some(self.reported.map_or(grown, |r| grown.min(r)));
            next.changed_at = now;
        }
        next
    }

    /// The provider reported its limit (`x-ratelimit-limit-requests`, a minute's worth, as a
    /// rate a second): that is the rate, unless a refusal has cut below it since an earlier
    /// report, in which case it is what the regrowth goes back up to. A first report replaces
    /// whatever was guessed before it: a refusal with no report known cut a rate measured from
    /// nothing, often to the floor.
    pub fn reported(self, now: f64, per_second: f64) -> Self {
        let per_second = per_second.max(MIN_LEARNED_PER_SECOND);
        let below = self.reported.is_some() && self.per_second.is_some_and(|p| p < per_second);
        Self {
            reported: Some(per_second),
            per_second: if below {
                self.per_second
            } else {
                Some(per_second)
            },
            changed_at: if below { self.changed_at } else { now },
            ..self
        }
    }

    /// After the provider refused a call for capacity: the limit is cut, at most once a
    /// second, since one overload answers many calls in flight at once. Pacing at a limit the
    /// provider reported, the refusal is a call that arrived a moment early: cut to 90 %.
    /// Without one, to 70 % of the rate (or, the first time, of the rate being sent).
    pub fn refused(self, now: f64) -> Self {
        if self.per_second.is_some() && now < self.changed_at + 1.0 {
            return self;
        }
        let sending = self.per_second.unwrap_or_else(|| {
            let current = self.window_granted as f64 / (now - self.window_start).max(1.0);
            self.previous_rate.max(current)
        });
        let factor = if self.reported.is_some() { 0.9 } else { 0.7 };
        Self {
            per_second: Some((sending * factor).max(MIN_LEARNED_PER_SECOND)),
            changed_at: now,
            ..self
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

    #[test]
    fn a_learned_limit_falls_on_refusal_once_a_second_and_regrows_slowly() {
        // 120 requests granted over the last second, then a refusal.
        let sending = Learned::new(0.0).granted(0.5, 120).granted(1.0, 0);
        assert!((sending.previous_rate - 120.0).abs() < 1e-9, "{sending:?}");
        let cut = sending.refused(1.1);
        assert!((cut.per_second.unwrap() - 84.0).abs() < 1e-9, "{cut:?}");
        // The other calls of that overload, refused too, do not cut again.
        assert_eq!(cut.refused(1.5), cut);
        let again = cut.refused(2.2);
        assert!(again.per_second.unwrap() < cut.per_second.unwrap());
        // A quiet second regrows it by 10 %.
        let grown = again.granted(3.3, 1);
        assert!(grown.per_second.unwrap() > again.per_second.unwrap());
        assert!(grown.per_second.unwrap() < again.per_second.unwrap() * 1.11);
        // Never below the floor.
        let mut low = Learned::new(0.0).refused(0.0);
        for t in 1..50 {
            low = low.refused(f64::from(t));
        }
        assert!(low.per_second.unwrap() >= MIN_LEARNED_PER_SECOND);
    }

    #[test]
    fn a_reported_limit_is_the_rate_and_the_ceiling_of_the_regrowth() {
        let told = Learned::new(0.0).reported(0.0, 50.0);
        assert_eq!(told.per_second, Some(50.0));
        let cut = told.refused(1.5);
        assert!((cut.per_second.unwrap() - 45.0).abs() < 1e-9, "{cut:?}");
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
    fn a_first_report_replaces_a_rate_guessed_before_it() {
        // A refusal before any report, with nothing granted to measure: the floor.
        let guessed = Learned::new(0.0).refused(0.2);
        assert_eq!(guessed.per_second, Some(MIN_LEARNED_PER_SECOND));
        let told = guessed.reported(0.3, 50.0);
        assert_eq!(told.per_second, Some(50.0));
        assert_eq!(told.changed_at, 0.3);
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
