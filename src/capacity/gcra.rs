//! The shared capacity budget's arithmetic, pure: how many units (requests, tokens) a bucket
//! grants now, and how the limit a deployment learned from the provider moves. No I/O: the SQL
//! function `replyd_capacity_grant` (migration V16) does the same on the bucket's row, under its
//! lock, and `tests/store_functions.rs` holds the two together over generated inputs.
//!
//! The bucket is a GCRA (generic cell rate algorithm, the "virtual scheduling" form of a token
//! bucket): one number per dimension, `tat`, the theoretical arrival time of the next unit. A
//! rate of `r` units a second spaces units `1/r` apart; a burst of `b` lets `tat` run ahead of
//! now by `(b - 1)/r`. Limits are quantized to the second, as hosted LLM APIs enforce theirs (a
//! 3,000-per-minute limit admits 50 in a second, not 3,000 at once): the burst is one second's
//! worth. Times are seconds since the Unix epoch, by the database clock.

/// A dimension's limit as the bucket applies it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    /// Units a second.
    pub per_second: f64,
    /// Units that may go at once (at least 1).
    pub burst: f64,
}

impl Rate {
    /// A per-minute limit quantized to the second: `per_minute / 60` a second, one second's
    /// worth at once (at least one unit).
    pub fn per_minute(per_minute: u64) -> Self {
        let per_second = per_minute as f64 / 60.0;
        Self {
            per_second,
            burst: per_second.max(1.0),
        }
    }

    /// Seconds between two units.
    fn spacing(self) -> f64 {
        1.0 / self.per_second
    }

    /// How far `tat` may run ahead of now.
    fn tolerance(self) -> f64 {
        (self.burst - 1.0).max(0.0) * self.spacing()
    }
}

/// What one grant decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grant {
    /// Units granted now (at most what was asked).
    pub granted: u64,
    /// The bucket's new `tat`.
    pub tat: f64,
    /// When nothing was granted: seconds until one unit could be.
    pub wait: f64,
}

/// Grants up to `want` units of a bucket at `tat` (None: never used) at `now`.
pub fn grant(tat: Option<f64>, now: f64, want: u64, rate: Rate) -> Grant {
    let start = tat.map_or(now, |tat| tat.max(now));
    if want == 0 {
        return Grant {
            granted: 0,
            tat: start,
            wait: 0.0,
        };
    }
    let spacing = rate.spacing();
    // Unit k (0-based) arrives at start + k·spacing and is allowed while that is at most
    // now + tolerance.
    let room = (now + rate.tolerance() - start) / spacing;
    // A hair of slack: 49.999999 units of room is 50 after the float arithmetic.
    let allowed = if room < -1e-9 {
        0
    } else {
        ((room + 1e-9).floor() as u64).saturating_add(1)
    };
    let granted = allowed.min(want);
    Grant {
        granted,
        tat: start + granted as f64 * spacing,
        wait: if granted == 0 {
            start - rate.tolerance() - now
        } else {
            0.0
        },
    }
}

/// The smallest rate a learned limit falls to, requests a second.
pub const MIN_LEARNED_PER_SECOND: f64 = 0.5;

/// A limit learned from the provider's refusals, where none is configured: the rate it
/// allows (None: not limited yet), when it last changed, and what was granted in the current
/// one-second window and the one before (the rate to cut from at the first refusal).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Learned {
    pub per_second: Option<f64>,
    pub changed_at: f64,
    pub window_start: f64,
    pub window_granted: u64,
    pub previous_rate: f64,
}

impl Learned {
    pub fn new(now: f64) -> Self {
        Self {
            per_second: None,
            changed_at: now,
            window_start: now,
            window_granted: 0,
            previous_rate: 0.0,
        }
    }

    /// Counts `granted` requests at `now` into the one-second windows, and regrows a learned
    /// limit by 5 % (at least half a request a second) for every second without a refusal:
    /// slowly, so a limit a refusal found is probed again without a stampede.
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
            next.per_second = Some(limit + (limit * 0.05).max(0.5));
            next.changed_at = now;
        }
        next
    }

    /// After the provider refused a call for capacity: the limit is cut to 70 % of what it
    /// was (or, the first time, of the rate being sent), at most once a second, since one
    /// overload answers many calls in flight at once.
    pub fn refused(self, now: f64) -> Self {
        if self.per_second.is_some() && now < self.changed_at + 1.0 {
            return self;
        }
        let sending = self.per_second.unwrap_or_else(|| {
            let current = self.window_granted as f64 / (now - self.window_start).max(1.0);
            self.previous_rate.max(current)
        });
        Self {
            per_second: Some((sending * 0.7).max(MIN_LEARNED_PER_SECOND)),
            changed_at: now,
            ..self
        }
    }

    /// The learned limit as a rate the bucket applies, if any.
    pub fn rate(self) -> Option<Rate> {
        self.per_second.map(|per_second| Rate {
            per_second,
            burst: per_second.max(1.0),
        })
    }
}

/// Grants `want` units whole, or none: for one request whose tokens are more than the whole
/// burst (more than a second's worth), which the ordinary grant could never give. It goes once
/// the bucket is at rest (`tat` not after now), and the bucket then owes it: nothing more until
/// the rate has paid it back, so the rate over any longer window still holds.
pub fn grant_whole(tat: Option<f64>, now: f64, want: u64, rate: Rate) -> Grant {
    let start = tat.map_or(now, |tat| tat.max(now));
    if start <= now {
        Grant {
            granted: want,
            tat: start + want as f64 * rate.spacing(),
            wait: 0.0,
        }
    } else {
        Grant {
            granted: 0,
            tat: start,
            wait: start - now,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_fresh_bucket_grants_one_seconds_worth_then_one_unit_per_spacing() {
        let rate = Rate::per_minute(3_000);
        assert_eq!(rate.per_second, 50.0);
        let first = grant(None, 100.0, 80, rate);
        assert_eq!(first.granted, 50, "{first:?}");
        let none = grant(Some(first.tat), 100.0, 1, rate);
        assert_eq!(none.granted, 0);
        assert!((none.wait - 0.02).abs() < 1e-9, "{none:?}");
        // 100 ms later: five more.
        let later = grant(Some(first.tat), 100.1, 10, rate);
        assert_eq!(later.granted, 5, "{later:?}");
    }

    #[test]
    fn one_request_larger_than_a_seconds_tokens_goes_at_rest_and_is_paid_back() {
        let tokens = Rate::per_minute(60_000); // 1,000 a second
        assert_eq!(
            grant(None, 10.0, 4_000, tokens).granted,
            1_000,
            "never more than a burst"
        );
        let big = grant_whole(None, 10.0, 4_000, tokens);
        assert_eq!(big.granted, 4_000);
        // Owed: nothing for about three seconds.
        assert_eq!(grant(Some(big.tat), 12.9, 1, tokens).granted, 0);
        assert!(grant(Some(big.tat), 13.01, 1, tokens).granted >= 1);
        // Not at rest, another whole ask waits until the bucket is.
        let waiting = grant_whole(Some(big.tat), 13.5, 4_000, tokens);
        assert_eq!(waiting.granted, 0);
        assert!((waiting.wait - 0.5).abs() < 1e-9, "{waiting:?}");
        assert_eq!(
            grant_whole(Some(big.tat), 14.0, 4_000, tokens).granted,
            4_000
        );
    }

    #[test]
    fn a_slow_limit_grants_one_at_a_time() {
        let rate = Rate::per_minute(30); // one every two seconds
        let first = grant(None, 0.0, 5, rate);
        assert_eq!(first.granted, 1);
        assert_eq!(grant(Some(first.tat), 1.9, 1, rate).granted, 0);
        assert_eq!(grant(Some(first.tat), 2.0, 1, rate).granted, 1);
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
        // A quiet second regrows it by 5 %.
        let grown = again.granted(3.3, 1);
        assert!(grown.per_second.unwrap() > again.per_second.unwrap());
        assert!(grown.per_second.unwrap() < again.per_second.unwrap() * 1.06);
        // Never below the floor.
        let mut low = Learned::new(0.0).refused(0.0);
        for t in 1..50 {
            low = low.refused(f64::from(t));
        }
        assert!(low.per_second.unwrap() >= MIN_LEARNED_PER_SECOND);
    }

    proptest! {
        /// Whatever the asks and their timing, what a bucket grants in any window of `w`
        /// seconds never exceeds `burst + w · rate`: the limit holds as the provider counts it.
        #[test]
        fn grants_never_exceed_the_rate_in_any_window(
            per_minute in 1u64..20_000,
            steps in proptest::collection::vec((0.0f64..0.5, 1u64..200), 1..80),
        ) {
            let rate = Rate::per_minute(per_minute);
            let (mut tat, mut now) = (None, 1_000.0);
            let mut granted: Vec<(f64, u64)> = Vec::new();
            for (dt, want) in steps {
                now += dt;
                let g = grant(tat, now, want, rate);
                prop_assert!(g.granted <= want);
                tat = Some(g.tat);
                if g.granted > 0 {
                    granted.push((now, g.granted));
                }
            }
            for (i, (from, _)) in granted.iter().enumerate() {
                for window in [0.0, 0.5, 1.0, 3.0] {
                    let sum: u64 = granted[i..]
                        .iter()
                        .take_while(|(at, _)| *at <= from + window)
                        .map(|(_, n)| n)
                        .sum();
                    let bound = rate.burst + window * rate.per_second;
                    prop_assert!(sum as f64 <= bound + 1e-6, "{sum} in {window} s, bound {bound}");
                }
            }
        }

        /// Asked again and again at one instant, a bucket grants exactly its burst (rounded
        /// down), never more: nothing is lost to rounding and nothing is invented.
        #[test]
        fn a_burst_is_granted_whole_and_no_more(per_minute in 60u64..100_000, chunk in 1u64..40) {
            let rate = Rate::per_minute(per_minute);
            let (mut tat, mut total) = (None, 0u64);
            loop {
                let g = grant(tat, 5.0, chunk, rate);
                tat = Some(g.tat);
                total += g.granted;
                if g.granted < chunk {
                    break;
                }
            }
            prop_assert_eq!(total, (rate.burst + 1e-9).floor() as u64);
        }
    }
}
