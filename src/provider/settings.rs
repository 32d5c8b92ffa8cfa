//! The settings both OpenAI adapters read (`[provider]` in the settings file): where the
//! server is, its key, the time limits, and which of its APIs to call.

use serde::{Deserialize, Serialize};

use crate::secret::Secret;

/// Which of the provider's APIs replyd calls.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ProviderApi {
    /// `POST /v1/chat/completions`: one request per call; an ambiguous call is recovered only
    /// if the provider honours `Idempotency-Key`.
    #[default]
    ChatCompletions,
    /// `POST /v1/responses` with `"background": true`, then `GET /v1/responses/{id}` until the
    /// response is done: the operation id survives an ambiguous call and a restart.
    BackgroundResponses,
}

/// How replyd reaches an OpenAI-compatible server.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct OpenAiSettings {
    /// Scheme, host and port (and any path prefix) of the server, without `/v1`; the adapter
    /// posts to `{base_url}/v1/chat/completions` (or `{base_url}/v1/responses`). Default
    /// `https://api.openai.com`.
    pub base_url: String,
    /// Sent as `Authorization: Bearer <key>` when set; never logged. Servers without
    /// authentication (the mock provider, a local vLLM) need none. Default: none.
    pub api_key: Option<Secret>,
    /// Whole-call limit, from sending the request to the last byte of the answer. A call that
    /// runs out of it is `Ambiguous`: the provider may still finish and bill the work. With
    /// `background_responses` it bounds each request (the create, each poll), not the wait for
    /// the operation as a whole (`operation_max_wait_ms`). Default 60000.
    pub request_timeout_ms: u64,
    /// Limit on opening the TCP (and TLS) connection. A call that runs out of it is `NotSent`.
    /// Default 3000.
    pub connect_timeout_ms: u64,
    /// Model asked for when a task names none. Default `gpt-4o-mini`.
    pub default_model: String,
    /// `chat_completions` or `background_responses` (see [`ProviderApi`]). Default
    /// `chat_completions`.
    #[serde(default)]
    pub api: ProviderApi,
    /// `background_responses` only: pause between two polls of a response that is not done
    /// yet. Values below 1 are taken as 1. Default 500.
    pub poll_interval_ms: u64,
    /// `background_responses` only: how long a worker keeps waiting on an operation the
    /// provider still reports as queued or running. Waiting is not an attempt: a long
    /// generation is never cut short and started again (which would pay twice). Past this
    /// bound the task fails, and its quota reservation stays open until the reconciler learns
    /// from the provider how the operation ended (I8). Polls that fail in transit are asked
    /// again within the same bound. Default 1800000 (30 minutes).
    pub operation_max_wait_ms: u64,
}

impl Default for OpenAiSettings {
    fn default() -> Self {
        Self {
            base_url: "https://api.openai.com".into(),
            api_key: None,
            request_timeout_ms: 60_000,
            connect_timeout_ms: 3_000,
            default_model: "gpt-4o-mini".into(),
            api: ProviderApi::ChatCompletions,
            poll_interval_ms: 500,
            operation_max_wait_ms: 30 * 60 * 1000,
        }
    }
}
