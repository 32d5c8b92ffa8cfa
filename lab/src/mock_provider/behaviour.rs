//! The mock provider's decisions, kept pure so they can be tested without a server: which fault
//! a request gets, how long its generation takes, and what the reply says (and how long it is,
//! so that a test can have a reply long enough to stream).
//!
//! Randomness comes from [`FaultRng`], a seeded SplitMix64, rather than from a library RNG whose
//! output may change between versions: a chaos run that found a bug must replay the same faults
//! from the same seed after a dependency upgrade.

use std::time::Duration;

use super::settings::FaultSettings;

/// Longest part of the last user message quoted in a reply.
pub const QUOTED_CHARS: usize = 40;

/// Longest reply `[mock:reply_chars=N]` pads to: a typo must not make the mock allocate
/// gigabytes.
pub const MAX_REPLY_CHARS: usize = 1_000_000;

/// The words a padded reply repeats: plain, ASCII, deterministic.
const PADDING_WORDS: [&str; 6] = ["and", "the", "reply", "goes", "on", "streaming"];

/// A small seeded generator (SplitMix64): fast, well mixed, and stable forever by construction.
#[derive(Debug, Clone)]
pub struct FaultRng {
    state: u64,
}

impl FaultRng {
    /// A generator whose draws depend only on `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw from `[0, 1)`.
    pub fn next_unit(&mut self) -> f64 {
        // The top 53 bits fill an f64 mantissa exactly, so every value is equally likely.
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What the mock does to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answer normally.
    None,
    /// Answer `status` at once, without doing the work.
    Error { status: u16 },
    /// Answer 429 with `Retry-After: retry_after_s` at once, without doing the work.
    RateLimit { retry_after_s: u64 },
    /// Wait `hang_ms` before doing anything, so the client times out first.
    Hang { hang_ms: u64 },
    /// Do the work, count it, store it under the key, then break the response (a stream: before
    /// its first event).
    DropAfterWork,
    /// Stream `after_chunks` deltas, then cut the connection. Streamed answers only.
    StreamCut { after_chunks: usize },
    /// Stream `after_chunks` deltas, send nothing for `hang_ms`, then cut the connection.
    /// Streamed answers only.
    StreamStall { after_chunks: usize, hang_ms: u64 },
    /// Stream `after_chunks` deltas, then the API's in-stream error event, of the kind its
    /// dialect gives `status`, then close. Streamed answers only.
    StreamError { after_chunks: usize, status: u16 },
}

impl Fault {
    /// The fault as it strikes an answer that is streamed or sent whole: a stream fault is no
    /// fault for an answer sent whole.
    pub fn for_answer(self, streamed: bool) -> Fault {
        match self {
            Fault::StreamCut { .. } | Fault::StreamStall { .. } | Fault::StreamError { .. }
                if !streamed =>
            {
                Fault::None
            }
            fault => fault,
        }
    }
}

/// Picks the fault for a request from one uniform draw `roll` in `[0, 1)`. The rates are laid
/// end to end on `[0, 1)` in a fixed order (error, rate limit, hang, drop after work, stream
/// cut, stream stall, stream error), so a rate of 1.0 forces its fault and rates of 0 never
/// fire. The stream faults come last, so a run without them draws what it drew before them.
pub fn choose_fault(roll: f64, faults: &FaultSettings) -> Fault {
    let mut bound = 0.0;
    let candidates = [
        (
            faults.error_rate,
            Fault::Error {
                status: faults.error_status,
            },
        ),
        (
            faults.rate_limit_rate,
            Fault::RateLimit {
                retry_after_s: faults.retry_after_s,
            },
        ),
        (
            faults.hang_rate,
            Fault::Hang {
                hang_ms: faults.hang_ms,
            },
        ),
        (faults.drop_after_work_rate, Fault::DropAfterWork),
        (
            faults.stream_cut_rate,
            Fault::StreamCut {
                after_chunks: faults.stream_fault_after_chunks,
            },
        ),
        (
            faults.stream_stall_rate,
            Fault::StreamStall {
                after_chunks: faults.stream_fault_after_chunks,
                hang_ms: faults.hang_ms,
            },
        ),
        (
            faults.stream_error_rate,
            Fault::StreamError {
                after_chunks: faults.stream_fault_after_chunks,
                status: faults.error_status,
            },
        ),
    ];
    for (rate, fault) in candidates {
        bound += rate;
        if rate > 0.0 && roll < bound {
            return fault;
        }
    }
    Fault::None
}

/// A generation's latency: `mean_ms` plus a uniform offset in `[-jitter_ms, +jitter_ms]` chosen
/// by `roll` in `[0, 1)`, never below zero.
pub fn sample_latency(mean_ms: u64, jitter_ms: u64, roll: f64) -> Duration {
    let offset = (roll * 2.0 - 1.0) * jitter_ms as f64;
    let ms = (mean_ms as f64 + offset).max(0.0);
    Duration::from_micros((ms * 1000.0).round() as u64)
}

/// A per-request latency a test writes into the prompt as `[mock:latency_ms=N]`, so one task
/// can be slow while the others are fast. The first directive found wins.
pub fn latency_directive<'a>(contents: impl IntoIterator<Item = &'a str>) -> Option<Duration> {
    directive("[mock:latency_ms=", contents).map(Duration::from_millis)
}

/// A per-request reply length a test writes into the prompt as `[mock:reply_chars=N]`, so a
/// reply is long enough to stream in many deltas; at most [`MAX_REPLY_CHARS`]. The first
/// directive found wins.
pub fn reply_chars_directive<'a>(contents: impl IntoIterator<Item = &'a str>) -> Option<usize> {
    let chars = directive("[mock:reply_chars=", contents)?;
    Some(usize::try_from(chars).map_or(MAX_REPLY_CHARS, |c| c.min(MAX_REPLY_CHARS)))
}

/// The number in the first `TAG` N `]` found in `contents`.
fn directive<'a>(tag: &str, contents: impl IntoIterator<Item = &'a str>) -> Option<u64> {
    contents.into_iter().find_map(|content| {
        let rest = &content[content.find(tag)? + tag.len()..];
        rest[..rest.find(']')?].parse().ok()
    })
}

/// The reply text: deterministic from the key and the prompt, plus the generation number, so a
/// test can tell a replayed reply (same number) from a second generation (a new one). It ends
/// with ` [generation N]`. With `reply_chars` (from [`reply_chars_directive`]) longer than that
/// text, plain words are put before the ` [generation N]` suffix until the reply is exactly
/// `reply_chars` characters long; the start (`reply to KEY: QUOTE`) and the suffix stay.
pub fn reply_text(
    key: Option<&str>,
    last_user_message: Option<&str>,
    generation: u64,
    reply_chars: Option<usize>,
) -> String {
    let quoted: String = last_user_message
        .unwrap_or("")
        .chars()
        .take(QUOTED_CHARS)
        .collect();
    let start = format!("reply to {}: {quoted}", key.unwrap_or("-"));
    let suffix = format!(" [generation {generation}]");
    let bare = start.chars().count() + suffix.chars().count();
    let padding = reply_chars.map_or(0, |chars| chars.saturating_sub(bare));
    format!("{start}{}{suffix}", padding_words(padding))
}

/// `chars` characters of ` and the reply goes on streaming and …`, the last word cut short.
fn padding_words(chars: usize) -> String {
    PADDING_WORDS
        .iter()
        .cycle()
        .flat_map(|word| std::iter::once(' ').chain(word.chars()))
        .take(chars)
        .collect()
}

/// A rough token count (whitespace-separated words), for the `usage` block.
pub fn count_tokens(text: &str) -> u32 {
    u32::try_from(text.split_whitespace().count()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn faults(error: f64, limit: f64, hang: f64, drop: f64) -> FaultSettings {
        FaultSettings {
            error_rate: error,
            rate_limit_rate: limit,
            hang_rate: hang,
            drop_after_work_rate: drop,
            ..FaultSettings::default()
        }
    }

    #[test]
    fn the_same_seed_replays_the_same_draws() {
        let mut a = FaultRng::new(42);
        let mut b = FaultRng::new(42);
        let mut c = FaultRng::new(43);
        let xs: Vec<u64> = (0..16).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..16).map(|_| b.next_u64()).collect();
        let zs: Vec<u64> = (0..16).map(|_| c.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
    }

    #[test]
    fn the_rates_are_laid_end_to_end_in_a_fixed_order() {
        let f = faults(0.1, 0.2, 0.3, 0.4);
        let cases = [
            (0.0, Fault::Error { status: 500 }),
            (0.099, Fault::Error { status: 500 }),
            (0.1, Fault::RateLimit { retry_after_s: 1 }),
            (0.29, Fault::RateLimit { retry_after_s: 1 }),
            (0.31, Fault::Hang { hang_ms: 600_000 }),
            (0.61, Fault::DropAfterWork),
            (0.999, Fault::DropAfterWork),
        ];
        for (roll, expected) in cases {
            assert_eq!(choose_fault(roll, &f), expected, "roll {roll}");
        }
        assert_eq!(choose_fault(0.5, &faults(0.1, 0.0, 0.0, 0.2)), Fault::None);
    }

    #[test]
    fn fault_frequencies_follow_the_rates() {
        let f = faults(0.1, 0.05, 0.0, 0.2);
        let mut rng = FaultRng::new(7);
        let draws = 20_000;
        let mut counts = [0u32; 3];
        for _ in 0..draws {
            match choose_fault(rng.next_unit(), &f) {
                Fault::Error { .. } => counts[0] += 1,
                Fault::RateLimit { .. } => counts[1] += 1,
                Fault::DropAfterWork => counts[2] += 1,
                Fault::None => {}
                fault => panic!("a zero rate fired: {fault:?}"),
            }
        }
        for (count, rate) in counts.iter().zip([0.1, 0.05, 0.2]) {
            let observed = f64::from(*count) / f64::from(draws);
            assert!((observed - rate).abs() < 0.01, "{observed} vs {rate}");
        }
    }

    #[test]
    fn the_reply_quotes_the_start_of_the_last_user_message() {
        let long = "é".repeat(100);
        let text = reply_text(Some("k1"), Some(&long), 3, None);
        assert_eq!(
            text,
            format!("reply to k1: {} [generation 3]", "é".repeat(40))
        );
        assert_eq!(
            reply_text(None, None, 1, None),
            "reply to -:  [generation 1]"
        );
        assert_eq!(count_tokens("a  b\nc"), 3);
    }

    proptest! {
        /// A rate of 1.0 forces its fault whatever the draw; all-zero rates never fire.
        #[test]
        fn certain_and_impossible_faults_do_not_depend_on_the_draw(roll in 0.0f64..1.0) {
            prop_assert_eq!(choose_fault(roll, &faults(0.0, 0.0, 0.0, 1.0)), Fault::DropAfterWork);
            prop_assert_eq!(
                choose_fault(roll, &faults(0.0, 1.0, 0.0, 0.0)),
                Fault::RateLimit { retry_after_s: 1 }
            );
            prop_assert_eq!(choose_fault(roll, &FaultSettings::default()), Fault::None);
        }

        /// Latency stays within mean ± jitter and never goes below zero.
        #[test]
        fn latency_stays_within_its_jitter(mean in 0u64..10_000, jitter in 0u64..10_000,
                                            roll in 0.0f64..1.0) {
            let latency = sample_latency(mean, jitter, roll).as_secs_f64() * 1000.0;
            prop_assert!(latency >= (mean as f64 - jitter as f64).max(0.0) - 0.001);
            prop_assert!(latency <= mean as f64 + jitter as f64 + 0.001);
        }

        /// Every draw is in [0, 1).
        #[test]
        fn unit_draws_are_in_the_half_open_interval(seed in any::<u64>()) {
            let mut rng = FaultRng::new(seed);
            for _ in 0..64 {
                let x = rng.next_unit();
                prop_assert!((0.0..1.0).contains(&x));
            }
        }
    }

    #[test]
    fn a_reply_chars_directive_pads_the_reply_to_exactly_that_many_characters() {
        assert_eq!(
            reply_chars_directive(["hi", "[mock:reply_chars=300] long please"]),
            Some(300)
        );
        assert_eq!(reply_chars_directive(["[mock:reply_chars=-1]"]), None);
        assert_eq!(reply_chars_directive(["[mock:reply_chars=9"]), None);
        assert_eq!(
            reply_chars_directive(["[mock:reply_chars=99999999999]"]),
            Some(MAX_REPLY_CHARS)
        );

        let quote = "é [mock:reply_chars=80]";
        let padded = reply_text(Some("k"), Some(quote), 7, Some(80));
        assert_eq!(padded.chars().count(), 80);
        assert!(padded.starts_with("reply to k: é [mock:reply_chars=80] and the reply"));
        assert!(padded.ends_with(" [generation 7]"), "{padded}");
        assert_eq!(padded, reply_text(Some("k"), Some(quote), 7, Some(80)));

        let bare = reply_text(Some("k"), Some(quote), 7, None);
        assert_eq!(reply_text(Some("k"), Some(quote), 7, Some(3)), bare);
        assert_eq!(
            reply_text(Some("k"), Some(quote), 7, Some(bare.chars().count() + 1)),
            bare.replace(" [generation", "  [generation")
        );
    }

    #[test]
    fn stream_faults_are_drawn_last_and_strike_streamed_answers_only() {
        let f = FaultSettings {
            drop_after_work_rate: 0.25,
            stream_cut_rate: 0.25,
            stream_stall_rate: 0.25,
            stream_error_rate: 0.25,
            stream_fault_after_chunks: 5,
            hang_ms: 9,
            error_status: 529,
            ..FaultSettings::default()
        };
        let cut = Fault::StreamCut { after_chunks: 5 };
        let stall = Fault::StreamStall {
            after_chunks: 5,
            hang_ms: 9,
        };
        let error = Fault::StreamError {
            after_chunks: 5,
            status: 529,
        };
        for (roll, expected) in [
            (0.1, Fault::DropAfterWork),
            (0.3, cut),
            (0.6, stall),
            (0.9, error),
        ] {
            assert_eq!(choose_fault(roll, &f), expected, "roll {roll}");
            assert_eq!(expected.for_answer(true), expected);
        }
        for stream_only in [cut, stall, error] {
            assert_eq!(stream_only.for_answer(false), Fault::None);
        }
        assert_eq!(Fault::DropAfterWork.for_answer(false), Fault::DropAfterWork);
    }

    #[test]
    fn a_latency_directive_in_the_prompt_overrides_the_latency() {
        assert_eq!(
            latency_directive(["hello", "[mock:latency_ms=8000] slow please"]),
            Some(Duration::from_millis(8000))
        );
        assert_eq!(latency_directive(["[mock:latency_ms=abc]", "plain"]), None);
        assert_eq!(latency_directive(["[mock:latency_ms=12"]), None);
    }
}
