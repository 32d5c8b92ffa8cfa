//! The API's OpenAPI document, generated from the handlers' and types' annotations, so it
//! cannot drift from the code. Served at `/openapi.json`, printed by `replyd openapi`, and
//! checked in as `docs/openapi.json` (a test fails when the two differ). The refusals any
//! route may answer before its handler runs are added to every operation by one modifier
//! ([`EveryRouteRefusals`]), so no route's list can leave one out; so is the `400` of a bad
//! path segment, to every operation of a route with a path parameter. Every refusal's body, a
//! problem document, is given by one modifier too ([`ProblemBodies`]).

use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::schema::{Object, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Content, ContentBuilder, Ref, RefOr, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use super::problem::{ProblemDetails, ProblemKind};
use super::replies::{self, Accepted, CreateReply, ReplyStatus, ReplyView};
use super::{conversations, end_users, events, quota};

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
        replies::cancel,
        quota::show,
        conversations::list,
        conversations::erase,
        end_users::create_token,
        end_users::revoke,
        end_users::erase
    ),
    components(schemas(
        CreateReply,
        end_users::CreateToken,
        end_users::EndUserToken,
        end_users::ErasedEndUser,
        Accepted,
        ReplyView,
        replies::UsageView,
        replies::AttemptUsageView,
        ReplyStatus,
        events::StatusEvent,
        events::DeltaData,
        events::WithdrawnData,
        quota::QuotaView,
        quota::PolicyView,
        quota::TokenQuotaView,
        quota::WorkspacePolicyView,
        super::prompt_policy::EndUserContextView,
        conversations::MessagePage,
        conversations::MessageView,
        conversations::ErasedConversation,
        ProblemDetails,
        ProblemKind
    )),
    modifiers(&BearerKey, &ProblemBodies, &EveryRouteRefusals, &RateLimitHeaders),
    tags(
        (name = "replies", description = "Reply tasks: submit, read, follow, regenerate, cancel"),
        (name = "quota", description = "Generation quotas: every new task reserves one generation, charged once"),
        (name = "conversations", description = "A conversation's messages and their replies, in the order they were written; erasing a conversation")
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
            components.add_security_scheme(
                "end_user_token",
                SecurityScheme::Http(
                    HttpBuilder::new()
                        .scheme(HttpAuthScheme::Bearer)
                        .bearer_format("JWT")
                        .description(Some(
                            "An end user's short-lived token from `POST /v1/end-user-tokens`: what a product's page holds instead of the workspace's key",
                        ))
                        .build(),
                ),
            );
        }
    }
}

/// Every refusal (`4xx`, `5xx`) is a problem document (RFC 9457), so a route's list names a
/// refusal by its status and description and its body is given here; an answer that names a
/// body of its own keeps it.
struct ProblemBodies;

impl Modify for ProblemBodies {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (status, answer) in answers(openapi) {
            if answer.content.is_empty() && (status.starts_with('4') || status.starts_with('5')) {
                answer
                    .content
                    .insert(PROBLEM_CONTENT_TYPE.into(), RefOr::T(problem_body()));
            }
        }
    }
}

/// The media type of a problem document.
const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// A problem document's body: a [`ProblemDetails`].
fn problem_body() -> Content {
    ContentBuilder::new()
        .schema(Some(Ref::from_schema_name("ProblemDetails")))
        .build()
}

/// The refusals of any route, answered before its handler: by `api::limit_headers` (the
/// head's limits) and by the HTTP server's parser (`api::parse_errors`).
struct EveryRouteRefusals;

/// The `400` of any route, appended to a route's own `400` when it has one.
const ANY_ROUTE_BAD_REQUEST: &str = "a request head the server cannot parse (`malformed_request`: a bad request line, or a header with a byte HTTP does not allow, named in the detail), or `Authorization` sent with different values (`invalid_authorization`)";

/// The `400` of a route with a path parameter ([`super::path`]), appended to its own.
const PATH_PARAMETER_BAD_REQUEST: &str = "a path segment that is not UTF-8 once percent-decoded, or holds a NUL (`invalid_path`, the segment named in the detail); the credential is checked first, so without a valid one the answer is `401` (an end user's token on a route of the key `403`)";

/// Every route's answers that do not depend on the route: `(status, description, whether it
/// replaces the route's own)`. Every route takes an API key, so its `401`, its request rate's
/// `429` and the database's `503` are said here once too (a route with a `429` or `503` of its
/// own keeps it: its own says more).
const ANY_ROUTE: [(&str, &str, bool); 6] = [
    (
        "401",
        "No API key or end user's token, or an unknown or revoked key, or a token that is expired, revoked or not signed by the workspace (`unauthorized`; `detail` says which for a token)",
        true,
    ),
    (
        "429",
        "The API key is over its request rate (`rate_limited`, `api.rate_limit_per_second`)",
        false,
    ),
    ("503", "The database cannot be reached", false),
    (
        "413",
        "A declared `Content-Length` over `api.max_body_bytes` (`body_too_large`), refused before the body is read (no `100 Continue`)",
        false,
    ),
    (
        "414",
        "A request target over 65534 bytes (`uri_too_long`)",
        true,
    ),
    (
        "431",
        "More header fields than `api.max_headers`, or headers over `api.max_header_bytes` (`headers_too_large`)",
        true,
    ),
];

impl Modify for EveryRouteRefusals {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let problem = |description: &str| {
            RefOr::T(
                ResponseBuilder::new()
                    .description(description)
                    .content(PROBLEM_CONTENT_TYPE, problem_body())
                    .build(),
            )
        };
        for (path, item) in openapi.paths.paths.iter_mut() {
            let bad_request = if path.contains('{') {
                format!("{ANY_ROUTE_BAD_REQUEST}; {PATH_PARAMETER_BAD_REQUEST}")
            } else {
                ANY_ROUTE_BAD_REQUEST.to_owned()
            };
            for operation in operations(item) {
                let responses = &mut operation.responses.responses;
                match responses.get_mut("400") {
                    Some(RefOr::T(own)) => {
                        own.description =
                            format!("{}; on any route, {bad_request}", own.description);
                    }
                    _ => {
                        let own = format!("A{}", &bad_request[1..]);
                        responses.insert("400".into(), problem(&own));
                    }
                }
                for (status, description, replaces) in ANY_ROUTE {
                    if replaces || !responses.contains_key(status) {
                        let mut answer = problem(description);
                        if status == "429"
                            && let RefOr::T(answer) = &mut answer
                        {
                            answer.headers.insert(
                                "Retry-After".into(),
                                RefOr::T(
                                    HeaderBuilder::new()
                                        .schema(Some(Object::with_type(Type::String)))
                                        .description(Some("Seconds until the key may ask again"))
                                        .build(),
                                ),
                            );
                        }
                        responses.insert(status.into(), answer);
                    }
                }
            }
        }
    }
}

/// The rate limit's headers (draft-ietf-httpapi-ratelimit-headers), on every answer to a
/// caller whose credential was accepted (`api::routes::rate_limit_headers`). Answers given
/// before the credential is read (a head over its limits) or that refuse it (`401`) name no
/// caller, so they carry none.
struct RateLimitHeaders;

/// Statuses answered before a caller is known.
const NO_CALLER: [&str; 4] = ["401", "413", "414", "431"];

impl Modify for RateLimitHeaders {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let header = |description: &str| {
            RefOr::T(
                HeaderBuilder::new()
                    .schema(Some(Object::with_type(Type::String)))
                    .description(Some(description))
                    .build(),
            )
        };
        for (status, answer) in answers(openapi) {
            if NO_CALLER.contains(&status.as_str()) {
                continue;
            }
            answer.headers.insert(
                "RateLimit-Policy".into(),
                header(
                    "The bucket every caller has, `\"caller\";q=<burst>;w=<seconds an empty bucket takes to fill>`; sent when `api.rate_limit_per_second` is on and the credential was accepted",
                ),
            );
            answer.headers.insert(
                "RateLimit".into(),
                header(
                    "Where this caller stands, `\"caller\";r=<requests it may send at once now>;t=<seconds until its bucket is full, or, refused, until it may ask again>`; sent with `RateLimit-Policy`",
                ),
            );
        }
    }
}

/// Every answer of every operation, with its status; an answer given by reference has its
/// own place in the document and none here.
fn answers(
    openapi: &mut utoipa::openapi::OpenApi,
) -> impl Iterator<Item = (&String, &mut utoipa::openapi::Response)> {
    openapi
        .paths
        .paths
        .values_mut()
        .flat_map(operations)
        .flat_map(|operation| operation.responses.responses.iter_mut())
        .filter_map(|(status, answer)| match answer {
            RefOr::T(answer) => Some((status, answer)),
            RefOr::Ref(_) => None,
        })
}

/// The operations of a route, whichever methods it takes.
fn operations(
    item: &mut utoipa::openapi::PathItem,
) -> impl Iterator<Item = &mut utoipa::openapi::path::Operation> {
    [
        &mut item.get,
        &mut item.put,
        &mut item.post,
        &mut item.delete,
        &mut item.patch,
    ]
    .into_iter()
    .flatten()
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
    use super::ProblemKind;
    use replyd_core::domain::limits;
    use serde_json::Value;

    /// The generated document, parsed.
    fn parsed() -> Value {
        serde_json::from_str(&super::document()).unwrap()
    }

    /// Every operation of the document, with its path and method.
    fn operations(doc: &Value) -> impl Iterator<Item = (&String, &String, &Value)> {
        doc["paths"]
            .as_object()
            .unwrap()
            .iter()
            .flat_map(|(path, item)| {
                let methods = item.as_object().unwrap().iter();
                methods.map(move |(method, operation)| (path, method, operation))
            })
    }

    /// Every answer of every operation, with its path, method and status.
    fn answers(doc: &Value) -> impl Iterator<Item = (&String, &String, &String, &Value)> {
        operations(doc).flat_map(|(path, method, operation)| {
            let answers = operation["responses"].as_object().unwrap().iter();
            answers.map(move |(status, answer)| (path, method, status, answer))
        })
    }

    #[test]
    fn the_checked_in_document_is_the_generated_one() {
        let checked_in = include_str!("../../docs/openapi.json");
        assert!(
            checked_in == super::document(),
            "docs/openapi.json differs from the code's document: run `cargo run -q -- openapi > docs/openapi.json`"
        );
    }

    #[test]
    fn the_schema_states_the_bounds_the_api_keeps() {
        let doc = parsed();
        let fields = &doc["components"]["schemas"]["CreateReply"]["properties"];
        for (field, limit) in [
            ("conversation_id", limits::MAX_CONVERSATION_ID_BYTES),
            ("document_version", limits::MAX_DOCUMENT_VERSION_BYTES),
            ("model", limits::MAX_MODEL_BYTES),
        ] {
            assert_eq!(
                fields[field]["maxLength"], limit,
                "{field}: {}",
                fields[field]
            );
        }
    }

    #[test]
    fn the_document_lists_every_problem_kind_by_its_name() {
        let doc = parsed();
        let listed: Vec<&str> = doc["components"]["schemas"]["ProblemKind"]["enum"]
            .as_array()
            .expect("ProblemKind is an enum of strings")
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let names: Vec<&str> = ProblemKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(listed, names);
        for kind in ProblemKind::ALL {
            assert_eq!(
                serde_json::to_value(kind).unwrap(),
                kind.as_str(),
                "{kind:?}"
            );
        }
    }

    #[test]
    fn answers_to_a_known_caller_say_their_rate_limit_headers() {
        let doc = parsed();
        for (path, method, status, answer) in answers(&doc) {
            let named = answer["headers"].get("RateLimit").is_some()
                && answer["headers"].get("RateLimit-Policy").is_some();
            assert_eq!(
                named,
                !super::NO_CALLER.contains(&status.as_str()),
                "{method} {path} {status}"
            );
        }
    }

    #[test]
    fn every_refusal_is_a_problem_document() {
        let doc = parsed();
        let problem = serde_json::json!({"application/problem+json": {"schema": {"$ref": "#/components/schemas/ProblemDetails"}}});
        for (path, method, status, answer) in answers(&doc) {
            if status.starts_with('4') || status.starts_with('5') {
                assert_eq!(answer["content"], problem, "{method} {path} {status}");
            }
        }
    }

    #[test]
    fn every_operation_lists_the_refusals_of_any_route() {
        let doc = parsed();
        for (path, method, operation) in operations(&doc) {
            let responses = &operation["responses"];
            for status in ["400", "413", "414", "431"] {
                assert_eq!(
                    responses[status]["content"]["application/problem+json"]["schema"]["$ref"],
                    "#/components/schemas/ProblemDetails",
                    "{method} {path} {status}"
                );
            }
            let bad_request = responses["400"]["description"].as_str().unwrap();
            assert!(bad_request.contains("malformed_request"), "{method} {path}");
            assert_eq!(
                bad_request.contains("invalid_path"),
                path.contains('{'),
                "{method} {path}: a bad segment is a 400 of every route with one"
            );
            assert!(
                responses["431"]["description"]
                    .as_str()
                    .unwrap()
                    .contains("api.max_headers"),
                "{method} {path}"
            );
        }
    }
}
