//! The settings every adapter reads (`[provider]` in the settings file): where the server is,
//! its key and any headers it needs, the time limits, which of its APIs to call, and what that
//! API needs of a request. The checks of these settings live here too ([`ProviderSettings::problems`]),
//! so `Settings::validate` and the adapters' constructors refuse the same things with the same
//! words.

use std::collections::BTreeMap;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};

use super::base_url::BaseUrl;
use replyd_core::secret::Secret;

/// Headers replyd sets itself, with who sets them: an extra header by one of these names would
/// be sent twice or fight the one replyd means.
const RESERVED_HEADERS: &[(&str, &str)] = &[
    ("authorization", "from provider.api_key"),
    ("x-api-key", "from provider.api_key with anthropic_messages"),
    ("anthropic-version", "from provider.anthropic_version"),
    ("content-type", "for the JSON body"),
    ("idempotency-key", "the task id"),
    ("traceparent", "the trace context"),
    ("tracestate", "the trace context"),
    ("content-length", "by the HTTP client"),
    ("transfer-encoding", "by the HTTP client"),
    ("host", "by the HTTP client"),
    ("connection", "by the HTTP client"),
];

/// The default of `max_completion_tokens_models`: OpenAI's reasoning models as of writing.
const REASONING_MODEL_PREFIXES: &[&str] = &["o1", "o3", "o4", "gpt-5"];

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
    /// Anthropic's `POST /v1/messages`: one request per call, with `x-api-key` and
    /// `anthropic-version`. Anthropic documents no idempotency key and no way to look a call
    /// up, so an ambiguous call cannot be recovered: `retry.ambiguous` decides whether it is
    /// sent again (and may be paid twice) or the task fails.
    AnthropicMessages,
}

/// `provider.stream`: whether calls ask for a streamed answer. Written `true`, `false` or
/// `"auto"`, as a team reads it in the file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Streaming {
    /// Streamed where the worker forwards live text, whole where it does not.
    #[default]
    Auto,
    Always,
    Never,
}

impl Streaming {
    /// Whether a call asks for a streamed answer, for a worker that forwards live text or
    /// not.
    pub fn streams(self, live_text: bool) -> bool {
        match self {
            Self::Auto => live_text,
            Self::Always => true,
            Self::Never => false,
        }
    }
}

/// What the file holds: a boolean, or a word (only `"auto"` is one).
#[derive(Deserialize)]
#[serde(untagged)]
enum StreamingValue {
    Flag(bool),
    Word(String),
}

impl<'de> Deserialize<'de> for Streaming {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match StreamingValue::deserialize(deserializer)
            .map_err(|_| serde::de::Error::custom("expected true, false or \"auto\""))?
        {
            StreamingValue::Flag(true) => Ok(Self::Always),
            StreamingValue::Flag(false) => Ok(Self::Never),
            StreamingValue::Word(word) if word == "auto" => Ok(Self::Auto),
            StreamingValue::Word(word) => Err(serde::de::Error::custom(format!(
                "{word:?} is not a choice: true, false or \"auto\""
            ))),
        }
    }
}

impl Serialize for Streaming {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => serializer.serialize_str("auto"),
            Self::Always => serializer.serialize_bool(true),
            Self::Never => serializer.serialize_bool(false),
        }
    }
}

impl schemars::JsonSchema for Streaming {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Streaming".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "enum": [true, false, "auto"] })
    }
}

/// How replyd reaches the LLM provider: an OpenAI-compatible server (OpenAI, Azure OpenAI,
/// Gemini's OpenAI compatibility, vLLM, a gateway) or Anthropic's Messages API. For Azure
/// OpenAI, set `base_url` to `https://<resource>.openai.azure.com/openai/v1` (or a classic
/// deployment's URL with its `?api-version=`), the key as `extra_headers.api-key` (not
/// `api_key`), and `default_model` (and each task's model) to the deployment's name.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ProviderSettings {
    /// Where the provider's API is, in either of two forms. As the providers' SDKs document
    /// it, the API's root with its version: a path that names a version (a segment such as
    /// `v1`, `v1beta`, `v2alpha1`) or an Azure deployment gets the API's own path appended,
    /// `{base_url}/chat/completions` (`/responses`, `/messages`): OpenAI
    /// `https://api.openai.com/v1`, Gemini
    /// `https://generativelanguage.googleapis.com/v1beta/openai`, Azure's v1 API
    /// `https://<resource>.openai.azure.com/openai/v1`, Azure's classic
    /// `https://<resource>.openai.azure.com/openai/deployments/<deployment>?api-version=2024-10-21`,
    /// Anthropic `https://api.anthropic.com/v1`. Or, as before, the server's root (and any
    /// path prefix) without a version: `/v1` is put before the API's path,
    /// `{base_url}/v1/chat/completions`: `https://api.openai.com`,
    /// `https://api.anthropic.com`. A query is sent with every request (Azure's
    /// `api-version`, which an Azure deployment requires); a fragment is refused. Default
    /// `https://api.openai.com`.
    pub base_url: String,
    /// Sent as `Authorization: Bearer <key>` when set (as `x-api-key: <key>` with
    /// `anthropic_messages`); never logged. Servers without authentication (the mock provider,
    /// a local vLLM) need none. Default: none.
    pub api_key: Option<Secret>,
    /// More headers sent with every request to the provider, by name, e.g. Azure OpenAI's
    /// `api-key` or OpenAI's `OpenAI-Project`. Values are secrets: `config show`, logs and
    /// errors never show them. One variable per header overrides the file:
    /// `REPLYD_PROVIDER__EXTRA_HEADERS__API-KEY` (names are taken in lower case; a Kubernetes
    /// `env` entry may hold a `-`). Headers replyd sets itself (`authorization`, `x-api-key`,
    /// `anthropic-version`, `content-type`, `idempotency-key`, `traceparent`, `tracestate`,
    /// and the HTTP client's own), names or values that are not valid HTTP, and a name given
    /// twice (names ignore case) are refused, naming the header. Default: none.
    pub extra_headers: BTreeMap<String, Secret>,
    /// Whole-call limit, from sending the request to the last byte of the answer. A call that
    /// runs out of it is `Ambiguous`: the provider may still finish and bill the work. With
    /// `background_responses` it bounds each request (the create, each poll), not the wait for
    /// the operation as a whole (`operation_max_wait_ms`). Default 60000.
    pub request_timeout_ms: u64,
    /// Limit on opening the TCP (and TLS) connection. A call that runs out of it is `NotSent`.
    /// Default 3000.
    pub connect_timeout_ms: u64,
    /// Ask for a streamed answer (chat completions and Messages `stream: true`, background
    /// responses streamed from their first event), so the worker can forward the text to the
    /// task's followers as it is written: `true`, `false`, or `"auto"`, streamed when the
    /// worker forwards live text (`worker.live_text_interval_ms` above 0) and whole when it
    /// does not, since a streamed answer's text then reaches no one and reading it event by
    /// event costs the worker about 1.4 times the CPU of one JSON body (docs/BENCHMARKS.md,
    /// P3). The saved reply is the same either way: the whole text, once the provider's final
    /// event says it is whole (`[DONE]`, `message_stop`), or, as the SDKs take it, once the
    /// body ends cleanly after a finish reason (`finish_reason`, `stop_reason`); a stream cut,
    /// stalled or ended before that is an ambiguous call. `true` keeps streaming without live text, for
    /// `stream_idle_timeout_ms` to cut a stalled answer before `request_timeout_ms`. Default
    /// `"auto"`.
    pub stream: Streaming,
    /// A streamed answer that sends nothing for this long is cut and treated as a call whose
    /// answer was lost (`Ambiguous`), well before `request_timeout_ms` when a provider stalls
    /// mid-answer. At least 1000. Default 30000.
    pub stream_idle_timeout_ms: u64,
    /// Model asked for when a task names none. Default `gpt-4o-mini`.
    pub default_model: String,
    /// `chat_completions`, `background_responses` or `anthropic_messages` (see
    /// [`ProviderApi`]). Default `chat_completions`.
    #[serde(default)]
    pub api: ProviderApi,
    /// `chat_completions` only: models (by name prefix, case ignored; a router's `openai/o3`
    /// counts as `o3`) whose length limit is sent as `max_completion_tokens` rather than
    /// `max_tokens`. OpenAI's reasoning models refuse `max_tokens`, while many
    /// OpenAI-compatible servers know only `max_tokens`; the model's name is what tells them
    /// apart. Add a deployment's name on Azure; `[""]` sends `max_completion_tokens` for every
    /// model, `[]` never. Default `["o1", "o3", "o4", "gpt-5"]`.
    pub max_completion_tokens_models: Vec<String>,
    /// `anthropic_messages` only: the `anthropic-version` header, the API version replyd's
    /// requests and its reading of the answers are written against. Default `2023-06-01`.
    pub anthropic_version: String,
    /// `anthropic_messages` only: `max_tokens` of a task that sets no `max_output_tokens` (the
    /// Messages API requires one). At least 1. Default 4096.
    pub anthropic_max_tokens: u32,
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

impl Default for ProviderSettings {
    fn default() -> Self {
        Self {
            base_url: "https://api.openai.com".into(),
            api_key: None,
            request_timeout_ms: 60_000,
            connect_timeout_ms: 3_000,
            stream: Streaming::Auto,
            stream_idle_timeout_ms: 30_000,
            default_model: "gpt-4o-mini".into(),
            api: ProviderApi::ChatCompletions,
            poll_interval_ms: 500,
            operation_max_wait_ms: 30 * 60 * 1000,
            extra_headers: BTreeMap::new(),
            max_completion_tokens_models: REASONING_MODEL_PREFIXES
                .iter()
                .map(|p| (*p).to_owned())
                .collect(),
            anthropic_version: "2023-06-01".into(),
            anthropic_max_tokens: 4096,
        }
    }
}

impl ProviderSettings {
    /// These settings for a worker that forwards live text or not: `stream` decided, `true`
    /// or `false`.
    pub fn streaming(&self, live_text: bool) -> Self {
        let stream = if self.stream.streams(live_text) {
            Streaming::Always
        } else {
            Streaming::Never
        };
        Self {
            stream,
            ..self.clone()
        }
    }

    /// Whether calls ask for a streamed answer. Settings no worker decided (the reconciler's,
    /// which only looks operations up; a test's adapter) stream as `"auto"` does with live
    /// text.
    pub fn streamed(&self) -> bool {
        self.stream.streams(true)
    }

    /// What is wrong with these settings, as `(setting, why)`: a base URL the adapters cannot
    /// use, extra headers that cannot be sent, Anthropic's settings out of range. Empty when
    /// nothing is.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(problem) = self.base_url_problem() {
            out.push(("provider.base_url", problem));
        }
        for problem in self.extra_header_problems() {
            out.push(("provider.extra_headers", problem));
        }
        if self.stream_idle_timeout_ms < 1_000 {
            out.push((
                "provider.stream_idle_timeout_ms",
                format!(
                    "{} is below 1000: a provider's pause between two events (a long prompt's first token, a ping) would cut healthy streams",
                    self.stream_idle_timeout_ms
                ),
            ));
        }
        if self.api == ProviderApi::AnthropicMessages {
            if self.anthropic_max_tokens == 0 {
                out.push((
                    "provider.anthropic_max_tokens",
                    "must be at least 1: the Messages API requires a positive max_tokens".into(),
                ));
            }
            if self.anthropic_version.trim().is_empty()
                || HeaderValue::from_str(&self.anthropic_version).is_err()
            {
                out.push((
                    "provider.anthropic_version",
                    format!(
                        "{:?} cannot be an anthropic-version header (e.g. \"2023-06-01\")",
                        self.anthropic_version
                    ),
                ));
            }
        }
        out
    }

    /// Why `base_url` cannot be used, if it cannot (see [`BaseUrl::parse`]).
    pub fn base_url_problem(&self) -> Option<String> {
        BaseUrl::parse(&self.base_url).err()
    }

    /// Why each extra header cannot be sent, naming it (never its value).
    pub fn extra_header_problems(&self) -> Vec<String> {
        self.checked_extra_headers().1
    }

    /// The extra headers ready to send, each value marked sensitive so no debug output of a
    /// request shows it; the first problem if one cannot be sent.
    pub(crate) fn extra_header_map(&self) -> Result<HeaderMap, String> {
        let (map, problems) = self.checked_extra_headers();
        match problems.into_iter().next() {
            Some(problem) => Err(problem),
            None => Ok(map),
        }
    }

    /// The headers that can be sent, and why the others cannot.
    fn checked_extra_headers(&self) -> (HeaderMap, Vec<String>) {
        let mut map = HeaderMap::new();
        let mut problems = Vec::new();
        for (name, value) in &self.extra_headers {
            match extra_header(name, value) {
                // Names ignore case on the wire: `Api-Key` and `api-key` are one header, and
                // one value would silently replace the other.
                Ok((header, _)) if map.contains_key(&header) => problems.push(format!(
                    "{name:?} is given twice (header names ignore case)"
                )),
                Ok((header, value)) => {
                    map.insert(header, value);
                }
                Err(problem) => problems.push(problem),
            }
        }
        (map, problems)
    }

    /// Whether `model`'s length limit goes out as `max_completion_tokens` (see
    /// `max_completion_tokens_models`).
    pub fn takes_max_completion_tokens(&self, model: &str) -> bool {
        takes_max_completion_tokens(&self.max_completion_tokens_models, model)
    }
}

/// Whether `model`'s name starts with one of `prefixes` (case ignored).
pub(crate) fn takes_max_completion_tokens(prefixes: &[String], model: &str) -> bool {
    // A router's `vendor/model` names the model after the last slash.
    let name = model.rsplit('/').next().unwrap_or(model);
    prefixes.iter().any(|prefix| {
        name.get(..prefix.len())
            .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
    })
}

/// One extra header as it goes on the wire, or why it cannot.
fn extra_header(name: &str, value: &Secret) -> Result<(HeaderName, HeaderValue), String> {
    let lower = name.to_ascii_lowercase();
    if let Some((_, by)) = RESERVED_HEADERS.iter().find(|(n, _)| *n == lower) {
        return Err(format!(
            "{name:?} is set by replyd itself ({by}) and cannot be an extra header"
        ));
    }
    let header = HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("{name:?} is not a valid HTTP header name"))?;
    // The value is a secret: the message names the header and the rule, never the value.
    let mut value = HeaderValue::from_str(value.expose()).map_err(|_| {
        format!("the value of {name:?} is not a valid HTTP header value (visible ASCII, spaces and tabs only)")
    })?;
    value.set_sensitive(true);
    Ok((header, value))
}

/// Settings the adapters' tests build their providers from.
#[cfg(test)]
impl ProviderSettings {
    /// The defaults, with the provider at `base_url` and `default_model`.
    pub(crate) fn at(base_url: &str, default_model: &str) -> Self {
        Self {
            base_url: base_url.into(),
            default_model: default_model.into(),
            ..Self::default()
        }
    }

    /// The defaults, with one extra header.
    pub(crate) fn with_extra_header(name: &str, value: &str) -> Self {
        let mut settings = Self::default();
        settings
            .extra_headers
            .insert(name.into(), Secret::new(value));
        settings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_base_url(base_url: &str) -> ProviderSettings {
        ProviderSettings {
            base_url: base_url.into(),
            ..ProviderSettings::default()
        }
    }

    #[test]
    fn the_sdks_base_urls_and_the_server_roots_are_taken_and_a_fragment_is_not() {
        for ok in [
            "https://api.openai.com",
            "https://api.openai.com/v1",
            "https://api.anthropic.com/",
            "https://api.anthropic.com/v1",
            "http://127.0.0.1:9",
            "https://gateway.example.com/llm",
            "https://generativelanguage.googleapis.com/v1beta/openai",
            "https://r.openai.azure.com/openai/v1",
            "https://r.openai.azure.com/openai/deployments/d?api-version=2024-10-21",
        ] {
            assert_eq!(with_base_url(ok).base_url_problem(), None, "{ok}");
        }
        for (bad, why) in [
            ("ftp://example.com", "not http or https"),
            ("llm.example.com", "not a URL"),
            ("", "not a URL"),
            ("https://api.openai.com/v1#top", "fragment"),
            (
                "https://r.openai.azure.com/openai/deployments/d",
                "api-version",
            ),
        ] {
            let problem = with_base_url(bad).base_url_problem().unwrap_or_default();
            assert!(problem.contains(why), "{bad}: {problem:?}");
        }
    }

    #[test]
    fn extra_headers_replyd_sets_or_http_refuses_are_named_without_their_value() {
        let mut settings = ProviderSettings::default();
        for (name, value) in [
            ("api-key", "azure-secret-1"),
            ("OpenAI-Project", "proj_123"),
            ("Authorization", "Bearer hunter2"),
            ("x-api-key", "hunter2"),
            ("Anthropic-Version", "2023-06-01"),
            ("traceparent", "00-x"),
            ("bad header", "v"),
            ("x-ok-name", "line\nbreak-hunter2"),
        ] {
            settings
                .extra_headers
                .insert(name.into(), Secret::new(value));
        }
        let problems = settings.extra_header_problems();
        assert_eq!(problems.len(), 6, "{problems:#?}");
        for named in [
            "\"Authorization\" is set by replyd itself (from provider.api_key)",
            "\"x-api-key\" is set by replyd itself",
            "\"Anthropic-Version\" is set by replyd itself",
            "\"traceparent\" is set by replyd itself",
            "\"bad header\" is not a valid HTTP header name",
            "the value of \"x-ok-name\" is not a valid HTTP header value",
        ] {
            assert!(
                problems.iter().any(|p| p.starts_with(named)),
                "{named} in {problems:#?}"
            );
        }
        assert!(
            problems.iter().all(|p| !p.contains("hunter2")),
            "{problems:#?}"
        );
        assert!(settings.extra_header_map().is_err());

        settings
            .extra_headers
            .retain(|name, _| name == "api-key" || name == "OpenAI-Project");
        let map = settings.extra_header_map().unwrap();
        assert_eq!(map["api-key"], "azure-secret-1");
        assert_eq!(map["openai-project"], "proj_123");
        assert!(map.values().all(HeaderValue::is_sensitive));
        assert!(!format!("{settings:?} {map:?}").contains("azure-secret-1"));
    }

    #[test]
    fn an_extra_header_given_twice_in_different_case_is_refused() {
        let mut settings = ProviderSettings::with_extra_header("API-Key", "first-hunter2");
        settings
            .extra_headers
            .insert("api-key".into(), Secret::new("second-hunter2"));
        let problems = settings.extra_header_problems();
        assert_eq!(
            problems,
            ["\"api-key\" is given twice (header names ignore case)"],
            "{problems:?}"
        );
        assert!(settings.extra_header_map().is_err());
    }

    #[test]
    fn reasoning_models_take_max_completion_tokens_by_name_prefix() {
        let settings = ProviderSettings::default();
        for model in [
            "o1",
            "o1-mini",
            "o3-2025-04-16",
            "o4-mini",
            "gpt-5",
            "gpt-5.1-codex",
            "GPT-5-mini",
            "openai/o3",
        ] {
            assert!(settings.takes_max_completion_tokens(model), "{model}");
        }
        for model in ["gpt-4o-mini", "gpt-4.1", "llama-3-70b", "", "é", "my-o3"] {
            assert!(!settings.takes_max_completion_tokens(model), "{model}");
        }
        let every = ProviderSettings {
            max_completion_tokens_models: vec![String::new()],
            ..ProviderSettings::default()
        };
        assert!(every.takes_max_completion_tokens("llama-3-70b"));
        let none = ProviderSettings {
            max_completion_tokens_models: vec![],
            ..ProviderSettings::default()
        };
        assert!(!none.takes_max_completion_tokens("o3"));
    }

    #[test]
    fn anthropic_settings_are_checked_only_for_anthropic() {
        let broken = ProviderSettings {
            anthropic_max_tokens: 0,
            anthropic_version: "".into(),
            ..ProviderSettings::default()
        };
        assert_eq!(broken.problems(), vec![]);
        let anthropic = ProviderSettings {
            api: ProviderApi::AnthropicMessages,
            ..broken
        };
        let settings: Vec<_> = anthropic.problems().into_iter().map(|(s, _)| s).collect();
        assert_eq!(
            settings,
            [
                "provider.anthropic_max_tokens",
                "provider.anthropic_version"
            ]
        );
    }

    #[test]
    fn stream_is_true_false_or_auto_and_auto_follows_live_text() {
        use figment::providers::{Format, Toml};
        let read = |toml: &str| {
            figment::Figment::new()
                .merge(Toml::string(toml))
                .extract::<ProviderSettings>()
                .map(|settings| settings.stream)
                .map_err(|e| e.to_string())
        };
        assert_eq!(read(""), Ok(Streaming::Auto));
        assert_eq!(read("stream = \"auto\""), Ok(Streaming::Auto));
        assert_eq!(read("stream = true"), Ok(Streaming::Always));
        assert_eq!(read("stream = false"), Ok(Streaming::Never));
        for bad in ["stream = \"yes\"", "stream = 1"] {
            let err = read(bad).unwrap_err();
            assert!(err.contains("true, false or \"auto\""), "{bad}: {err}");
        }
        for (stream, live_text, streamed) in [
            (Streaming::Auto, true, true),
            (Streaming::Auto, false, false),
            (Streaming::Always, false, true),
            (Streaming::Never, true, false),
        ] {
            let settings = ProviderSettings {
                stream,
                ..ProviderSettings::default()
            };
            let decided = settings.streaming(live_text);
            assert_eq!(
                decided.streamed(),
                streamed,
                "{stream:?}, live text {live_text}"
            );
            assert_ne!(decided.stream, Streaming::Auto);
        }
        assert!(ProviderSettings::default().streamed());
    }
}
