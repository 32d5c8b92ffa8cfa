//! When a streamed answer's parts go, kept pure: how long its work waits before its text
//! exists (its time to first token), and how far after that first token each delta and the
//! close go. The server sleeps to these offsets; the background responses record to them.
//!
//! By default a stream takes its generation's latency in all, as a hosted model's does:
//! streaming brings the first token earlier, not the end later. The first token comes after
//! [`FIRST_TOKEN_SHARE`] of the latency; the rest is shared evenly among the deltas, each
//! followed by its share, so the close goes at the latency (to the nanosecond the division
//! loses) whatever the reply's length. A whole answer and a streamed one of the same latency
//! then hold a call, a concurrency place and a window slot equally long, which is what the
//! benchmarks' ideals (window ÷ latency) assume.
//!
//! A fixed interval between deltas (`stream_chunk_interval_ms`) is the other model: a writer
//! of a fixed speed, for scenarios that need a long stream after a short wait. The latency is
//! then the time to the first delta, each later delta an interval after the one before, and
//! the close goes with the last delta, so the stream grows with its reply.

use std::time::Duration;

/// The share of a streamed generation's latency that comes before its first token, unless
/// the deltas go at a fixed interval. Hosted chat models take some hundreds of milliseconds
/// to their first token and some seconds in all; a quarter keeps the first delta clearly
/// ahead of the end at any latency.
pub const FIRST_TOKEN_SHARE: f64 = 0.25;

/// How a stream's deltas are spread in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamPacing {
    /// The whole stream takes the latency: the first token after [`FIRST_TOKEN_SHARE`] of it,
    /// the deltas evenly over the rest.
    OverLatency,
    /// The first token after the whole latency, then this pause before each later delta.
    FixedInterval(Duration),
}

impl StreamPacing {
    /// The pacing the settings' `stream_chunk_interval_ms` asks for: a fixed interval when
    /// set, the latency shared among the deltas when not.
    pub fn from_interval_ms(interval_ms: Option<u64>) -> Self {
        match interval_ms {
            Some(ms) => StreamPacing::FixedInterval(Duration::from_millis(ms)),
            None => StreamPacing::OverLatency,
        }
    }

    /// How long a streamed generation of `latency` takes before its text exists: what its
    /// work waits before the first event. A whole answer waits the whole latency instead.
    pub fn first_token(self, latency: Duration) -> Duration {
        match self {
            StreamPacing::OverLatency => latency.mul_f64(FIRST_TOKEN_SHARE),
            StreamPacing::FixedInterval(_) => latency,
        }
    }

    /// The pace, after its first token, of a streamed generation of `latency` whose text is
    /// `deltas` pieces. `deltas` is the whole text's, even when a fault sends fewer: the
    /// generation's speed does not change because its answer breaks.
    pub fn pace(self, latency: Duration, deltas: usize) -> Pace {
        match self {
            StreamPacing::OverLatency => {
                let rest = latency.saturating_sub(self.first_token(latency));
                // An empty text still closes at the latency: its one share is the close's.
                let gap = rest / u32::try_from(deltas.max(1)).unwrap_or(u32::MAX);
                Pace { gap, closing: gap }
            }
            StreamPacing::FixedInterval(interval) => Pace {
                gap: interval,
                closing: Duration::ZERO,
            },
        }
    }
}

/// Offsets from a stream's first token (when its work produced its text, and its first
/// events go).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    /// Between two deltas.
    gap: Duration,
    /// Between the last delta sent and what closes the stream (its tail, an error event, a
    /// background response's end).
    closing: Duration,
}

impl Pace {
    /// When delta `n` (from 0) goes, after the first token.
    pub fn delta_offset(&self, n: usize) -> Duration {
        self.gap
            .saturating_mul(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// When the stream's close goes, after the first token, `sent` deltas having gone: the
    /// last one's offset and the closing pause. A stream error after `sent` deltas thus comes
    /// when the next delta would have.
    pub fn tail_offset(&self, sent: usize) -> Duration {
        match sent.checked_sub(1) {
            Some(last) => self.delta_offset(last) + self.closing,
            None => self.closing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn a_stream_over_its_latency_starts_at_a_quarter_and_closes_at_the_latency() {
        let pacing = StreamPacing::OverLatency;
        assert_eq!(pacing.first_token(ms(400)), ms(100));
        // 300 ms after the first token, shared among three deltas and the close.
        let pace = pacing.pace(ms(400), 3);
        let offsets: Vec<Duration> = (0..3).map(|n| pace.delta_offset(n)).collect();
        assert_eq!(offsets, [ms(0), ms(100), ms(200)]);
        assert_eq!(pace.tail_offset(3), ms(300));
        // An error event after one delta goes where the second delta would have.
        assert_eq!(pace.tail_offset(1), ms(100));
    }

    #[test]
    fn an_empty_text_still_closes_at_the_latency() {
        let pacing = StreamPacing::OverLatency;
        let pace = pacing.pace(ms(400), 0);
        assert_eq!(pacing.first_token(ms(400)) + pace.tail_offset(0), ms(400));
    }

    #[test]
    fn no_latency_is_no_wait_at_all() {
        let pacing = StreamPacing::OverLatency;
        let pace = pacing.pace(Duration::ZERO, 40);
        assert_eq!(pacing.first_token(Duration::ZERO), Duration::ZERO);
        assert_eq!(pace.delta_offset(39), Duration::ZERO);
        assert_eq!(pace.tail_offset(40), Duration::ZERO);
    }

    #[test]
    fn a_fixed_interval_waits_the_latency_then_an_interval_per_delta_and_closes_with_the_last() {
        let pacing = StreamPacing::from_interval_ms(Some(20));
        assert_eq!(pacing, StreamPacing::FixedInterval(ms(20)));
        assert_eq!(pacing.first_token(ms(300)), ms(300));
        let pace = pacing.pace(ms(300), 10);
        assert_eq!(pace.delta_offset(0), Duration::ZERO);
        assert_eq!(pace.delta_offset(9), ms(180));
        assert_eq!(
            pace.tail_offset(10),
            ms(180),
            "the close goes with the last delta"
        );
        assert_eq!(pace.tail_offset(0), Duration::ZERO);
        assert_eq!(
            StreamPacing::from_interval_ms(None),
            StreamPacing::OverLatency
        );
    }

    proptest! {
        /// Whatever the latency and the length, the first token comes at most a quarter in,
        /// the deltas go in order and never after the close, and the close is the latency,
        /// short by no more than the nanoseconds the division drops.
        #[test]
        fn a_stream_over_its_latency_ends_at_the_latency(
            latency_ms in 0u64..600_000,
            deltas in 0usize..5_000,
        ) {
            let latency = ms(latency_ms);
            let pacing = StreamPacing::OverLatency;
            let first = pacing.first_token(latency);
            let pace = pacing.pace(latency, deltas);
            prop_assert!(first.abs_diff(latency / 4) <= Duration::from_nanos(1), "{first:?}");
            let end = first + pace.tail_offset(deltas);
            prop_assert!(end <= latency, "{end:?} after {latency:?}");
            let lost = Duration::from_nanos(deltas.max(1) as u64);
            prop_assert!(end + lost >= latency, "{end:?} well before {latency:?}");
            for n in 1..deltas {
                prop_assert!(pace.delta_offset(n - 1) <= pace.delta_offset(n));
            }
            if let Some(last) = deltas.checked_sub(1) {
                prop_assert!(pace.delta_offset(last) <= pace.tail_offset(deltas));
            }
        }
    }
}
