//! Refusals over real HTTP: every one is problem+json (RFC 9457), none is a 5xx, and none
//! echoes caller input without bound.
//!
//! A path parameter that cannot be an id (not UTF-8 once percent-decoded, or holding a NUL)
//! is refused by every route that has one, for every kind of caller, in one order: who asks
//! first (no credential `401`, an end user's token on a route of the key `403`), then the
//! path (`400 invalid_path`). The routes are read from the OpenAPI document, so a route added
//! later is tried too.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::api::{self, Api};
use replyd::api::settings::ApiSettings;
use replyd_core::quota::QuotaSettings;

async fn start() -> Api {
    Api::start(
        ApiSettings::default(),
        api::limits(10_000),
        QuotaSettings::default().policy(),
    )
    .await
}

/// An operation of a route with a path parameter, as the OpenAPI document lists it.
struct Operation {
    method: Method,
    /// `/v1/replies/{task_id}/events`
    template: String,
    /// `task_id`
    parameter: String,
    /// Whether an end user's token may call it (its `security` names `end_user_token`).
    end_users_may_call: bool,
    /// The statuses the document says it answers.
    documented: Vec<u16>,
}

fn operations_with_a_path_parameter() -> Vec<Operation> {
    let doc: Value = serde_json::from_str(&replyd::api::openapi::document()).unwrap();
    let mut found = Vec::new();
    for (template, item) in doc["paths"].as_object().unwrap() {
        let Some(start) = template.find('{') else {
            continue;
        };
        let parameter = template[start + 1..template.find('}').unwrap()].to_owned();
        for (method, operation) in item.as_object().unwrap() {
            let security = operation["security"].to_string();
            found.push(Operation {
                method: method.to_uppercase().parse().unwrap(),
                template: template.clone(),
                parameter: parameter.clone(),
                end_users_may_call: security.contains("end_user_token"),
                documented: operation["responses"]
                    .as_object()
                    .unwrap()
                    .keys()
                    .map(|status| status.parse().unwrap())
                    .collect(),
            });
        }
    }
    found
}

/// What a refusal was: its status, its problem's kind (`type`'s last segment), its `detail`
/// and its body's length; or what is wrong with it when it is not problem+json.
async fn problem_of(
    response: reqwest::Response,
) -> Result<(StatusCode, String, String, usize), String> {
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.text().await.unwrap();
    let start: String = body.chars().take(200).collect();
    if content_type.as_deref() != Some("application/problem+json") {
        return Err(format!("{status} {content_type:?}: {start}"));
    }
    let problem: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {start}"))?;
    if problem["status"] != json!(status.as_u16()) {
        return Err(format!("{status} says {}", problem["status"]));
    }
    let kind = problem["type"]
        .as_str()
        .unwrap_or_default()
        .rsplit('/')
        .next();
    Ok((
        status,
        kind.unwrap_or_default().to_owned(),
        problem["detail"].as_str().unwrap_or_default().to_owned(),
        body.len(),
    ))
}

/// At most the first 200 characters of `text`, for a failure's message.
fn start_of(text: &str) -> String {
    text.chars().take(200).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_path_parameter_is_a_problem_on_every_route_for_every_caller() {
    let api = start().await;
    let token = api.end_user_token("user-a").await;
    let operations = operations_with_a_path_parameter();
    assert!(
        operations.len() >= 8,
        "every route with a parameter is tried"
    );
    let mut wrong_answers = Vec::new();
    // Not UTF-8 once decoded (a lone byte, a broken sequence), and a NUL, which no id holds.
    for segment in ["%FF", "ab%C3%28", "%00", "conv%00x"] {
        for op in &operations {
            let path = op
                .template
                .replace(&format!("{{{}}}", op.parameter), segment);
            for (caller, credential) in [
                ("the key", Some(api.key.as_str())),
                ("an end user", Some(token.as_str())),
                ("no one", None),
            ] {
                let what = format!("{} {path} by {caller}", op.method);
                let mut request = api
                    .client
                    .request(op.method.clone(), format!("{}{path}", api.base))
                    .header("Idempotency-Key", uuid::Uuid::new_v4().to_string());
                if let Some(credential) = credential {
                    request = request.bearer_auth(credential);
                }
                let response = request.send().await.unwrap();
                let (status, kind, detail, _) = match problem_of(response).await {
                    Ok(problem) => problem,
                    Err(wrong) => {
                        wrong_answers.push(format!("{what}: {wrong}"));
                        continue;
                    }
                };
                let expected = match credential {
                    None => (StatusCode::UNAUTHORIZED, "unauthorized"),
                    Some(_) if caller == "an end user" && !op.end_users_may_call => {
                        (StatusCode::FORBIDDEN, "forbidden")
                    }
                    Some(_) => (StatusCode::BAD_REQUEST, "invalid_path"),
                };
                if (status, kind.as_str()) != expected {
                    wrong_answers.push(format!("{what}: {status} {kind}: {}", start_of(&detail)));
                } else if !op.documented.contains(&status.as_u16()) {
                    wrong_answers.push(format!("{what}: {status} is not in the document"));
                } else if kind == "invalid_path"
                    && !detail.contains(&format!("`{{{}}}`", op.parameter))
                {
                    wrong_answers.push(format!("{what}: the detail names no segment: {detail}"));
                }
            }
        }
    }
    assert!(
        wrong_answers.is_empty(),
        "{} wrong answers:\n{}",
        wrong_answers.len(),
        wrong_answers.join("\n")
    );
    let counts = api
        .db
        .raw_client()
        .await
        .query_one(
            "SELECT (SELECT count(*) FROM messages) + (SELECT count(*) FROM reply_tasks)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        counts.get::<_, i64>(0),
        0,
        "a refused request writes nothing"
    );
}

/// The most a problem's body may take when the request echoed back is 10 KB: the detail
/// names at most the start of what was sent, and its length.
const BOUNDED_BODY: usize = 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detail_echoes_at_most_the_start_of_what_the_caller_sent_and_its_length() {
    let api = start().await;
    let long = "x".repeat(10 * 1024);
    let get = |path: String| {
        api.client
            .get(format!("{}{path}", api.base))
            .bearer_auth(&api.key)
    };
    let post = |body: Value| {
        api.client
            .post(format!("{}/v1/replies", api.base))
            .bearer_auth(&api.key)
            .header("Idempotency-Key", uuid::Uuid::new_v4().to_string())
            .json(&body)
    };
    let cases = [
        (
            "a cursor",
            get(format!("/v1/conversations/conv-1/messages?after={long}")),
        ),
        ("a task id", get(format!("/v1/replies/{long}"))),
        (
            "a conversation",
            get(format!("/v1/conversations/{long}/messages")),
        ),
        (
            "an erased conversation",
            api.client
                .delete(format!("{}/v1/conversations/{long}", api.base))
                .bearer_auth(&api.key),
        ),
        (
            "a value of the wrong type",
            post(json!({"conversation_id": "c", "message": "m", "max_output_tokens": long})),
        ),
        (
            "an unknown field",
            post(json!({"conversation_id": "c", "message": "m", long.clone(): 1})),
        ),
    ];
    let mut wrong_answers = Vec::new();
    for (what, request) in cases {
        let (status, kind, detail, length) = match problem_of(request.send().await.unwrap()).await {
            Ok(problem) => problem,
            Err(wrong) => {
                wrong_answers.push(format!("{what}: {wrong}"));
                continue;
            }
        };
        if !status.is_client_error() {
            wrong_answers.push(format!("{what}: {status} {kind}"));
        } else if length > BOUNDED_BODY {
            wrong_answers.push(format!(
                "{what}: a body of {length} bytes ({kind}): {}",
                start_of(&detail)
            ));
        } else if !(detail.contains("xxxx…") && detail.contains("10240 bytes")) {
            wrong_answers.push(format!(
                "{what}: not the start of what was sent and its length: {detail}"
            ));
        }
    }
    assert!(
        wrong_answers.is_empty(),
        "{} wrong answers:\n{}",
        wrong_answers.len(),
        wrong_answers.join("\n")
    );
}
