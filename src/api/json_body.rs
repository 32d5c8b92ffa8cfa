//! A request body read as JSON: sent as JSON, within `api.max_body_bytes`, and a JSON object
//! of the type asked for, each failure a problem naming it. Apart from the replies' handlers
//! because every handler that takes a body (and the router's head check of its declared
//! length) reads it the same way.

use axum::body::{Body, to_bytes};
use axum::http::{HeaderMap, StatusCode, header};
use serde::Deserialize;

use super::problem::{Problem, ProblemKind};
use super::state::ApiState;

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"))
}

/// A body over `api.max_body_bytes`: declared so (refused before it is read), or found so
/// while reading one of unknown length.
pub(super) fn body_too_large(limit: usize) -> Problem {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        ProblemKind::BodyTooLarge,
        "Body too large",
        format!("the body is over the limit of {limit} bytes (api.max_body_bytes)"),
    )
}

/// A JSON object read as `T`, and no other JSON value. serde's derived structs also take an
/// array of their fields in order (`["c", "hello", "v1", null, null, 64]`), which the schema
/// does not allow: asking the deserializer for a map refuses every other value, and the map
/// is handed on to `T`'s own visitor, which keeps its refusals of duplicate and unknown
/// fields.
struct JsonObject<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for JsonObject<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectOf<T>(std::marker::PhantomData<T>);

        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for ObjectOf<T> {
            type Value = T;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }

        deserializer
            .deserialize_map(ObjectOf(std::marker::PhantomData))
            .map(JsonObject)
    }
}

/// Reads a JSON object body of `T`: a `415` if not sent as JSON, `413` over
/// `api.max_body_bytes`, `400` if not JSON, `422` if not a `T`.
pub(super) async fn parse_json<T: serde::de::DeserializeOwned>(
    state: &ApiState,
    headers: &HeaderMap,
    body: Body,
) -> Result<T, Problem> {
    if !is_json(headers) {
        return Err(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ProblemKind::UnsupportedMediaType,
            "Unsupported media type",
            "send the body as JSON with `Content-Type: application/json`",
        ));
    }
    let limit = state.settings.max_body_bytes;
    let bytes = to_bytes(body, limit)
        .await
        .map_err(|_| body_too_large(limit))?;
    let JsonObject(parsed) = serde_json::from_slice::<JsonObject<T>>(&bytes).map_err(|e| {
        use serde_json::error::Category;
        let said = super::echo::message(&e.to_string());
        match e.classify() {
            Category::Syntax | Category::Eof | Category::Io => Problem::bad_request(
                ProblemKind::MalformedJson,
                format!("the body is not JSON: {said}"),
            ),
            Category::Data => Problem::invalid_body(format!(
                "the body does not match the request schema: {said}"
            )),
        }
    })?;
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body of the replies' kind: fields by name, unknown ones refused.
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct CreateReply {
        conversation_id: String,
        #[allow(dead_code)] // only read to be refused when missing or duplicated
        message: String,
    }

    #[test]
    fn only_a_json_object_is_a_body_and_its_refusals_stay() {
        let parse = |text: &str| {
            serde_json::from_str::<JsonObject<CreateReply>>(text)
                .map(|JsonObject(c)| c.conversation_id)
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            parse(r#"{"conversation_id":"c","message":"m"}"#),
            Ok("c".to_owned())
        );
        for not_an_object in [r#"["c","hello","v1",null,null,64]"#, r#""c""#, "7", "null"] {
            let refused = parse(not_an_object).unwrap_err();
            assert!(refused.contains("expected a JSON object"), "{refused}");
        }
        let duplicate = parse(r#"{"conversation_id":"a","conversation_id":"b","message":"m"}"#);
        assert!(
            duplicate
                .unwrap_err()
                .contains("duplicate field `conversation_id`")
        );
        let unknown = parse(r#"{"conversation_id":"a","message":"m","x":1}"#);
        assert!(unknown.unwrap_err().contains("unknown field `x`"));
    }
}
