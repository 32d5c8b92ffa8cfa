//! Where an API's path goes on `provider.base_url`, as the providers' SDKs read a base URL.
//! Pure.
//!
//! The SDKs take the API's root, version included (`https://api.openai.com/v1`, Gemini's
//! `…/v1beta/openai`, Azure's `…/openai/v1`), and append the API's own path
//! (`/chat/completions`, `/responses`, `/messages`). replyd took the server's root and put
//! `/v1` in front itself (`https://api.openai.com`). Both are read here, told apart by the
//! path: one that names a version (a segment `v` and a number, with any letters after it:
//! `v1`, `v1beta`, `v2alpha1`) or an Azure deployment (`…/openai/deployments/<name>`, whose
//! version is its `api-version` query) is the API's root; any other path is a prefix on the
//! server, and `/v1` goes after it. A query (Azure's `api-version`) is kept on every request.

use reqwest::Url;

/// A base URL, read: the URL and where the API's paths go on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BaseUrl {
    /// The server's root, or a prefix on it: `/v1` then the API's path go after it.
    ServerRoot(Url),
    /// The API's root: its path names the version or an Azure deployment, and the API's path
    /// goes right after it, as the SDKs append it.
    ApiRoot(Url),
}

impl BaseUrl {
    /// Reads `text`, or says why it cannot be used: not an http(s) URL, a fragment, or an
    /// Azure deployment without its `api-version`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let url = Url::parse(text).map_err(|e| format!("{text:?} is not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!("scheme `{}` is not http or https", url.scheme()));
        }
        if url.fragment().is_some() {
            return Err(format!(
                "{text:?} has a fragment, which is never sent: remove it"
            ));
        }
        let segments: Vec<&str> = url.path().split('/').filter(|s| !s.is_empty()).collect();
        let deployment = segments
            .windows(3)
            .any(|w| w[0].eq_ignore_ascii_case("openai") && w[1] == "deployments");
        if deployment && !url.query_pairs().any(|(name, _)| name == "api-version") {
            return Err(format!(
                "{text:?} is an Azure deployment without its API version: add \
                 `?api-version=…` (e.g. `?api-version=2024-10-21`), which Azure requires on \
                 every request to it"
            ));
        }
        if deployment || segments.iter().any(|s| names_a_version(s)) {
            Ok(Self::ApiRoot(url))
        } else {
            Ok(Self::ServerRoot(url))
        }
    }

    /// The URL of the API's `path` (`/chat/completions`, `/responses`, `/messages`,
    /// `/models`), with the base URL's query.
    pub fn api_url(&self, path: &str) -> Url {
        let (base, version) = match self {
            Self::ServerRoot(url) => (url, "/v1"),
            Self::ApiRoot(url) => (url, ""),
        };
        let mut url = base.clone();
        let prefix = base.path().trim_end_matches('/').to_owned();
        url.set_path(&format!("{prefix}{version}{path}"));
        url
    }
}

/// Whether a path segment names an API version: `v`, a number, and letters or digits after
/// it (`v1`, `V1`, `v1beta`, `v2alpha1`, `v10`); not `v`, `vllm` or `v1.5-proxy`.
fn names_a_version(segment: &str) -> bool {
    let Some(rest) = segment
        .strip_prefix('v')
        .or_else(|| segment.strip_prefix('V'))
    else {
        return false;
    };
    rest.starts_with(|c: char| c.is_ascii_digit())
        && rest.chars().all(|c| c.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(base: &str) -> String {
        BaseUrl::parse(base)
            .unwrap_or_else(|e| panic!("{base}: {e}"))
            .api_url("/chat/completions")
            .to_string()
    }

    #[test]
    fn each_providers_documented_base_url_reaches_its_api() {
        for (base, api_path, url) in [
            // OpenAI, as its SDKs document it, and as replyd took it.
            (
                "https://api.openai.com/v1",
                "/chat/completions",
                "https://api.openai.com/v1/chat/completions",
            ),
            (
                "https://api.openai.com/v1/",
                "/responses",
                "https://api.openai.com/v1/responses",
            ),
            (
                "https://api.openai.com",
                "/chat/completions",
                "https://api.openai.com/v1/chat/completions",
            ),
            (
                "https://api.openai.com/",
                "/models",
                "https://api.openai.com/v1/models",
            ),
            // Gemini's OpenAI compatibility.
            (
                "https://generativelanguage.googleapis.com/v1beta/openai",
                "/chat/completions",
                "https://generativelanguage.googleapis.com/v1beta/openai/chat/completions",
            ),
            // Azure OpenAI: the v1 API, and a classic deployment with its API version.
            (
                "https://res.openai.azure.com/openai/v1",
                "/responses",
                "https://res.openai.azure.com/openai/v1/responses",
            ),
            (
                "https://res.openai.azure.com/openai",
                "/chat/completions",
                "https://res.openai.azure.com/openai/v1/chat/completions",
            ),
            (
                "https://res.openai.azure.com/openai/deployments/gpt-4o?api-version=2024-10-21",
                "/chat/completions",
                "https://res.openai.azure.com/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
            ),
            // Anthropic, with and without the version.
            (
                "https://api.anthropic.com",
                "/messages",
                "https://api.anthropic.com/v1/messages",
            ),
            (
                "https://api.anthropic.com/v1",
                "/messages",
                "https://api.anthropic.com/v1/messages",
            ),
            // A prefix on a gateway, and a local server.
            (
                "https://gateway.example.com/llm",
                "/chat/completions",
                "https://gateway.example.com/llm/v1/chat/completions",
            ),
            (
                "http://127.0.0.1:8000/v1",
                "/chat/completions",
                "http://127.0.0.1:8000/v1/chat/completions",
            ),
        ] {
            let read = BaseUrl::parse(base).unwrap_or_else(|e| panic!("{base}: {e}"));
            assert_eq!(read.api_url(api_path).as_str(), url, "{base}");
        }
    }

    #[test]
    fn a_version_anywhere_in_the_path_makes_it_the_apis_root() {
        assert_eq!(
            chat("https://gw.example.com/V1/openai-compat/"),
            "https://gw.example.com/V1/openai-compat/chat/completions"
        );
        assert_eq!(
            chat("https://gw.example.com/api/v2alpha1"),
            "https://gw.example.com/api/v2alpha1/chat/completions"
        );
        for not_a_version in ["v", "vllm", "v1.5-proxy", "version1", "1v"] {
            assert!(!names_a_version(not_a_version), "{not_a_version}");
            assert_eq!(
                chat(&format!("https://gw.example.com/{not_a_version}")),
                format!("https://gw.example.com/{not_a_version}/v1/chat/completions")
            );
        }
    }

    #[test]
    fn a_query_goes_on_every_request_and_a_fragment_or_another_scheme_is_refused() {
        assert_eq!(
            chat("https://gw.example.com/v1?tenant=a&region=eu"),
            "https://gw.example.com/v1/chat/completions?tenant=a&region=eu"
        );
        for (bad, why) in [
            ("ftp://example.com", "not http or https"),
            ("llm.example.com", "not a URL"),
            ("", "not a URL"),
            ("https://gw.example.com/v1#x", "fragment"),
            (
                "https://res.openai.azure.com/openai/deployments/gpt-4o",
                "add `?api-version=…`",
            ),
        ] {
            let problem = BaseUrl::parse(bad).unwrap_err();
            assert!(problem.contains(why), "{bad}: {problem}");
        }
    }
}
