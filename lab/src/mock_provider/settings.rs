//! Settings of the mock provider: the real API it imitates (its profile), latency (a whole
//! generation's, streamed or not), the pace of its streams, fault rates, capacity limits,
//! idempotency, the background-responses capability and their retention, seed; and the
//! command-line flags that carry them.
//!
//! What the provider *is* (its profile, its limits, whether it honours keys, whether it has
//! background responses) is fixed at start in [`MockSettings`]; what goes wrong with it
//! ([`FaultSettings`]) can change at run time. The defaults are what the real APIs document:
//! no `Idempotency-Key` is honoured (OpenAI chat completions and Anthropic Messages document
//! none), so a resent request is a second generation unless a test opts in.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Faults injected into chat-completion and messages requests and into background-response
/// creates and polls alike. Replaceable at run time with `PUT /faults`. On a create,
/// `drop_after_work_rate` creates the response and starts its generation, then breaks the
/// answer, so the client never sees the id; on a poll, it loses that poll's answer.
/// Each rate is the share of requests, in `[0, 1]`, that get the fault; together they may not
/// exceed 1. The `stream_*` rates strike streamed answers only, after
/// `stream_fault_after_chunks` deltas; a request answered whole draws them as no fault.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultSettings {
    /// Share of requests answered `error_status` at once, without doing the work.
    pub error_rate: f64,
    /// Status of the injected errors. Default 500.
    pub error_status: u16,
    /// Share of requests answered 429 with `Retry-After: retry_after_s`, without doing the work.
    pub rate_limit_rate: f64,
    /// `Retry-After` of the injected 429s, in seconds. Default 1.
    pub retry_after_s: u64,
    /// Share of requests that wait `hang_ms` before anything else, so the client times out.
    pub hang_rate: f64,
    /// How long a hanging request waits. Default 600000 (ten minutes).
    pub hang_ms: u64,
    /// Share of requests whose work is done, counted and stored under the key, and whose
    /// response is then broken mid-body.
    pub drop_after_work_rate: f64,
    /// Answers leave out their `usage` block, as some OpenAI-compatible servers do (not a
    /// rate: every answer, while set). Chat completions only; a stream then has no usage
    /// chunk.
    pub omit_usage: bool,
    /// Share of streamed answers whose connection is cut (no final chunk, no `[DONE]`, no
    /// `message_stop`) after `stream_fault_after_chunks` deltas. The generation ran and is
    /// counted; a background response goes on to its end, to be resumed.
    pub stream_cut_rate: f64,
    /// Share of streamed answers that send nothing more for `hang_ms` after
    /// `stream_fault_after_chunks` deltas, then are cut.
    pub stream_stall_rate: f64,
    /// Share of streamed answers that send the API's in-stream error event after
    /// `stream_fault_after_chunks` deltas, then close; its kind follows `error_status`. A
    /// background response then fails (`response.failed`).
    pub stream_error_rate: f64,
    /// How many deltas a streamed answer sends before its stream fault strikes (all of them
    /// when it has fewer). Default 3.
    pub stream_fault_after_chunks: usize,
    /// Chat completion and Messages streams end without their final event: no `data: [DONE]`
    /// after the `finish_reason` chunk (and the usage chunk), no `message_stop` after
    /// `message_delta`; the body simply ends, cleanly, as some OpenAI-compatible servers end
    /// it (not a rate: every stream, while set).
    pub stream_without_final_event: bool,
    /// Every streamed event's data goes over two `data:` lines, split after its first comma,
    /// as the SSE spec allows a value to be written (its reader joins the lines with a
    /// newline, and a JSON text stays JSON) (not a rate: every stream, while set).
    pub stream_split_data: bool,
}

impl Default for FaultSettings {
    fn default() -> Self {
        Self {
            error_rate: 0.0,
            error_status: 500,
            rate_limit_rate: 0.0,
            retry_after_s: 1,
            hang_rate: 0.0,
            hang_ms: 600_000,
            drop_after_work_rate: 0.0,
            omit_usage: false,
            stream_cut_rate: 0.0,
            stream_stall_rate: 0.0,
            stream_error_rate: 0.0,
            stream_fault_after_chunks: 3,
            stream_without_final_event: false,
            stream_split_data: false,
        }
    }
}

/// Why fault settings were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidSettings {
    #[error("{name} = {value} is not a rate in [0, 1]")]
    RateOutOfRange { name: &'static str, value: f64 },
    #[error("fault rates add up to {sum}, over 1")]
    RatesOverOne { sum: f64 },
    #[error("error_status {0} is not a 4xx or 5xx status")]
    NotAnErrorStatus(u16),
    #[error(
        "limits.{name} ({flag}) = {value} admits nothing: limits are enforced per second (a 60th of the limit in any second), so it must be at least 60"
    )]
    LimitUnderOnePerSecond {
        name: &'static str,
        flag: &'static str,
        value: u64,
    },
    #[error("limits.concurrent_requests (--limit-concurrent) = 0 admits nothing: at least 1")]
    NoConcurrency,
    #[error("stream_chunk_chars (--stream-chunk-chars) = 0 streams nothing: at least 1")]
    EmptyStreamChunks,
}

impl FaultSettings {
    /// Refuses rates outside `[0, 1]`, rates that add up to more than 1, and an error status
    /// that is not an error.
    pub fn validate(&self) -> Result<(), InvalidSettings> {
        let rates = [
            ("error_rate", self.error_rate),
            ("rate_limit_rate", self.rate_limit_rate),
            ("hang_rate", self.hang_rate),
            ("drop_after_work_rate", self.drop_after_work_rate),
            ("stream_cut_rate", self.stream_cut_rate),
            ("stream_stall_rate", self.stream_stall_rate),
            ("stream_error_rate", self.stream_error_rate),
        ];
        for (name, value) in rates {
            if !(0.0..=1.0).contains(&value) {
                return Err(InvalidSettings::RateOutOfRange { name, value });
            }
        }
        let sum: f64 = rates.iter().map(|(_, rate)| rate).sum();
        // A little slack: 0.1 + 0.2 + 0.7 is not exactly 1 in floating point.
        if sum > 1.0 + 1e-9 {
            return Err(InvalidSettings::RatesOverOne { sum });
        }
        if !(400..=599).contains(&self.error_status) {
            return Err(InvalidSettings::NotAnErrorStatus(self.error_status));
        }
        Ok(())
    }
}

/// The real API whose behaviour the mock imitates where the APIs differ: the body and headers
/// of a refusal over a limit, and how long a background response can be retrieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
pub enum MockProfile {
    /// OpenAI chat completions: no `Idempotency-Key` is documented, so none is honoured;
    /// refusals are OpenAI's (`x-ratelimit-*` headers, a `rate_limit_exceeded` body).
    /// Background responses, when switched on, are kept while the mock runs.
    #[default]
    #[serde(rename = "openai-chat")]
    #[value(name = "openai-chat")]
    OpenAiChat,
    /// OpenAI background responses: an ambiguous create is recovered only by looking the
    /// response up by its id, and only within its retention (`response_retention_ms`, by
    /// default [`OPENAI_RESPONSE_RETENTION_MS`]); after it, `GET /v1/responses/{id}` is 404.
    /// No key honoured; OpenAI's refusals.
    #[serde(rename = "openai-responses")]
    #[value(name = "openai-responses")]
    OpenAiResponses,
    /// Anthropic Messages: no key honoured (none is documented); refusals are Anthropic's
    /// (`anthropic-ratelimit-*` headers with RFC 3339 resets, a `rate_limit_error` body).
    #[serde(rename = "anthropic-messages")]
    #[value(name = "anthropic-messages")]
    AnthropicMessages,
}

/// How long OpenAI keeps a background response retrievable by id when it is not stored: about
/// ten minutes. The default retention of the `openai-responses` profile.
pub const OPENAI_RESPONSE_RETENTION_MS: u64 = 600_000;

impl MockProfile {
    /// The retention of background responses when `response_retention_ms` does not set one:
    /// `None` keeps them while the mock runs.
    pub fn default_response_retention_ms(self) -> Option<u64> {
        match self {
            MockProfile::OpenAiResponses => Some(OPENAI_RESPONSE_RETENTION_MS),
            MockProfile::OpenAiChat | MockProfile::AnthropicMessages => None,
        }
    }

    /// Whose refusals the mock answers: OpenAI's or Anthropic's.
    pub fn refusal_dialect(self) -> RefusalDialect {
        match self {
            MockProfile::OpenAiChat | MockProfile::OpenAiResponses => RefusalDialect::OpenAi,
            MockProfile::AnthropicMessages => RefusalDialect::Anthropic,
        }
    }
}

/// What the mock's answers say of its limits, whatever its profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
pub enum LimitHeaders {
    /// The profile's rate-limit headers on every answer (`x-ratelimit-*` or
    /// `anthropic-ratelimit-*`, each limit and what is left of it), and `retry-after` on a
    /// refusal: what OpenAI and Anthropic send.
    #[default]
    #[serde(rename = "reported")]
    #[value(name = "reported")]
    Reported,
    /// No rate-limit headers: a refusal carries only `retry-after` (whole seconds, rounded up)
    /// and `retry-after-ms` (the wait to the millisecond), as Azure OpenAI deployments and many
    /// gateways answer. A client learns the limit from the refusals alone.
    #[serde(rename = "retry-after-only")]
    #[value(name = "retry-after-only")]
    RetryAfterOnly,
}

/// The shape of a refusal over a limit (see [`crate::mock_provider::capacity`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalDialect {
    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (reset as a duration such as
    /// `20ms` or `6m0s`) and `{"error":{…,"code":"rate_limit_exceeded"}}`.
    OpenAi,
    /// `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}` (reset as an RFC 3339
    /// time) and `{"type":"error","error":{"type":"rate_limit_error",…}}`.
    Anthropic,
}

/// Capacity limits, enforced as OpenAI documents its own: quantized to the second, so a limit
/// of N per minute admits N/60 in any window of one second and a burst over it is refused at
/// once. A request over a limit does no work and is answered 429 at once. Off (`None`) by
/// default: the mock then never runs out of capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitSettings {
    /// Requests per minute (`--limit-rpm`): at most a 60th of it in any second. At least 60.
    pub requests_per_minute: Option<u64>,
    /// Tokens per minute (`--limit-tpm`): at most a 60th of it in any second. A request costs
    /// its prompt's tokens (counted as the usage block counts them: whitespace-separated
    /// words) plus the most it may generate: `max_tokens`, `max_completion_tokens` or
    /// `max_output_tokens`, else [`DEFAULT_MAX_OUTPUT_TOKENS`] (OpenAI counts the maximum
    /// against the limit, not what is generated). A request costing more than a second's
    /// share can never be admitted and is refused as too large. At least 60.
    pub tokens_per_minute: Option<u64>,
    /// Generating requests in progress at once (`--limit-concurrent`): a chat completion from
    /// admission to its answer, a background response from its create to the end of its
    /// generation. At least 1.
    pub concurrent_requests: Option<u64>,
}

/// The output tokens a request is charged against the token limit when it names no maximum.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u64 = 1024;

impl LimitSettings {
    /// Refuses a limit that could admit nothing.
    pub fn validate(&self) -> Result<(), InvalidSettings> {
        let per_minute = [
            (
                "requests_per_minute",
                "--limit-rpm",
                self.requests_per_minute,
            ),
            ("tokens_per_minute", "--limit-tpm", self.tokens_per_minute),
        ];
        for (name, flag, value) in per_minute {
            if let Some(value) = value.filter(|v| *v < 60) {
                return Err(InvalidSettings::LimitUnderOnePerSecond { name, flag, value });
            }
        }
        if self.concurrent_requests == Some(0) {
            return Err(InvalidSettings::NoConcurrency);
        }
        Ok(())
    }
}

/// Everything the mock provider does, fixed at start except `faults`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MockSettings {
    /// The real API the mock imitates where they differ (refusals, retention). Default
    /// `openai-chat`.
    pub profile: MockProfile,
    /// Mean time a generation takes, in milliseconds, answered whole or streamed. A whole
    /// answer is sent after it; a streamed one sends its first delta after a quarter of it
    /// (its time to first token, [`FIRST_TOKEN_SHARE`]) and its deltas evenly over the rest,
    /// so it closes at the latency too: streaming brings the first token earlier, not the end
    /// later, as with the hosted models. Under `stream_chunk_interval_ms` it is a stream's
    /// time to its first delta instead. The `[mock:latency_ms=N]` directive sets it per
    /// request, jitter aside.
    ///
    /// [`FIRST_TOKEN_SHARE`]: crate::mock_provider::pace::FIRST_TOKEN_SHARE
    pub latency_ms: u64,
    /// Uniform spread around `latency_ms`: each generation takes `latency_ms ± latency_jitter_ms`
    /// (never less than zero).
    pub latency_jitter_ms: u64,
    /// Characters of the reply per delta of a stream. Default 12, about three tokens.
    pub stream_chunk_chars: usize,
    /// A fixed pause between two deltas of a stream, in milliseconds, for a stream that grows
    /// with its reply (a writer of a fixed speed): the latency is then the time to the first
    /// delta, and the stream lasts the latency plus an interval per later delta. Unset (the
    /// default): the stream takes the latency in all (see `latency_ms`).
    pub stream_chunk_interval_ms: Option<u64>,
    /// Injected faults; `PUT /faults` replaces them while the mock runs.
    pub faults: FaultSettings,
    /// Capacity limits (requests and tokens per minute, requests at once); none by default.
    pub limits: LimitSettings,
    /// What the answers say of the limits: the profile's rate-limit headers (`reported`, the
    /// default) or only a refusal's `retry-after` and `retry-after-ms` (`retry-after-only`).
    pub limit_headers: LimitHeaders,
    /// Whether a repeated `Idempotency-Key` gets the first request's reply instead of a new
    /// generation. Default false, as no real chat API documents such a key (OpenAI chat
    /// completions, Anthropic Messages): a resent request is paid for again. True plays a
    /// provider that honours it. Applies to background-response creates too: a repeated key
    /// then gets the first response's id.
    pub honour_idempotency_key: bool,
    /// Whether `POST /v1/responses` and `GET /v1/responses/{id}` exist. Default true; false
    /// answers them 404, like a provider without background responses.
    pub background_responses: bool,
    /// Whether a chat or messages generation stops when its client goes away. Default false:
    /// the hosted APIs finish (and bill) a request whose connection closed, so a caller killed
    /// mid-call has cost a generation. True is the kinder provider that drops it.
    pub cancel_on_disconnect: bool,
    /// How long a background response can be retrieved by id after it ended, in
    /// milliseconds; after it `GET /v1/responses/{id}` is 404 and its key (when honoured) is
    /// forgotten. A response still generating is always found. Unset: the profile's
    /// ([`MockProfile::default_response_retention_ms`]).
    pub response_retention_ms: Option<u64>,
    /// Seed of the fault and latency draws, so a run can be replayed.
    pub seed: u64,
}

impl Default for MockSettings {
    fn default() -> Self {
        Self {
            profile: MockProfile::OpenAiChat,
            latency_ms: 0,
            latency_jitter_ms: 0,
            stream_chunk_chars: DEFAULT_STREAM_CHUNK_CHARS,
            stream_chunk_interval_ms: None,
            faults: FaultSettings::default(),
            limits: LimitSettings::default(),
            limit_headers: LimitHeaders::Reported,
            honour_idempotency_key: false,
            background_responses: true,
            cancel_on_disconnect: false,
            response_retention_ms: None,
            seed: 0,
        }
    }
}

/// Characters per delta of a stream unless told: about three tokens.
pub const DEFAULT_STREAM_CHUNK_CHARS: usize = 12;

impl MockSettings {
    /// Refuses faults and limits that contradict themselves or could admit nothing, and
    /// streams whose deltas would be empty.
    pub fn validate(&self) -> Result<(), InvalidSettings> {
        self.faults.validate()?;
        self.limits.validate()?;
        if self.stream_chunk_chars == 0 {
            return Err(InvalidSettings::EmptyStreamChunks);
        }
        Ok(())
    }

    /// How long an ended background response stays retrievable; `None` while the mock runs.
    pub fn response_retention_ms(&self) -> Option<u64> {
        self.response_retention_ms
            .or(self.profile.default_response_retention_ms())
    }
}

/// Flags of the `mock-provider` subcommand.
#[derive(Debug, Clone, clap::Args)]
pub struct MockProviderArgs {
    /// Address to listen on; port 0 picks a free port (the bound one is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// The real API imitated where they differ: refusals' body and headers, retention of
    /// background responses.
    #[arg(long, value_enum, default_value_t = MockProfile::OpenAiChat)]
    pub profile: MockProfile,
    /// Requests per minute admitted, enforced per second (a 60th of it in any second); none
    /// when absent.
    #[arg(long)]
    pub limit_rpm: Option<u64>,
    /// Tokens per minute admitted (prompt tokens plus the request's maximum output, else
    /// 1024), enforced per second; none when absent.
    #[arg(long)]
    pub limit_tpm: Option<u64>,
    /// Generating requests in progress at once; none when absent.
    #[arg(long)]
    pub limit_concurrent: Option<u64>,
    /// What the answers say of the limits: `reported` (the profile's rate-limit headers) or
    /// `retry-after-only` (a refusal's `retry-after` and `retry-after-ms`, as Azure answers).
    #[arg(long, value_enum, default_value_t = LimitHeaders::Reported)]
    pub limit_headers: LimitHeaders,
    /// Mean time a generation takes, in milliseconds, whole or streamed (a stream's first
    /// delta after a quarter of it; with --stream-chunk-interval-ms, its time to the first
    /// delta).
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Uniform spread around --latency-ms, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub latency_jitter_ms: u64,
    /// Characters of the reply per delta of a stream.
    #[arg(long, default_value_t = DEFAULT_STREAM_CHUNK_CHARS)]
    pub stream_chunk_chars: usize,
    /// A fixed pause between two deltas of a stream, in milliseconds, the stream then
    /// growing with its reply after --latency-ms; absent, a stream takes --latency-ms in all.
    #[arg(long)]
    pub stream_chunk_interval_ms: Option<u64>,
    /// Share of requests answered --error-status at once.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub error_rate: f64,
    /// Status of the injected errors.
    #[arg(long, default_value_t = 500)]
    pub error_status: u16,
    /// Share of requests answered 429.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub rate_limit_rate: f64,
    /// `Retry-After` of the injected 429s, in seconds.
    #[arg(long, default_value_t = 1)]
    pub retry_after_s: u64,
    /// Share of requests that hang for --hang-ms before anything else.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub hang_rate: f64,
    /// How long a hanging request waits, in milliseconds.
    #[arg(long, default_value_t = 600_000)]
    pub hang_ms: u64,
    /// Share of requests whose work is done and whose response is then broken mid-body.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub drop_after_work_rate: f64,
    /// Share of streamed answers cut after --stream-fault-after-chunks deltas.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub stream_cut_rate: f64,
    /// Share of streamed answers that stall for --hang-ms after --stream-fault-after-chunks
    /// deltas, then are cut.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub stream_stall_rate: f64,
    /// Share of streamed answers that send the API's error event after
    /// --stream-fault-after-chunks deltas, then close.
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    pub stream_error_rate: f64,
    /// Deltas a streamed answer sends before its stream fault strikes.
    #[arg(long, default_value_t = 3)]
    pub stream_fault_after_chunks: usize,
    /// Whether a repeated Idempotency-Key returns the first reply instead of generating anew
    /// (no real chat API documents it: false by default).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub honour_idempotency_key: bool,
    /// Whether the background-responses endpoints exist (false: they answer 404).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub background_responses: bool,
    /// Whether a generation stops when its client goes away (false, as the hosted APIs:
    /// the work finishes and is counted).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub cancel_on_disconnect: bool,
    /// How long an ended background response can be retrieved by id, in milliseconds
    /// (default: the profile's; openai-responses keeps one 600000 ms).
    #[arg(long)]
    pub response_retention_ms: Option<u64>,
    /// Seed of the fault and latency draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl From<MockProviderArgs> for MockSettings {
    fn from(args: MockProviderArgs) -> Self {
        MockSettings {
            profile: args.profile,
            latency_ms: args.latency_ms,
            latency_jitter_ms: args.latency_jitter_ms,
            stream_chunk_chars: args.stream_chunk_chars,
            stream_chunk_interval_ms: args.stream_chunk_interval_ms,
            faults: FaultSettings {
                error_rate: args.error_rate,
                error_status: args.error_status,
                rate_limit_rate: args.rate_limit_rate,
                retry_after_s: args.retry_after_s,
                hang_rate: args.hang_rate,
                hang_ms: args.hang_ms,
                drop_after_work_rate: args.drop_after_work_rate,
                omit_usage: false,
                stream_cut_rate: args.stream_cut_rate,
                stream_stall_rate: args.stream_stall_rate,
                stream_error_rate: args.stream_error_rate,
                stream_fault_after_chunks: args.stream_fault_after_chunks,
                stream_without_final_event: false,
                stream_split_data: false,
            },
            limits: LimitSettings {
                requests_per_minute: args.limit_rpm,
                tokens_per_minute: args.limit_tpm,
                concurrent_requests: args.limit_concurrent,
            },
            limit_headers: args.limit_headers,
            honour_idempotency_key: args.honour_idempotency_key,
            background_responses: args.background_responses,
            cancel_on_disconnect: args.cancel_on_disconnect,
            response_retention_ms: args.response_retention_ms,
            seed: args.seed,
        }
    }
}

fn parse_rate(text: &str) -> Result<f64, String> {
    let rate: f64 = text
        .parse()
        .map_err(|e| format!("`{text}` is not a number: {e}"))?;
    if (0.0..=1.0).contains(&rate) {
        Ok(rate)
    } else {
        Err(format!("{rate} is not a rate in [0, 1]"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: MockProviderArgs,
    }

    #[test]
    fn flags_default_to_the_settings_defaults() {
        let cli = Cli::try_parse_from(["mock"]).unwrap();
        assert_eq!(cli.args.listen.to_string(), "127.0.0.1:0");
        assert_eq!(MockSettings::from(cli.args), MockSettings::default());
    }

    #[test]
    fn flags_become_settings() {
        let cli = Cli::try_parse_from([
            "mock",
            "--latency-ms=20",
            "--error-rate=0.25",
            "--error-status=502",
            "--honour-idempotency-key=true",
            "--background-responses=false",
            "--seed=9",
            "--profile=anthropic-messages",
            "--limit-rpm=3000",
            "--limit-tpm=90000",
            "--limit-concurrent=64",
            "--limit-headers=retry-after-only",
            "--response-retention-ms=5000",
            "--stream-chunk-chars=5",
            "--stream-chunk-interval-ms=7",
            "--stream-cut-rate=0.125",
            "--stream-stall-rate=0.25",
            "--stream-error-rate=0.375",
            "--stream-fault-after-chunks=2",
        ])
        .unwrap();
        let settings = MockSettings::from(cli.args);
        assert_eq!(settings.latency_ms, 20);
        assert_eq!(settings.faults.error_rate, 0.25);
        assert_eq!(settings.faults.error_status, 502);
        assert!(settings.honour_idempotency_key);
        assert!(!settings.background_responses);
        assert_eq!(settings.seed, 9);
        assert_eq!(settings.profile, MockProfile::AnthropicMessages);
        assert_eq!(
            settings.limits,
            LimitSettings {
                requests_per_minute: Some(3000),
                tokens_per_minute: Some(90_000),
                concurrent_requests: Some(64),
            }
        );
        assert_eq!(settings.limit_headers, LimitHeaders::RetryAfterOnly);
        assert_eq!(settings.response_retention_ms(), Some(5000));
        assert_eq!(
            (
                settings.stream_chunk_chars,
                settings.stream_chunk_interval_ms
            ),
            (5, Some(7))
        );
        assert_eq!(
            (
                settings.faults.stream_cut_rate,
                settings.faults.stream_stall_rate,
                settings.faults.stream_error_rate,
                settings.faults.stream_fault_after_chunks,
            ),
            (0.125, 0.25, 0.375, 2)
        );
        assert!(Cli::try_parse_from(["mock", "--hang-rate=1.5"]).is_err());
        assert!(Cli::try_parse_from(["mock", "--stream-cut-rate=2"]).is_err());
        assert!(Cli::try_parse_from(["mock", "--profile=openai"]).is_err());
    }

    #[test]
    fn by_default_no_key_is_honoured_and_nothing_is_limited() {
        let settings = MockSettings::default();
        assert!(!settings.honour_idempotency_key);
        assert_eq!(settings.profile, MockProfile::OpenAiChat);
        assert_eq!(settings.limits, LimitSettings::default());
        assert_eq!(settings.response_retention_ms(), None);
        assert_eq!(settings.validate(), Ok(()));
    }

    #[test]
    fn the_responses_profile_keeps_a_response_about_ten_minutes_unless_told() {
        let responses = MockSettings {
            profile: MockProfile::OpenAiResponses,
            ..MockSettings::default()
        };
        assert_eq!(responses.response_retention_ms(), Some(600_000));
        let told = MockSettings {
            response_retention_ms: Some(1_500),
            ..responses
        };
        assert_eq!(told.response_retention_ms(), Some(1_500));
        assert_eq!(
            MockProfile::AnthropicMessages.refusal_dialect(),
            RefusalDialect::Anthropic
        );
        assert_eq!(
            MockProfile::OpenAiResponses.refusal_dialect(),
            RefusalDialect::OpenAi
        );
    }

    #[test]
    fn a_limit_that_could_admit_nothing_is_refused_naming_its_flag() {
        let slow = LimitSettings {
            requests_per_minute: Some(30),
            ..LimitSettings::default()
        };
        let error = slow.validate().unwrap_err();
        assert!(
            error
                .to_string()
                .contains("requests_per_minute (--limit-rpm) = 30"),
            "{error}"
        );
        let tokens = LimitSettings {
            tokens_per_minute: Some(59),
            ..LimitSettings::default()
        };
        assert!(
            tokens
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--limit-tpm")
        );
        let none_at_once = LimitSettings {
            concurrent_requests: Some(0),
            ..LimitSettings::default()
        };
        assert_eq!(none_at_once.validate(), Err(InvalidSettings::NoConcurrency));
        let ok = LimitSettings {
            requests_per_minute: Some(60),
            tokens_per_minute: Some(60),
            concurrent_requests: Some(1),
        };
        assert_eq!(ok.validate(), Ok(()));
    }

    #[test]
    fn contradictory_faults_are_refused_with_the_reason() {
        let over = FaultSettings {
            error_rate: 0.6,
            hang_rate: 0.6,
            ..FaultSettings::default()
        };
        assert_eq!(
            over.validate(),
            Err(InvalidSettings::RatesOverOne { sum: 1.2 })
        );
        let negative = FaultSettings {
            hang_rate: -0.1,
            ..FaultSettings::default()
        };
        assert!(matches!(
            negative.validate(),
            Err(InvalidSettings::RateOutOfRange {
                name: "hang_rate",
                ..
            })
        ));
        let not_error = FaultSettings {
            error_status: 200,
            ..FaultSettings::default()
        };
        assert_eq!(
            not_error.validate(),
            Err(InvalidSettings::NotAnErrorStatus(200))
        );
        let exactly_one = FaultSettings {
            error_rate: 0.1,
            rate_limit_rate: 0.2,
            drop_after_work_rate: 0.7,
            ..FaultSettings::default()
        };
        assert_eq!(exactly_one.validate(), Ok(()));
        let streams_too = FaultSettings {
            error_rate: 0.5,
            stream_stall_rate: 0.25,
            stream_error_rate: 0.5,
            ..FaultSettings::default()
        };
        assert_eq!(
            streams_too.validate(),
            Err(InvalidSettings::RatesOverOne { sum: 1.25 })
        );
    }

    #[test]
    fn a_stream_of_empty_deltas_is_refused_naming_its_flag() {
        let empty = MockSettings {
            stream_chunk_chars: 0,
            ..MockSettings::default()
        };
        let error = empty.validate().unwrap_err();
        assert_eq!(error, InvalidSettings::EmptyStreamChunks);
        assert!(
            error.to_string().contains("--stream-chunk-chars"),
            "{error}"
        );
    }
}
