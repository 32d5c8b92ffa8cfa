//! A token quota: admission holds each request's ceiling, and each settlement charges the
//! reply's reported usage (or the ceiling when it reported none) once.

use std::time::Duration;

use super::{policy, start};
use crate::helpers::api::Api;
use replyd::api::reply_view::Accepted;
use replyd_core::domain::TaskId;
use replyd_core::lease::ClaimOutcome;
use reqwest::StatusCode;
use serde_json::{Value, json};

impl Api {
    /// Plays a worker that completes the task with a reply whose meta reports `usage`
    /// (the `Generation`, as the worker saves it), or none.
    async fn complete_reporting(&self, task: TaskId, usage: Option<(u32, u32)>) {
        let lease = self.claim(task).await;
        let meta = replyd_core::provider::Generation {
            text: "the answer".into(),
            model: "m".into(),
            usage: usage.map(
                |(prompt_tokens, completion_tokens)| replyd_core::provider::Usage {
                    prompt_tokens,
                    completion_tokens,
                },
            ),
            provider_response_id: None,
            rate_signals: Default::default(),
        };
        self.db
            .store
            .complete(&lease, "the answer", Some(&meta))
            .await
            .unwrap();
    }

    /// Each reservation's (token_ceiling, tokens_charged), oldest first.
    async fn token_ledger(&self) -> Vec<(i64, Option<i64>)> {
        self.db
            .raw_client()
            .await
            .query(
                "SELECT token_ceiling, tokens_charged FROM quota_reservations ORDER BY created_at",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }
}

/// A token quota: admission holds each request's ceiling (its prompt's bytes, 8 a message, and
/// its output bound), refuses what does not fit with a `429` that says so, and each settlement
/// charges the reply's reported usage, or the ceiling when it reported none, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_quota_reserves_the_ceiling_and_settles_once_to_the_reported_usage() {
    let api = start(policy()).await;
    assert!(
        api.db
            .store
            .set_token_limit("acme", Some(10_000))
            .await
            .unwrap()
    );
    let cap = replyd::store::workspaces::PolicyChange {
        max_output_tokens: Some(Some(4_000)),
        ..Default::default()
    };
    assert!(
        api.db
            .store
            .set_workspace_policy("acme", &cap)
            .await
            .unwrap()
    );
    // "q" is 1 byte: a ceiling of 1 + 8 + 4,000. The second press in the conversation carries
    // the first message as its history (no reply yet): its ceiling holds it, 4,018.
    let first: Accepted = api.press("k1", "q").await.json().await.unwrap();
    let second: Accepted = api.press("k2", "q").await.json().await.unwrap();
    let quota = api.quota().await;
    assert_eq!(
        (
            &quota["tokens"]["reserved"],
            &quota["tokens"]["remaining"],
            &quota["workspace_policy"]["max_output_tokens"]
        ),
        (&json!(8_027), &json!(1_973), &json!(4_000)),
        "{quota}"
    );
    let refused = api.press("k3", "q").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers().contains_key("retry-after"));
    let problem: Value = refused.json().await.unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("up to 4027 tokens")
            && detail.contains("10000 tokens per 1d")
            && detail.contains("8027 held"),
        "{detail}"
    );
    assert_eq!(api.ledger().await.0, 2, "the refused request wrote nothing");

    api.complete_reporting(first.task_id, Some((12, 30))).await;
    api.complete_reporting(second.task_id, None).await;
    assert_eq!(
        api.token_ledger().await,
        vec![(4_009, Some(42)), (4_018, Some(4_018))],
        "the reported usage, and the ceiling for a reply that reported none"
    );
    let tokens = api.db.store.quota("acme").await.unwrap().unwrap().tokens;
    assert_eq!((tokens.used, tokens.reserved), (42 + 4_018, 0));

    // Settled once: the completed task is not claimed again, and settling it again (as the
    // reconciler mends a missed settlement) changes nothing.
    assert_eq!(
        api.db
            .store
            .claim(first.task_id, "w-late", Duration::from_secs(30))
            .await
            .unwrap()
            .label(),
        ClaimOutcome::AlreadyCompleted.label()
    );
    assert_eq!(
        api.db
            .store
            .settle_terminal(first.task_id, "w-late", "again")
            .await
            .unwrap(),
        None
    );
    let again = api.db.store.quota("acme").await.unwrap().unwrap().tokens;
    assert_eq!(again, tokens);

    // Room again: 10,000 − 4,060 holds another, with both turns and their replies ("the
    // answer", 10 bytes) as its history: 2 × (1 + 8) + 2 × (10 + 8) + 1 + 8 + 4,000 = 4,063.
    assert_eq!(api.press("k3", "q").await.status(), StatusCode::ACCEPTED);
    assert_eq!(api.token_ledger().await[2], (4_063, None));
}
