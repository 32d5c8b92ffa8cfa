//! The API's OpenAPI document, generated from the handlers' and types' annotations, so it
//! cannot drift from the code. Served at `/openapi.json`, printed by `replyd openapi`, and
//! checked in as `docs/openapi.json` (a test fails when the two differ).

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::problem::ProblemDetails;
use super::replies::{self, Accepted, CreateReply, ReplyStatus, ReplyView};
use super::{events, quota};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "replyd API",
        description = "Submit a user's message for an LLM reply, at most one reply per press of Send, and follow it to completion. Every call takes `Authorization: Bearer <API key>`; the key names the workspace. Errors are `application/problem+json` (RFC 9457).",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    paths(
        replies::create,
        replies::show,
        events::stream,
        replies::regenerate,
        quota::show
    ),
    components(schemas(
        CreateReply,
        Accepted,
        ReplyView,
        ReplyStatus,
        events::StatusEvent,
        quota::QuotaView,
        quota::PolicyView,
        ProblemDetails
    )),
    modifiers(&BearerKey),
    tags(
        (name = "replies", description = "Reply tasks: submit, read, follow, regenerate"),
        (name = "quota", description = "Generation quotas: every new task reserves one generation, charged once")
    ),
)]
struct ApiDoc;

/// The one security scheme: the workspace's API key as a bearer token.
struct BearerKey;

impl Modify for BearerKey {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        if let Some(components) = openapi.components.as_mut() {
            components.add_security_scheme(
                "api_key",
                SecurityScheme::Http(
                    HttpBuilder::new()
                        .scheme(HttpAuthScheme::Bearer)
                        .description(Some(
                            "An API key from `replyd api-key create --workspace W`",
                        ))
                        .build(),
                ),
            );
        }
    }
}

/// The document as pretty JSON with a final newline, byte for byte what `docs/openapi.json`
/// holds.
pub fn document() -> String {
    let mut doc = ApiDoc::openapi();
    // The crate's version, not the generator's default, names the API's version.
    doc.info.version = env!("CARGO_PKG_VERSION").to_owned();
    let mut text = doc
        .to_pretty_json()
        // A document of plain strings and maps always serializes.
        .expect("the OpenAPI document serializes");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_checked_in_document_is_the_generated_one() {
        let checked_in = include_str!("../../docs/openapi.json");
        assert!(
            checked_in == super::document(),
            "docs/openapi.json differs from the code's document: run `cargo run -q -- openapi > docs/openapi.json`"
        );
    }

    #[test]
    fn every_route_is_documented() {
        let doc: serde_json::Value = serde_json::from_str(&super::document()).unwrap();
        let paths: Vec<&str> = doc["paths"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        for path in super::super::ROUTES {
            assert!(paths.contains(&path), "{path} is not in the document");
        }
        assert_eq!(paths.len(), super::super::ROUTES.len());
    }
}
