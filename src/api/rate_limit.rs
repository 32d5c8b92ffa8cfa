//! A token bucket per caller (governor's GCRA): `api.rate_limit_per_second` requests a second
//! on average, bursts of `api.rate_limit_burst`, one bucket per API key and one per end user.
//! Checked once the caller is authenticated, so only real keys and tokens get a bucket. Each
//! API process keeps its own buckets.
//!
//! The buckets are swept ([`KeyLimiter::sweep`], every [`SWEEP_INTERVAL`] by
//! [`sweep_until`], which the API's server runs beside its accept loop): a bucket that has
//! filled up again is indistinguishable from a new one, so dropping it changes no answer,
//! and the map holds only the callers of the last interval, not every end user ever seen.
//! A map bounded by count (an LRU) was the other choice; under load it would evict the
//! buckets of callers still over their rate and so let them through, where the sweep never
//! forgets a bucket that still limits anyone.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::middleware::StateInformationMiddleware;
use governor::state::keyed::DashMapStateStore;
use governor::{Quota, RateLimiter};
use tokio_util::sync::CancellationToken;

use super::settings::ApiSettings;

/// How often the buckets are swept. Memory is bounded by the distinct callers of one
/// interval (about 100 bytes each); a sweep of 100,000 buckets takes a few milliseconds,
/// each shard of the map locked in turn.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// governor's keyed limiter over `clock`: one bucket per caller, in a sharded map; a request
/// let through learns what is left of its bucket.
type Buckets<C> = RateLimiter<String, DashMapStateStore<String>, C, StateInformationMiddleware>;

/// Where a caller stands with its bucket after a request, for the `RateLimit` and
/// `RateLimit-Policy` headers (the IETF draft): `remaining` requests it may send at once now,
/// and `reset` seconds until its bucket is full again (or, refused, until a request is let
/// through).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    pub remaining: u32,
    pub reset_seconds: u64,
}

/// Where the caller of one request stands with its bucket: written by the authentication
/// (which knows the caller), read by the layer that writes the response's `RateLimit`
/// headers ([`super::routes`]). A request that names no caller leaves it empty.
#[derive(Debug, Clone, Default)]
pub struct Note(std::sync::Arc<std::sync::Mutex<Option<Standing>>>);

impl Note {
    pub fn set(&self, standing: Standing) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(standing);
    }

    pub fn take(&self) -> Option<Standing> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// The buckets, or none when the limit is off. Generic over the clock so tests can move time.
pub struct KeyLimiter<C: Clock = DefaultClock> {
    limiter: Option<Buckets<C>>,
    clock: C,
    rate: u32,
    burst: u32,
}

impl KeyLimiter {
    pub fn new(settings: &ApiSettings) -> Self {
        Self::with_clock(settings, DefaultClock::default())
    }
}

impl<C: Clock + Clone> KeyLimiter<C> {
    pub fn with_clock(settings: &ApiSettings, clock: C) -> Self {
        let limiter = NonZeroU32::new(settings.rate_limit_per_second).map(|rate| {
            // Validated: a burst of at least 1 while the limit is on.
            let burst = NonZeroU32::new(settings.rate_limit_burst).unwrap_or(NonZeroU32::MIN);
            RateLimiter::dashmap_with_clock(
                Quota::per_second(rate).allow_burst(burst),
                clock.clone(),
            )
            .with_middleware::<StateInformationMiddleware>()
        });
        Self {
            limiter,
            clock,
            rate: settings.rate_limit_per_second,
            burst: settings.rate_limit_burst,
        }
    }

    /// The policy every caller's bucket follows, as `RateLimit-Policy` says it: `q` requests
    /// in a window of `w` seconds (a full bucket, and how long an empty one takes to fill);
    /// none when the limit is off.
    pub fn policy(&self) -> Option<String> {
        self.limiter.as_ref()?;
        let window = u64::from(self.burst).div_ceil(u64::from(self.rate.max(1)));
        Some(format!("\"caller\";q={};w={}", self.burst, window.max(1)))
    }

    /// Takes a token of `key_id`'s bucket: where the caller stands then, or, when it is
    /// empty, how long until a token is back. None when the limit is off.
    pub fn check(&self, key_id: &str) -> Result<Option<Standing>, Duration> {
        let Some(limiter) = &self.limiter else {
            return Ok(None);
        };
        match limiter.check_key(&key_id.to_owned()) {
            Ok(snapshot) => {
                let remaining = snapshot.remaining_burst_capacity();
                let missing = u64::from(self.burst.saturating_sub(remaining));
                Ok(Some(Standing {
                    remaining,
                    reset_seconds: missing.div_ceil(u64::from(self.rate.max(1))),
                }))
            }
            Err(not_until) => Err(not_until.wait_time_from(self.clock.now())),
        }
    }

    /// Buckets held now.
    pub fn len(&self) -> usize {
        self.limiter.as_ref().map_or(0, RateLimiter::len)
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every bucket that has filled up again (its caller may send a whole burst, as a
    /// caller never seen may) and gives the map's spare room back; the buckets left.
    pub fn sweep(&self) -> usize {
        let Some(limiter) = &self.limiter else {
            return 0;
        };
        limiter.retain_recent();
        limiter.shrink_to_fit();
        limiter.len()
    }
}

/// Sweeps `limiter` every [`SWEEP_INTERVAL`] until `shutdown`.
pub async fn sweep_until(limiter: std::sync::Arc<KeyLimiter>, shutdown: CancellationToken) {
    let mut ticks = tokio::time::interval(SWEEP_INTERVAL);
    // A sweep that falls behind (a stalled runtime) is not made up in a burst.
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {
                let left = limiter.sweep();
                tracing::debug!(buckets = left, "rate-limit buckets swept");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use governor::clock::FakeRelativeClock;

    fn settings(rate: u32, burst: u32) -> ApiSettings {
        ApiSettings {
            rate_limit_per_second: rate,
            rate_limit_burst: burst,
            ..ApiSettings::default()
        }
    }

    fn limiter(rate: u32, burst: u32) -> KeyLimiter {
        KeyLimiter::new(&settings(rate, burst))
    }

    #[test]
    fn a_key_gets_its_burst_then_waits_and_other_keys_are_not_touched() {
        let limiter = limiter(1, 3);
        for left in [2, 1, 0] {
            assert_eq!(
                limiter.check("a"),
                Ok(Some(Standing {
                    remaining: left,
                    reset_seconds: 3 - u64::from(left)
                }))
            );
        }
        assert_eq!(limiter.policy().as_deref(), Some("\"caller\";q=3;w=3"));
        let wait = limiter.check("a").unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
        assert!(
            matches!(limiter.check("b"), Ok(Some(s)) if s.remaining == 2),
            "another key has its own bucket"
        );
    }

    #[test]
    fn a_rate_of_zero_turns_the_limit_off() {
        let limiter = limiter(0, 0);
        for _ in 0..10_000 {
            assert_eq!(limiter.check("a"), Ok(None));
        }
        assert_eq!(limiter.policy(), None);
        assert_eq!((limiter.len(), limiter.sweep()), (0, 0));
    }

    /// 100,000 end users, 10,000 a sweep interval (the clock moved on by the interval after
    /// each wave): the buckets never outnumber one wave's users.
    #[test]
    fn the_buckets_of_a_hundred_thousand_users_are_swept_down_to_those_of_the_last_interval() {
        let clock = FakeRelativeClock::default();
        let limiter = KeyLimiter::with_clock(&settings(200, 400), clock.clone());
        let mut most = 0;
        for wave in 0..10 {
            for user in 0..10_000 {
                assert!(limiter.check(&format!("user:acme:{wave}-{user}")).is_ok());
            }
            most = most.max(limiter.len());
            clock.advance(SWEEP_INTERVAL);
            assert_eq!(
                limiter.sweep(),
                0,
                "wave {wave}: every bucket filled up again"
            );
        }
        assert_eq!(most, 10_000);
        assert!(limiter.is_empty());
    }

    #[test]
    fn a_sweep_keeps_the_bucket_of_a_caller_still_limited() {
        let clock = FakeRelativeClock::default();
        // One token a second, bursts of 3.
        let limiter = KeyLimiter::with_clock(&settings(1, 3), clock.clone());
        for _ in 0..3 {
            assert!(limiter.check("busy").is_ok());
        }
        assert!(limiter.check("busy").is_err());
        assert!(limiter.check("quiet").is_ok());
        // 2.5 s on: the quiet caller's bucket is full again, the busy one's is not.
        clock.advance(Duration::from_millis(2_500));
        assert_eq!(limiter.sweep(), 1, "only the busy caller's bucket stays");
        // It was kept, not made anew: 2 tokens came back, not a whole burst of 3.
        assert!(limiter.check("busy").is_ok());
        assert!(limiter.check("busy").is_ok());
        assert!(limiter.check("busy").is_err());
        for _ in 0..3 {
            assert!(
                limiter.check("quiet").is_ok(),
                "a full burst, as for a new caller"
            );
        }
    }
}
