//! Outages along the chain: a record the broker refuses fails its task and holds back nothing
//! else, and failed tasks retried after an outage get one new reply each.

use std::time::Duration;

use super::{LIMIT, front, mock, read_events, replyd, reservations};
use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::wait_until;
use replyd::api::reply_view::{Accepted, ReplyStatus};
use serde_json::json;

/// Sets the topic's `max.message.bytes`: records larger than `bytes` are refused by the broker.
async fn limit_record_size(app: &TestApp, bytes: usize) {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
    let admin: AdminClient<_> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &app.bootstrap)
        .create()
        .unwrap();
    let limit = bytes.to_string();
    let altered = admin
        .alter_configs(
            &[AlterConfig::new(ResourceSpecifier::Topic(&app.topic))
                .set("max.message.bytes", &limit)],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap();
    assert!(altered.iter().all(Result::is_ok), "{altered:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_broker_refuses_fails_its_task_and_holds_back_nothing_else() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    limit_record_size(&app, 4_000).await;
    let front = front(&app).await;
    // Two rows for one partition, in one relay batch: one the topic cannot take, one it can
    // (in another conversation: a message after the big one would carry it as history).
    let big = front.send("press-big", &"x".repeat(8_000)).await;
    let small: Accepted = front
        .client
        .post(format!("{}/v1/replies", front.base))
        .bearer_auth(&front.key)
        .header("Idempotency-Key", "press-small")
        .json(&json!({"conversation_id": "conv-2", "message": "q"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let stream = front.events(&big, None).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");

    front.wait_until_completed(&small).await;
    let views = read_events(stream).await;
    let last = views.last().expect("the stream told the end");
    assert_eq!(last.status, ReplyStatus::Failed, "{views:?}");
    assert!(
        last.failure.as_deref().is_some_and(|f| f
            .contains("the broker refused the task's record for good")
            && f.contains("max.message.bytes")),
        "{last:?}"
    );
    // Nothing ran for it: its reservation is released; its row is refused, not unpublished.
    assert_eq!(reservations(&app).await, (0, 1, 1, 0));
    let row = app
        .db
        .raw_client()
        .await
        .query_one(
            "SELECT count(*) FILTER (WHERE refused_at IS NOT NULL), \
             count(*) FILTER (WHERE published_at IS NOT NULL) FROM outbox",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (1, 1));
    // The relay is ready: a refused row is not a lag.
    let addr = app.observability_addr("relay").expect("the relay's probes");
    wait_until("the relay is ready", LIMIT, || async {
        reqwest::get(format!("http://{addr}/readyz"))
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.outbox_unpublished, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_tasks_retried_after_an_outage_get_one_new_reply_each_and_only_once() {
    // A provider outage: every call is a 500 until the budget is spent, so every task fails.
    // A 500 cannot say the provider did nothing, so the reservations stay held (I8).
    let config = WorkerConfig {
        default_max_attempts: 2,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, mock(), config).await;
    app.set_faults(json!({"error_rate": 1.0, "error_status": 500}))
        .await;
    let front = front(&app).await;
    assert!(
        app.db
            .store
            .set_quota("acme", Some(10), 86_400)
            .await
            .unwrap()
    );
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let mut presses = Vec::new();
    for i in 0..3 {
        presses.push(front.send(&format!("press-{i}"), &format!("q{i}")).await);
    }
    // And one a producer published straight to the topic (no API, no quota).
    let produced = crate::helpers::task_spec(2);
    app.produce_tasks(std::slice::from_ref(&produced), 1).await;
    for press in &presses {
        front.wait_until_status(press, ReplyStatus::Failed).await;
    }
    app.wait_until_terminal(&[produced.task_id], LIMIT).await;
    assert_eq!(reservations(&app).await, (3, 0, 0, 0));

    // The outage ends; the operator retries what failed during it.
    app.set_faults(json!({})).await;
    let retry = |args: &[&str]| {
        let mut all = vec!["tasks", "retry", "--json"];
        all.extend_from_slice(args);
        let out = replyd(&app, &all);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let dry = retry(&["--reason-contains", "500", "--dry-run"]);
    assert_eq!(
        (dry["selected"].as_u64(), dry["retried"].as_u64()),
        (Some(4), Some(4)),
        "{dry}"
    );
    let done = retry(&["--reason-contains", "500", "--max-attempts", "3"]);
    assert_eq!(done["retried"].as_u64(), Some(4), "{done}");
    let new_tasks: Vec<replyd_core::domain::TaskId> = done["tasks"]
        .as_object()
        .unwrap()
        .values()
        .map(|id| {
            replyd_core::domain::TaskId::from(id.as_str().unwrap().parse::<uuid::Uuid>().unwrap())
        })
        .collect();
    app.wait_until_terminal(&new_tasks, LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;

    // One new reply each; the failed tasks stay failed (their reservations still held, for
    // the reconciler); the new ones were admitted by the quota and charged once; nothing
    // breaks an invariant.
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(
        (report.tasks, report.completed, report.failed),
        (8, 4, 4),
        "{report:#?}"
    );
    assert_eq!(report.mock_generations, Some(4), "{report:#?}");
    assert_eq!(reservations(&app).await, (3, 3, 0, 0));
    for press in &presses {
        assert_eq!(front.view(press).await.status, ReplyStatus::Failed);
    }
    // A second run finds nothing left to retry.
    let again = retry(&["--reason-contains", "500"]);
    assert_eq!(
        (again["selected"].as_u64(), again["retried"].as_u64()),
        (Some(0), Some(0)),
        "{again}"
    );
}
