//! A key over its request rate gets `429` with `Retry-After`; other keys have their own
//! bucket.

use super::{body, start_with};
use replyd::api::settings::ApiSettings;
use replyd_core::api_key::issue;
use reqwest::StatusCode;
use serde_json::Value;

/// A key over its request rate gets `429 rate_limited` with `Retry-After`, before anything is
/// written; another key of the same workspace has its own bucket; after the wait the key is
/// served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_over_its_request_rate_is_refused_with_retry_after_and_others_are_not() {
    let api = start_with(ApiSettings {
        rate_limit_per_second: 1,
        rate_limit_burst: 3,
        ..ApiSettings::default()
    })
    .await;
    let other = {
        let key = issue(&mut rand::rng());
        assert!(api.db.store.create_api_key("acme", &key).await.unwrap());
        key.token
    };
    let mut statuses = Vec::new();
    let mut standings = Vec::new();
    let mut refused = None;
    for n in 0..5 {
        let response = api
            .post(Some(&format!("press-{n}")), &api.key, &body("q"))
            .await;
        statuses.push(response.status().as_u16());
        // Every answer says the policy and where the key stands (the IETF draft's headers).
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        assert_eq!(
            header("ratelimit-policy").as_deref(),
            Some("\"caller\";q=3;w=3"),
            "request {n}, answered {}",
            response.status()
        );
        standings.push(header("ratelimit").unwrap_or_default());
        if response.status() == StatusCode::TOO_MANY_REQUESTS && refused.is_none() {
            refused = Some(response);
        }
    }
    // A token a second comes back: what is left falls by one a request, at most one more.
    assert_eq!(standings[0], "\"caller\";r=2;t=1", "{standings:?}");
    assert!(
        ["\"caller\";r=1;t=2", "\"caller\";r=2;t=1"].contains(&standings[1].as_str()),
        "{standings:?}"
    );
    // A caller with no valid key learns nothing of anyone's standing.
    let unknown = api.post(Some("press-x"), "rk_nope", &body("q")).await;
    assert_eq!(unknown.status(), StatusCode::UNAUTHORIZED);
    assert!(unknown.headers().get("ratelimit").is_none());
    assert!(unknown.headers().get("ratelimit-policy").is_none());
    // The burst of 3 within a second, then refusals (a token may come back meanwhile).
    assert_eq!(&statuses[..3], &[202, 202, 202], "{statuses:?}");
    assert!(statuses[3..].contains(&429), "{statuses:?}");
    let refused = refused.unwrap();
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=1).contains(&retry_after), "{retry_after}");
    assert_eq!(
        refused.headers()["ratelimit"],
        format!("\"caller\";r=0;t={retry_after}").as_str(),
        "a refused key has none left, until Retry-After"
    );
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["type"].as_str().unwrap().ends_with("/rate_limited"),
        "{problem}"
    );
    // Nothing was written for a refused press.
    let accepted = statuses.iter().filter(|s| **s == 202).count() as i64;
    assert_eq!(api.counts().await.0, accepted);
    // Another key is not touched by this one's bucket.
    let response = api.post(Some("other-1"), &other, &body("q")).await;
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    // After Retry-After, the key is served again.
    tokio::time::sleep(std::time::Duration::from_secs(retry_after)).await;
    let response = api.post(Some("press-9"), &api.key, &body("q")).await;
    assert_eq!(response.status(), StatusCode::ACCEPTED);
}
