//! A token bucket per API key (governor's GCRA): `api.rate_limit_per_second` requests a second
//! on average, bursts of `api.rate_limit_burst`. Checked once the key is authenticated, so
//! only real keys get a bucket and the store stays as small as the set of keys in use. Each
//! API process keeps its own buckets.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

use super::settings::ApiSettings;

/// The buckets, or none when the limit is off.
pub struct KeyLimiter {
    limiter: Option<DefaultKeyedRateLimiter<String>>,
    clock: DefaultClock,
}

impl KeyLimiter {
    pub fn new(settings: &ApiSettings) -> Self {
        let limiter = NonZeroU32::new(settings.rate_limit_per_second).map(|rate| {
            // Validated: a burst of at least 1 while the limit is on.
            let burst = NonZeroU32::new(settings.rate_limit_burst).unwrap_or(NonZeroU32::MIN);
            RateLimiter::keyed(Quota::per_second(rate).allow_burst(burst))
        });
        Self {
            limiter,
            clock: DefaultClock::default(),
        }
    }

    /// Takes a token of `key_id`'s bucket; when it is empty, how long until one is back.
    pub fn check(&self, key_id: &str) -> Result<(), Duration> {
        let Some(limiter) = &self.limiter else {
            return Ok(());
        };
        limiter
            .check_key(&key_id.to_owned())
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(rate: u32, burst: u32) -> KeyLimiter {
        KeyLimiter::new(&ApiSettings {
            rate_limit_per_second: rate,
            rate_limit_burst: burst,
            ..ApiSettings::default()
        })
    }

    #[test]
    fn a_key_gets_its_burst_then_waits_and_other_keys_are_not_touched() {
        let limiter = limiter(1, 3);
        for _ in 0..3 {
            assert_eq!(limiter.check("a"), Ok(()));
        }
        let wait = limiter.check("a").unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
        assert_eq!(limiter.check("b"), Ok(()), "another key has its own bucket");
    }

    #[test]
    fn a_rate_of_zero_turns_the_limit_off() {
        let limiter = limiter(0, 0);
        for _ in 0..10_000 {
            assert_eq!(limiter.check("a"), Ok(()));
        }
    }
}
