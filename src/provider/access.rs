//! Whether the provider can be reached with these settings: `GET …/models` on the API's root
//! (`https://api.openai.com/v1/models`, [`super::base_url`]) with
//! the key and headers every call carries, the one request OpenAI's and Anthropic's APIs both
//! answer without generating (nothing is paid). What `replyd config check --connect` asks:
//! a wrong base URL (a 404), a refused key (401/403) or an unreachable host is named before
//! the first task fails on it.

use reqwest::StatusCode;
use serde::Deserialize;

use super::http::{build_client, endpoint, extra_headers, with_api_key, with_extra_headers};
use super::settings::{ProviderApi, ProviderSettings};

/// What the provider answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    /// Models the key may use, as listed (OpenAI's and Anthropic's `data[].id`).
    pub models: Vec<String>,
}

/// Why the provider cannot be used with these settings; each names the setting to look at.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("provider settings: {0}")]
    Settings(String),
    #[error("cannot reach {url} (provider.base_url): {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{url} refused the key with {status} (provider.api_key): {body}")]
    Refused {
        url: String,
        status: u16,
        body: String,
    },
    #[error(
        "{url} answered 404: no API at provider.base_url ({base_url}); it should be the API's root with its version (`https://api.openai.com/v1`) or the server's root (`https://api.openai.com`)"
    )]
    NotFound { url: String, base_url: String },
    #[error("{url} answered {status}: {body}")]
    Other {
        url: String,
        status: u16,
        body: String,
    },
}

#[derive(Deserialize)]
struct ModelList {
    #[serde(default)]
    data: Vec<Model>,
}

#[derive(Deserialize)]
struct Model {
    id: String,
}

/// Most of an error body worth showing.
const SHOWN_BODY: usize = 300;

/// Asks the provider for its model list, as a call of this adapter would be sent.
pub async fn check(settings: &ProviderSettings) -> Result<Access, AccessError> {
    let url = endpoint(settings, "/models").map_err(|e| AccessError::Settings(e.to_string()))?;
    let client = build_client(settings).map_err(|e| AccessError::Settings(e.to_string()))?;
    let extra = extra_headers(settings).map_err(|e| AccessError::Settings(e.to_string()))?;
    let mut request = with_extra_headers(client.get(url.clone()), &extra);
    request = if settings.api == ProviderApi::AnthropicMessages {
        super::anthropic::with_anthropic_key(request, settings.api_key.as_ref())
            .map_err(|e| AccessError::Settings(e.to_string()))?
            .header("anthropic-version", settings.anthropic_version.trim())
    } else {
        with_api_key(request, settings.api_key.as_ref())
            .map_err(|e| AccessError::Settings(e.to_string()))?
    };
    let url = url.to_string();
    let response = request.send().await.map_err(|e| AccessError::Unreachable {
        url: url.clone(),
        reason: crate::telemetry::chain(&e),
    })?;
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    let shown = || body.chars().take(SHOWN_BODY).collect::<String>();
    match status {
        StatusCode::OK => {
            let list: ModelList = serde_json::from_str(&body).map_err(|e| AccessError::Other {
                url: url.clone(),
                status: status.as_u16(),
                body: format!("not a model list ({e}): {}", shown()),
            })?;
            Ok(Access {
                models: list.data.into_iter().map(|m| m.id).collect(),
            })
        }
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => Err(AccessError::Refused {
            url,
            status: status.as_u16(),
            body: shown(),
        }),
        StatusCode::NOT_FOUND => Err(AccessError::NotFound {
            url,
            base_url: settings.base_url.clone(),
        }),
        _ => Err(AccessError::Other {
            url,
            status: status.as_u16(),
            body: shown(),
        }),
    }
}
