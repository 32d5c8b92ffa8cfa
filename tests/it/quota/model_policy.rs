//! The workspace's model list and output cap, judged before anything is written.

use super::{policy, start};
use crate::helpers::api::Api;
use replyd::api::reply_view::Accepted;
use reqwest::StatusCode;
use serde_json::{Value, json};

impl Api {
    async fn post_json(&self, key: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(format!("{}/v1/replies", self.base))
            .bearer_auth(&self.key)
            .header("Idempotency-Key", key)
            .json(body)
            .send()
            .await
            .unwrap()
    }
}

/// The workspace's policy, judged before anything is written: a model outside its list and
/// output over its cap are `422`s naming the field and the setting; a request that names no
/// bound asks the provider for the cap; a replay is answered whatever the policy says now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_outside_the_workspace_list_or_output_over_its_cap_is_422_and_writes_nothing() {
    let api = start(policy()).await;
    let rules = replyd::store::workspaces::PolicyChange {
        allowed_models: Some(Some(vec!["gpt-4o-mini".into(), "small".into()])),
        max_output_tokens: Some(Some(500)),
        ..Default::default()
    };
    assert!(
        api.db
            .store
            .set_workspace_policy("acme", &rules)
            .await
            .unwrap()
    );

    let asked = |extra: Value| {
        let mut body = json!({"conversation_id": "c", "message": "q"});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    for (extra, field, words) in [
        (
            json!({"model": "gpt-4o"}),
            "model",
            ["`gpt-4o`", "gpt-4o-mini, small"],
        ),
        (
            json!({"max_output_tokens": 501}),
            "max_output_tokens",
            ["501", "cap of 500"],
        ),
    ] {
        let refused = api.post_json(&format!("bad-{field}"), &asked(extra)).await;
        assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY);
        let problem: Value = refused.json().await.unwrap();
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("/outside_workspace_policy"),
            "{problem}"
        );
        assert_eq!(problem["fields"], json!([field]), "{problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(words.iter().all(|w| detail.contains(w)), "{detail}");
    }
    assert_eq!(api.ledger().await, (0, 0, 0, 0, 0, 0), "nothing written");

    // No model: the default (gpt-4o-mini) is judged; no bound: the cap is asked for.
    let admitted: Accepted = api
        .post_json("ok", &asked(json!({})))
        .await
        .json()
        .await
        .unwrap();
    let task = api.db.store.read(admitted.task_id).await.unwrap().unwrap();
    assert_eq!(task.spec.request.max_output_tokens, Some(500));

    // The policy changes: the admitted key's replay is still answered; new work is refused.
    let only_small = replyd::store::workspaces::PolicyChange {
        allowed_models: Some(Some(vec!["small".into()])),
        ..Default::default()
    };
    assert!(
        api.db
            .store
            .set_workspace_policy("acme", &only_small)
            .await
            .unwrap()
    );
    let replay = api.post_json("ok", &asked(json!({}))).await;
    assert_eq!(replay.status(), StatusCode::ACCEPTED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let new_work = api.post_json("new", &asked(json!({}))).await;
    assert_eq!(new_work.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let problem: Value = new_work.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("default model `gpt-4o-mini`"),
        "{problem}"
    );
    assert_eq!(api.ledger().await.0, 1);
}
