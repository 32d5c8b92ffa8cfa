//! Processes killed along the chain: a relay between publish and mark, a worker between saving
//! the reply and committing its offset, and a crash whose tasks wait for the group rather
//! than the reconciler; each still makes one reply and one charge.

use super::{LIMIT, front, mock, reconcile, reservations};
use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::wait_until;
use replyd::api::reply_view::ReplyStatus;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_between_publish_and_mark_republishes_and_still_one_reply() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    let client = app.db.raw_client().await;
    // Hold the relay between its publish and its mark: the mark's UPDATE sleeps in a trigger
    // of this test's schema.
    client
        .batch_execute(
            "CREATE FUNCTION hold_the_mark() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM pg_sleep(120); RETURN NEW; END $$; \
             CREATE TRIGGER hold_the_mark BEFORE UPDATE ON outbox \
             FOR EACH ROW EXECUTE FUNCTION hold_the_mark();",
        )
        .await
        .unwrap();
    app.spawn_relay("relay");
    let accepted = front.send("press-1", "q").await;
    wait_until("the record is published once", LIMIT, || async {
        app.end_offsets().await.values().sum::<i64>() == 1
    })
    .await;
    // Published, not marked: the relay dies there.
    app.kill("relay");
    // Its session sleeps on in the trigger (the server notices the lost client only when it
    // next talks to it): end it, as the server's idle timeout would, then lift the hold.
    let stuck = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE query LIKE 'UPDATE outbox SET published_at%' AND pid <> pg_backend_pid()";
    wait_until("the dead relay's session is gone", LIMIT, || async {
        client.query_one(stuck, &[]).await.unwrap().get::<_, i64>(0) == 0
    })
    .await;
    client
        .batch_execute("DROP TRIGGER hold_the_mark ON outbox")
        .await
        .unwrap();
    let unpublished: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(unpublished, 1, "the mark died with the relay");

    app.spawn_relay("relay");
    app.spawn_worker("w1");
    wait_until("the record is published again", LIMIT, || async {
        app.end_offsets().await.values().sum::<i64>() == 2
    })
    .await;
    front.wait_until_completed(&accepted).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.records, report.tasks), (2, 1), "{report:#?}");
    assert_eq!(report.duplicate_replies, 0);
    assert_eq!(
        report.mock_generations,
        Some(1),
        "one generation for both records"
    );
}

/// A worker killed after the transaction that saved the reply and charged its reservation, and
/// before it committed the record's offset: the next worker gets the record again, finds the
/// task completed, and neither generates nor charges again (I8 with I1 and I3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_between_saving_the_reply_and_committing_its_offset_charges_once() {
    let config = WorkerConfig {
        // No commit before the kill: the kill always lands between the save and the commit.
        commit_interval_ms: 600_000,
        ..WorkerConfig::default()
    };
    let mut app = TestApp::start(1, mock(), config).await;
    let front = front(&app).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let accepted = front.send("press-1", "q").await;
    let saved = front.wait_until_completed(&accepted).await;
    let usage = |app: &TestApp| {
        let store = app.db.store.clone();
        async move { store.quota("acme").await.unwrap().unwrap().usage }
    };
    assert_eq!((usage(&app).await.used, usage(&app).await.reserved), (1, 0));
    assert!(
        app.committed_offsets()
            .await
            .values()
            .all(|offset| *offset < 1),
        "nothing is committed before the kill"
    );
    app.kill("w1");

    app.config.commit_interval_ms = 200;
    app.spawn_worker("w2");
    // w2 commits past the record, so it was delivered to w2 again.
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (1, 1), "{report:#?}");
    assert_eq!(report.mock_generations, Some(1), "{report:#?}");
    assert_eq!(
        (report.reservations_charged, report.reservations_open),
        (1, 0),
        "{report:#?}"
    );
    assert_eq!((usage(&app).await.used, usage(&app).await.reserved), (1, 0));
    assert_eq!(front.view(&accepted).await.reply, saved.reply);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_leaves_its_tasks_to_the_group_and_not_to_the_reconciler() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    // A TTL that covers a task's retries (5 × (4 s lease + 5 s backoff) here, and 1 s of
    // refusals) but not the time its record waits for redelivery is refused: it turns one crash
    // into failed replies.
    let short = app.dir_file(
        "short-ttl.toml",
        &format!(
            "{}\n[quota]\nreservation_ttl_ms = 50000\n",
            std::fs::read_to_string(app.settings_file()).unwrap()
        ),
    );
    let checked = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
        .args(["config", "check", "--config"])
        .arg(&short)
        .env("REPLYD_RETRY__REFUSAL_BUDGET_MS", "1000")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert_eq!(checked.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("quota.reservation_ttl_ms") && stderr.contains("redelivery"),
        "{stderr}"
    );

    let front = front(&app).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let mut presses = Vec::new();
    for i in 0..3 {
        let press = front
            .send(
                &format!("press-{i}"),
                &format!("[mock:latency_ms=8000] q{i}"),
            )
            .await;
        presses.push(press);
    }
    for press in &presses {
        front.wait_until_status(press, ReplyStatus::Running).await;
    }
    app.kill("w1");
    let client = app.db.raw_client().await;
    crate::helpers::wait_until_sql(
        &client,
        "the killed worker's leases ran out",
        "SELECT bool_and(lease_until < clock_timestamp()) FROM reply_tasks",
        &[],
    )
    .await;
    // The reservations' TTL passes before the group has handed the records on.
    crate::helpers::age_open_reservations(&app.db).await;
    reconcile(&app);
    for press in &presses {
        let view = front.view(press).await;
        assert_ne!(view.status, ReplyStatus::Failed, "{view:?}");
    }
    assert_eq!(reservations(&app).await, (3, 0, 0, 0));

    app.spawn_worker("w2");
    for press in &presses {
        front.wait_until_completed(press).await;
    }
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (3, 3), "{report:#?}");
    assert_eq!(report.reservations_charged, 3, "{report:#?}");
    assert_eq!(
        report.mock_generations,
        Some(3),
        "charged = generations done: {report:#?}"
    );
}
