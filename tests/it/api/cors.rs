//! CORS: a page of an allowed origin gets its preflight and readable answers, others none, and
//! an allowed origin no browser sends is refused by name.

use super::{body, start, start_with};
use crate::helpers::api::Api;
use replyd::api::settings::ApiSettings;
use reqwest::StatusCode;

/// A preflight as a browser sends it before a page of `origin` posts a press.
async fn preflight(api: &Api, origin: &str) -> reqwest::Response {
    api.client
        .request(reqwest::Method::OPTIONS, format!("{}/v1/replies", api.base))
        .header("Origin", origin)
        .header("Access-Control-Request-Method", "POST")
        .header(
            "Access-Control-Request-Headers",
            "authorization,content-type,idempotency-key",
        )
        .send()
        .await
        .unwrap()
}

fn header<'a>(response: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    response.headers().get(name).map(|v| v.to_str().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_an_allowed_origin_gets_its_preflight_and_its_answers_readable_and_others_none() {
    const PRODUCT: &str = "https://app.example.com";
    let api = start_with(ApiSettings {
        cors_allowed_origins: vec![PRODUCT.into()],
        ..ApiSettings::default()
    })
    .await;

    // The product's page: its preflight names it, the method and every header a press sends.
    let allowed = preflight(&api, PRODUCT).await;
    assert!(allowed.status().is_success(), "{}", allowed.status());
    assert_eq!(
        header(&allowed, "access-control-allow-origin"),
        Some(PRODUCT)
    );
    let methods = header(&allowed, "access-control-allow-methods").unwrap();
    assert!(
        methods.contains("POST") && methods.contains("GET"),
        "{methods}"
    );
    let headers = header(&allowed, "access-control-allow-headers")
        .unwrap()
        .to_ascii_lowercase();
    for wanted in [
        "authorization",
        "content-type",
        "idempotency-key",
        "last-event-id",
    ] {
        assert!(headers.contains(wanted), "{wanted} in {headers}");
    }
    assert_eq!(header(&allowed, "access-control-max-age"), Some("600"));
    assert_eq!(header(&allowed, "access-control-allow-credentials"), None);
    assert!(
        allowed.headers().get_all("vary").iter().any(|v| v
            .to_str()
            .unwrap()
            .to_ascii_lowercase()
            .contains("origin")),
        "{:?}",
        allowed.headers()
    );

    // Another site's page: the preflight names no origin, so its browser sends nothing.
    let refused = preflight(&api, "https://evil.example.net").await;
    assert_eq!(header(&refused, "access-control-allow-origin"), None);

    // The press itself, and a refusal, both readable by the product's page: the task's
    // location and whether it was a replay are exposed.
    let press = api
        .client
        .post(format!("{}/v1/replies", api.base))
        .header("Origin", PRODUCT)
        .bearer_auth(&api.key)
        .header("Idempotency-Key", "cors-1")
        .json(&body("What are the key decisions?"))
        .send()
        .await
        .unwrap();
    assert_eq!(press.status(), StatusCode::ACCEPTED);
    assert_eq!(header(&press, "access-control-allow-origin"), Some(PRODUCT));
    let exposed = header(&press, "access-control-expose-headers")
        .unwrap()
        .to_ascii_lowercase();
    for wanted in ["location", "idempotent-replayed", "retry-after"] {
        assert!(exposed.contains(wanted), "{wanted} in {exposed}");
    }
    let unauthorized = api
        .client
        .get(format!("{}/v1/quota", api.base))
        .header("Origin", PRODUCT)
        .send()
        .await
        .unwrap();
    assert_eq!(unauthorized.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        header(&unauthorized, "access-control-allow-origin"),
        Some(PRODUCT)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_allowed_origins_no_answer_names_an_origin() {
    let api = start().await;
    let answer = preflight(&api, "https://app.example.com").await;
    assert_eq!(answer.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(header(&answer, "access-control-allow-origin"), None);
}

#[test]
fn an_allowed_origin_that_no_browser_sends_is_refused_by_name() {
    crate::helpers::assert_config_refused(
        "[api]\ncors_allowed_origins = [\"https://app.example.com/\", \"*\"]\n",
        "api.cors_allowed_origins: \"https://app.example.com/\": must be scheme://host[:port] with nothing after",
    );
    crate::helpers::assert_config_refused(
        "[api]\ncors_allowed_origins = [\"*\"]\n",
        "api.cors_allowed_origins: \"*\": not an origin",
    );
}
