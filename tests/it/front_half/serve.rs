//! `replyd serve` runs the whole chain in one process: it drains on SIGTERM, schemathesis finds
//! no server error or undocumented answer, and browsers that lose answers and double click
//! make one task per press.

use super::{Front, LIMIT, mock, read_events};
use crate::helpers::app::{TestApp, WorkerConfig};
use replyd::api::reply_view::ReplyStatus;
use replyd_core::api_key::issue;
use tokio_util::sync::CancellationToken;

/// The whole chain as `replyd serve` (two partitions, the mock) and a key of workspace `acme`;
/// returns the app, the key and the API's address.
async fn serve_with_a_key() -> (TestApp, replyd_core::api_key::IssuedKey, String) {
    let app = TestApp::start(2, mock(), WorkerConfig::default()).await;
    app.db.store.create_workspace("acme").await.unwrap();
    let key = issue(&mut rand::rng());
    app.db.store.create_api_key("acme", &key).await.unwrap();
    app.spawn_process("serve", "serve");
    let addr = app.wait_for_api_addr("serve", LIMIT).await;
    (app, key, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replyd_serve_runs_the_whole_chain_in_one_process_and_drains_on_sigterm() {
    let (app, key, addr) = serve_with_a_key().await;
    let front = Front {
        base: format!("http://{addr}"),
        key: key.token,
        key_id: key.key_id,
        client: reqwest::Client::new(),
        _stop: CancellationToken::new().drop_guard(),
    };
    let accepted = front.send("press-1", "q").await;
    let views = read_events(front.events(&accepted, None).await).await;
    assert_eq!(views.last().map(|v| v.status), Some(ReplyStatus::Completed));
    app.wait_until_committed_to_end(LIMIT).await;
    app.terminate("serve").await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (1, 1));
    assert!(!app.log_of("serve").contains(" ERROR "), "a clean shutdown");
}

/// schemathesis drives the live API from the document it serves: examples, boundary values and
/// random requests for every operation, then sequences along the document's links (create,
/// read, follow, regenerate). Every check it has must pass but `positive_data_acceptance`,
/// which cannot know that an `Idempotency-Key` it reuses with other inputs must be refused
/// (422, as documented). The whole chain runs (`replyd serve` with the mock provider), so the
/// streams it follows end, and afterwards the invariants hold over everything it made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_error_and_no_answer_outside_the_document() {
    let (app, key, addr) = serve_with_a_key().await;

    let served = reqwest::get(format!("http://{addr}/openapi.json"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        served == include_str!("../../../docs/openapi.json"),
        "/openapi.json is not docs/openapi.json"
    );

    let dir = std::env::temp_dir().join(crate::helpers::unique("schemathesis"));
    std::fs::create_dir_all(&dir).unwrap();
    let run = tokio::process::Command::new(crate::helpers::infra("SCHEMATHESIS"))
        .current_dir(&dir)
        .args(["run", &format!("http://{addr}/openapi.json")])
        .args(["--header", &format!("Authorization: Bearer {}", key.token)])
        .args([
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance",
        ])
        .args(["--max-examples", "25", "--seed", "20261201"])
        .args(["--request-timeout", "30", "--workers", "2"])
        .args(["--suppress-health-check", "all", "--no-color"])
        .env("NO_COLOR", "1")
        .output()
        .await
        .expect("schemathesis runs (installed by `make infra-up`)");
    let report = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "schemathesis failed:\n{report}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        report.lines().any(|line| line.trim() == "✅ Stateful"),
        "the stateful phase ran:\n{report}"
    );

    app.wait_until_committed_to_end(LIMIT).await;
    app.terminate("serve").await;
    let check = app.check().await;
    assert_eq!(check.violations, Vec::<String>::new(), "{check:#?}");
    assert!(check.tasks > 0, "schemathesis made tasks");
    assert_eq!(
        check.tasks,
        check.completed + check.failed + check.cancelled,
        "every task it made ended (some it stopped): {check:#?}"
    );
}

/// `replyd-lab browsers` (the demo's clients) against the whole chain: presses that lose their
/// first answer and retry with the same key, double clicks and regenerates. Every press ends
/// completed, both answers of a double click name one task, and the durable state has exactly
/// one task per press plus one per regenerate: no lost answer turned into a second task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browsers_that_lose_answers_and_double_click_make_one_task_per_press() {
    let (app, key, addr) = serve_with_a_key().await;
    let run = tokio::process::Command::new(crate::helpers::lab_bin())
        .args(["browsers", "--api", &format!("http://{addr}")])
        .args(["--presses", "40", "--concurrency", "8"])
        .args(["--lose-share", "0.5", "--lose-timeout-ms", "3"])
        .args(["--double-click-share", "0.3", "--regenerate-share", "0.3"])
        .args(["--press-limit-s", "120", "--seed", "7"])
        .env("REPLYD_API_KEY", &key.token)
        .output()
        .await
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(report["presses"], 40, "{report}");
    assert_eq!(report["unfinished"], 0, "{report}");
    assert_eq!(report["answers_disagreeing"], 0, "{report}");
    assert!(report["lost_answers"].as_u64().unwrap() > 0, "{report}");
    assert!(report["regenerates"].as_u64().unwrap() > 0, "{report}");
    let regenerates = report["regenerates"].as_i64().unwrap();

    app.wait_until_committed_to_end(LIMIT).await;
    app.terminate("serve").await;
    let check = app.check().await;
    assert_eq!(check.violations, Vec::<String>::new(), "{check:#?}");
    assert_eq!(check.duplicate_tasks, 0, "{check:#?}");
    assert_eq!(
        (check.tasks, check.completed),
        (40 + regenerates, 40 + regenerates),
        "one task per press and per regenerate: {check:#?}"
    );
    assert_eq!(check.duplicate_replies, 0, "{check:#?}");
    assert_eq!(
        (check.reservations_charged, check.reservations_open),
        (40 + regenerates, 0),
        "one charge per task, none open: {check:#?}"
    );
}
