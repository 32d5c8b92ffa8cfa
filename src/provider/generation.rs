//! What an answer becomes: the one [`Generation`] every adapter returns, built from the parts
//! each API reports in its own shape (the text, the answer's id, the model that wrote it, the
//! usage). One place for the fallbacks, so the adapters cannot drift apart on them: an answer
//! that names no model (or an empty one) was written by the model asked for, and the rate
//! signals are left for the call to add from the answer's headers. A leaf: it names nothing of
//! the adapters, which all build on it.

use serde::de::DeserializeOwned;

use replyd_core::provider::{Generation, ProviderError, RateSignals, Usage};

/// An answer that is not what its API documents, saying what is wrong with it.
pub(crate) fn malformed(message: impl Into<String>) -> ProviderError {
    ProviderError::MalformedResponse {
        message: message.into(),
    }
}

/// A success body read as `T`, the API's `what` on the wire; malformed when it is not one.
pub(crate) fn read_body<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, ProviderError> {
    serde_json::from_slice(bytes).map_err(|e| malformed(format!("body is not {what}: {e}")))
}

/// A reply's parts as an API reports them, read from a whole answer or gathered from a
/// stream's events.
#[derive(Debug, Default)]
pub(crate) struct Reply {
    /// The text, in order.
    pub text: String,
    /// The provider's id of the answer.
    pub id: Option<String>,
    /// The model the answer names, if any.
    pub model: Option<String>,
    /// The usage the provider reported, if any.
    pub usage: Option<Usage>,
}

impl Reply {
    /// Characters of text so far: what a cut or failed stream says it had.
    pub fn chars(&self) -> usize {
        self.text.chars().count()
    }

    /// The generation, with `asked_model` for a model the answer does not name and no rate
    /// signals yet (the call reads them from the answer's headers).
    pub fn generation(self, asked_model: &str) -> Generation {
        Generation {
            text: self.text,
            model: self
                .model
                .filter(|m| !m.is_empty())
                .unwrap_or_else(|| asked_model.to_owned()),
            usage: self.usage,
            provider_response_id: self.id,
            rate_signals: RateSignals::default(),
        }
    }
}

/// The usage of an answer from its two counts, whatever its API names them (`prompt_tokens`
/// and `completion_tokens`, `input_tokens` and `output_tokens`).
pub(crate) fn token_usage(prompt_tokens: u32, completion_tokens: u32) -> Usage {
    Usage {
        prompt_tokens,
        completion_tokens,
    }
}

/// An answer in which the model declined to reply (a refusal, a content filter), `why` as the
/// API said it: final, since asking again gets the same answer.
pub(crate) fn content_refused(status: u16, why: impl std::fmt::Display) -> ProviderError {
    ProviderError::Fatal {
        status,
        message: format!("content refused: {why}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_without_a_model_names_the_one_asked_for() {
        for model in [None, Some(String::new())] {
            let reply = Reply {
                text: "hi".into(),
                model,
                ..Reply::default()
            };
            assert_eq!(reply.generation("asked").model, "asked");
        }
        let named = Reply {
            model: Some("m-1".into()),
            ..Reply::default()
        };
        assert_eq!(named.generation("asked").model, "m-1");
    }
}
