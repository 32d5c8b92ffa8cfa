//! The router: every route and its handler, the server span of each request, each request's
//! latency by its route's template, and the head limits checked before any handler. Unknown
//! routes and methods are problems too.

use axum::Router;
use axum::http::StatusCode;
use axum::routing::{delete, get, post};

use super::settings::ApiSettings;

use super::problem::{Problem, ProblemKind};
use super::state::ApiState;
use super::{conversations, demo, end_users, events, json_body, openapi, quota, replies};

/// The API's routes, each documented in [`super::openapi`] (a test holds the two together).
pub const ROUTES: [&str; 11] = [
    "/v1/replies",
    "/v1/replies/{task_id}",
    "/v1/replies/{task_id}/events",
    "/v1/replies/{task_id}/regenerate",
    "/v1/replies/{task_id}/cancel",
    "/v1/quota",
    "/v1/conversations/{conversation_id}/messages",
    "/v1/conversations/{conversation_id}",
    "/v1/end-user-tokens",
    "/v1/end-users/{user_id}/revoke",
    "/v1/end-users/{user_id}",
];

pub fn router(state: ApiState) -> Router {
    let [
        create,
        show,
        events,
        regenerate,
        cancel,
        quota,
        messages,
        conversation,
        tokens,
        revoke,
        end_user,
    ] = ROUTES;
    let pages = if state.settings.demo_page {
        demo::router()
    } else {
        Router::new()
    };
    let router = Router::new()
        .route(create, post(replies::create))
        .route(show, get(replies::show))
        .route(events, get(events::stream))
        .route(regenerate, post(replies::regenerate))
        .route(cancel, post(replies::cancel))
        .route(quota, get(quota::show))
        .route(messages, get(conversations::list))
        .route(conversation, delete(conversations::erase))
        .route(tokens, post(end_users::create_token))
        .route(revoke, post(end_users::revoke))
        .route(end_user, delete(end_users::erase))
        .route(
            "/openapi.json",
            get(|| async {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    openapi::document(),
                )
            }),
        )
        // Each routed request is a server span of its trace (its caller's, when it sent a
        // `traceparent`); the intake stores the span's context with the outbox row.
        .route_layer(axum::middleware::from_fn(trace_request))
        // Every answer to a caller its rate limit applies to says where it stands.
        .route_layer(axum::middleware::from_fn_with_state(
            state.limiter.policy(),
            rate_limit_headers,
        ))
        .merge(pages)
        .fallback(|| async { Problem::not_found("no such route") })
        .method_not_allowed_fallback(|| async {
            Problem::new(
                StatusCode::METHOD_NOT_ALLOWED,
                ProblemKind::MethodNotAllowed,
                "Method not allowed",
                "this route does not take that method",
            )
        })
        .layer(axum::middleware::from_fn_with_state(
            HeadLimits::of(&state.settings),
            limit_headers,
        ))
        // So the head limits' refusals are measured too. A `Router::layer` runs after
        // routing, around every route and the fallbacks, so the matched route's template is
        // there to read.
        .layer(axum::middleware::from_fn(measure_request));
    // Outermost: a preflight is answered before anything else looks at it (it carries no
    // key), and every answer to an allowed origin, a refusal too, says so, or the page could
    // not read the problem.
    match cors(&state.settings) {
        Some(cors) => router.layer(cors),
        None => router,
    }
    .with_state(state)
}

/// The CORS policy of `api.cors_allowed_origins` (tower-http's `CorsLayer`): the methods and
/// request headers the API takes, the response headers a client reads, `Vary: Origin`. None
/// without an allowed origin: a preflight then finds no route that takes `OPTIONS` (405), and
/// no answer names an origin.
fn cors(settings: &ApiSettings) -> Option<tower_http::cors::CorsLayer> {
    use axum::http::{HeaderName, HeaderValue, Method, header};
    use tower_http::cors::{AllowOrigin, CorsLayer};
    let origins: Vec<HeaderValue> = settings
        .cors_allowed_origins
        .iter()
        // Checked with the settings (`check_origin`): each is a valid header value.
        .filter_map(|origin| HeaderValue::from_str(origin).ok())
        .collect();
    if origins.is_empty() {
        return None;
    }
    Some(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(origins))
            .allow_methods([Method::GET, Method::POST, Method::DELETE])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                HeaderName::from_static("idempotency-key"),
                HeaderName::from_static("last-event-id"),
                HeaderName::from_static("traceparent"),
                HeaderName::from_static("tracestate"),
            ])
            .expose_headers([
                header::LOCATION,
                header::RETRY_AFTER,
                HeaderName::from_static("idempotent-replayed"),
                HeaderName::from_static(RATE_LIMIT),
                HeaderName::from_static(RATE_LIMIT_POLICY),
            ])
            .max_age(settings.cors_max_age()),
    )
}

/// The `route` label of a request no route took (an unknown path).
const UNMATCHED_ROUTE: &str = "unmatched";

/// The IETF draft's headers (draft-ietf-httpapi-ratelimit-headers): the policy of every
/// caller's bucket, and where this caller stands.
const RATE_LIMIT: &str = "ratelimit";
const RATE_LIMIT_POLICY: &str = "ratelimit-policy";

/// Writes `RateLimit-Policy` (`"caller";q=<burst>;w=<seconds to fill>`) and `RateLimit`
/// (`"caller";r=<requests left now>;t=<seconds until the bucket is full, or until a refused
/// caller may ask again>`) on the answer to a request whose caller was authenticated; nothing
/// when the limit is off or no caller was named (a `401` tells nobody's standing).
async fn rate_limit_headers(
    axum::extract::State(policy): axum::extract::State<Option<String>>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let Some(policy) = policy else {
        return next.run(request).await;
    };
    let note = super::rate_limit::Note::default();
    request.extensions_mut().insert(note.clone());
    let mut response = next.run(request).await;
    if let Some(standing) = note.take() {
        let headers = response.headers_mut();
        let values = [
            (RATE_LIMIT_POLICY, policy),
            (
                RATE_LIMIT,
                format!(
                    "\"caller\";r={};t={}",
                    standing.remaining, standing.reset_seconds
                ),
            ),
        ];
        for (name, value) in values {
            if let Ok(value) = axum::http::HeaderValue::from_str(&value) {
                headers.insert(name, value);
            }
        }
    }
    response
}

/// Records how long the request took to answer, labelled with the template of the route that
/// took it (axum's `MatchedPath`), never the path as sent: `/v1/replies/{task_id}` is one
/// series, whatever the task.
async fn measure_request(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or(UNMATCHED_ROUTE, |path| path.as_str())
        .to_owned();
    let method = method_label(request.method());
    let started = std::time::Instant::now();
    let response = next.run(request).await;
    crate::telemetry::http_request(
        &route,
        method,
        response.status().as_u16(),
        started.elapsed(),
    );
    response
}

/// A method as a label: HTTP's own, or `other`, so a client sending made-up methods cannot add
/// series without bound.
fn method_label(method: &axum::http::Method) -> &'static str {
    match method.as_str() {
        "GET" => "GET",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "PATCH" => "PATCH",
        "HEAD" => "HEAD",
        "OPTIONS" => "OPTIONS",
        "CONNECT" => "CONNECT",
        "TRACE" => "TRACE",
        _ => "other",
    }
}

/// Runs a routed request inside its server span and records the answer's status on it.
async fn trace_request(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use tracing::Instrument as _;
    if !crate::telemetry::trace::on() {
        return next.run(request).await;
    }
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("", |path| path.as_str())
        .to_owned();
    let span =
        crate::telemetry::trace::api_request(request.method().as_str(), &route, request.headers());
    let response = next.run(request).instrument(span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    response
}

/// What [`limit_headers`] holds a request's head to.
#[derive(Debug, Clone, Copy)]
struct HeadLimits {
    max_headers: usize,
    max_header_bytes: usize,
    max_body_bytes: usize,
}

impl HeadLimits {
    fn of(settings: &ApiSettings) -> Self {
        Self {
            max_headers: settings.max_headers,
            max_header_bytes: settings.max_header_bytes,
            max_body_bytes: settings.max_body_bytes,
        }
    }
}

/// Refuses, before any handler or database work, a request with more header fields than
/// `api.max_headers` or a header block (names and values) over `api.max_header_bytes`
/// (`431`), and one whose declared `Content-Length` is over `api.max_body_bytes` (`413`).
/// The body is not read, so a client that sent `Expect: 100-continue` is not told to send it.
async fn limit_headers(
    axum::extract::State(limits): axum::extract::State<HeadLimits>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let too_large = |detail: String| {
        Problem::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProblemKind::HeadersTooLarge,
            "Request header fields too large",
            detail,
        )
        .into_response()
    };
    let headers = request.headers();
    // `len` counts every field, a repeated name each time.
    if headers.len() > limits.max_headers {
        return too_large(format!(
            "the request has {} header fields; api.max_headers allows {}",
            headers.len(),
            limits.max_headers
        ));
    }
    let size: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if size > limits.max_header_bytes {
        return too_large(format!(
            "the request's headers take {size} bytes; api.max_header_bytes allows {}",
            limits.max_header_bytes
        ));
    }
    // hyper has already refused a Content-Length that is not one number.
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(declared) = declared
        && declared > limits.max_body_bytes as u64
    {
        return json_body::body_too_large(limits.max_body_bytes).into_response();
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_route_is_documented() {
        let doc: serde_json::Value =
            serde_json::from_str(&super::super::openapi::document()).unwrap();
        let paths: Vec<&str> = doc["paths"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        for path in super::ROUTES {
            assert!(paths.contains(&path), "{path} is not in the document");
        }
        assert_eq!(paths.len(), super::ROUTES.len());
    }
}
