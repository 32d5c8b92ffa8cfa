//! The body that creates a background response: the model (the settings' default when the
//! request names none), the messages as `input`, `background: true`, and `stream` when
//! `provider.stream` is on. Apart from the calls so what is sent reads in one place.

use serde::Serialize;

use crate::provider::openai::role_name;
use replyd_core::provider::GenerationRequest;

/// The create's body asking `model` for `request`'s reply, streamed when `stream`.
pub(super) fn create_body<'a>(
    request: &'a GenerationRequest,
    model: &'a str,
    stream: bool,
) -> WireCreate<'a> {
    WireCreate {
        model,
        input: request
            .messages
            .iter()
            .map(|m| WireInput {
                role: role_name(m.role),
                content: &m.content,
            })
            .collect(),
        background: true,
        max_output_tokens: request.max_output_tokens,
        stream: stream.then_some(true),
    }
}

#[derive(Debug, Serialize)]
pub(super) struct WireCreate<'a> {
    model: &'a str,
    input: Vec<WireInput<'a>>,
    background: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_output_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) stream: Option<bool>,
}

#[derive(Debug, Serialize)]
struct WireInput<'a> {
    role: &'static str,
    content: &'a str,
}
