//! The event stream of a reply: each state until completion, an end even when notifications
//! are lost, listening only while something waits, no event for a lease renewal, a resumed
//! stream gets only what it lacks, and a revoked key ends it.

use std::time::Duration;

use super::{EventStream, Front, LIMIT, front, mock, read_events, read_events_with_ids};
use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::wait_until;
use replyd::api::reply_view::{ReplyStatus, ReplyView};
use replyd_core::api_key::issue;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_delivers_each_state_and_ends_at_completion() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    let accepted = front.send("press-1", "q").await;
    // Open before anything runs: the first event is the pending state.
    let stream = front.events(&accepted, None).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let views = read_events(stream).await;
    assert_eq!(views.first().map(|v| v.status), Some(ReplyStatus::Pending));
    let last = views.last().unwrap();
    assert_eq!(last.status, ReplyStatus::Completed);
    assert!(last.reply.is_some());

    // Opened after completion: the terminal state at once, then the end.
    let late = read_events_with_ids(front.events(&accepted, None).await).await;
    assert_eq!(late.len(), 1);
    assert_eq!(late[0].1.status, ReplyStatus::Completed);
    // A reconnect that already saw it (Last-Event-ID) gets nothing again, and the end.
    let resumed = read_events(front.events(&accepted, Some(&late[0].0)).await).await;
    assert!(resumed.is_empty(), "{resumed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_notifications_are_lost_still_ends() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    let accepted = front.send("press-1", "q").await;
    let stream = front.events(&accepted, None).await;
    // Kill the API's listening session while the task runs: its notifications are lost.
    let client = app.db.raw_client().await;
    let listener = format!(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE application_name = 'replyd-api-listener {}'",
        std::process::id()
    );
    wait_until("the API's listener was killed", LIMIT, || async {
        client
            .query_one(&listener, &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            > 0
    })
    .await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let views = read_events(stream).await;
    assert_eq!(views.last().map(|v| v.status), Some(ReplyStatus::Completed));
}

/// Every listening session slows every notifying commit of the database, so a process listens
/// only while something of it waits for a notification: the API while a stream is open, the
/// worker while a record is parked (a running call checks its lease instead,
/// `worker.lease_check_ms`); the relay always. Once nothing has needed it for
/// `database.listen_idle_ms` the session ends, and the next need starts it again without
/// losing an event. (A parked record's listening: `worker_e2e`'s listener tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_listens_only_while_something_waits_for_notifications() {
    let config = WorkerConfig {
        listen_idle_ms: 300,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(2, mock(), config).await;
    app.db.store.create_workspace("acme").await.unwrap();
    let key = issue(&mut rand::rng());
    app.db.store.create_api_key("acme", &key).await.unwrap();
    app.spawn_process("serve", "serve");
    let addr = app.wait_for_api_addr("serve", LIMIT).await;
    let front = Front {
        base: format!("http://{addr}"),
        key: key.token,
        key_id: key.key_id,
        client: reqwest::Client::new(),
        _stop: CancellationToken::new().drop_guard(),
    };
    let client = app.db.raw_client().await;
    let pid = app.pid("serve").to_string();
    let sessions = || {
        let (client, pid) = (&client, &pid);
        async move {
            let rows = client
                .query(
                    "SELECT application_name FROM pg_stat_activity \
                     WHERE application_name LIKE 'replyd-%' AND application_name LIKE '% ' || $1",
                    &[pid],
                )
                .await
                .unwrap();
            let names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
            let has = |prefix: &str| names.iter().any(|n| n.starts_with(prefix));
            (
                has("replyd-api-listener "),
                has("replyd-listener "),
                has("replyd-relay "),
            )
        }
    };
    wait_until("the relay listens", LIMIT, || async { sessions().await.2 }).await;
    assert_eq!(
        sessions().await,
        (false, false, true),
        "with no stream open and no work, only the relay listens"
    );

    for press in ["press-1", "press-2"] {
        // A call that lasts, so both needs overlap while the stream is read.
        let accepted = front.send(press, "[mock:latency_ms=1500] q").await;
        let stream = front.events(&accepted, None).await;
        wait_until("the API listens while the call runs", LIMIT, || async {
            let running: bool = client
                .query_one(
                    "SELECT status = 'running' FROM reply_tasks WHERE task_id = $1",
                    &[&accepted.task_id.as_uuid()],
                )
                .await
                .unwrap()
                .get(0);
            running && sessions().await.0
        })
        .await;
        // Longer than a session takes to connect here: a call that listened would be seen.
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            !sessions().await.1,
            "{press}: the worker does not listen for its running call"
        );
        let views = read_events(stream).await;
        assert_eq!(
            views.last().map(|v| v.status),
            Some(ReplyStatus::Completed),
            "{press}: the stream heard the end (the second press starts a new session)"
        );
        wait_until("the API and the worker stop listening", LIMIT, || async {
            sessions().await == (false, false, true)
        })
        .await;
    }
    assert!(
        app.log_lines_with("serve", &["listening for task status notifications"]) >= 2,
        "each of the two presses started the API's session"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_renewal_is_no_event_and_a_resumed_stream_gets_only_what_it_lacks() {
    let config = WorkerConfig {
        lease_ms: 2_000,
        renew_interval_ms: 300,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, mock(), config).await;
    let front = front(&app).await;
    // A 3 s call: the lease is renewed about ten times while it runs.
    let accepted = front.send("press-1", "[mock:latency_ms=3000] q").await;
    let whole = tokio::spawn(read_events_with_ids(front.events(&accepted, None).await));
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    front
        .wait_until_status(&accepted, ReplyStatus::Running)
        .await;
    let mut mid_call = EventStream::of(front.events(&accepted, None).await);
    let (running_id, running) = mid_call.next().await.expect("the current state first");
    assert_eq!(running.status, ReplyStatus::Running);
    drop(mid_call);

    // A reconnect that has the running state gets the rest, not the same state again.
    let resumed = read_events(front.events(&accepted, Some(&running_id)).await).await;
    let statuses = |views: &[ReplyView]| views.iter().map(|v| v.status).collect::<Vec<_>>();
    assert_eq!(statuses(&resumed), [ReplyStatus::Completed], "{resumed:?}");
    let whole: Vec<ReplyView> = whole.await.unwrap().into_iter().map(|(_, v)| v).collect();
    assert_eq!(
        statuses(&whole),
        [
            ReplyStatus::Pending,
            ReplyStatus::Running,
            ReplyStatus::Completed
        ],
        "one event per state, whatever the renewals: {whole:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_opened_before_its_key_was_revoked_ends_and_its_reconnect_gets_401() {
    // No relay, no worker: the task stays pending and its stream would stay open for good.
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    let accepted = front.send("press-1", "q").await;
    let mut stream = EventStream::of(front.events(&accepted, None).await);
    let (_, pending) = stream.next().await.expect("the current state first");
    assert_eq!(pending.status, ReplyStatus::Pending);

    app.db.store.revoke_api_key(&front.key_id).await.unwrap();

    let rest = tokio::time::timeout(LIMIT, stream.next())
        .await
        .expect("the stream of a revoked key ends");
    assert!(rest.is_none(), "no state after the revocation: {rest:?}");
    let reconnect = front.events(&accepted, None).await;
    assert_eq!(reconnect.status(), reqwest::StatusCode::UNAUTHORIZED);
}
