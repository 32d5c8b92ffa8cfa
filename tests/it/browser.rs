//! The demo page in a real browser: Debian's Chromium driven by Playwright
//! (`clients/typescript/browser-test/run.ts`) against a live `replyd serve` with the mock
//! provider, behind a proxy that injects the faults. The browser side asserts what the page
//! shows and what was sent; this side asserts, for each scenario's conversation, what the
//! server saved: tasks, messages, idempotency keys, replies and quota reservations.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use crate::helpers::app::{Routes, TestApp, WorkerConfig};
use replyd_core::api_key::{IssuedKey, issue};
use replyd_lab::mock_provider::MockSettings;

const LIMIT: Duration = Duration::from_secs(120);

/// A scenario's line of the browser report.
#[derive(Debug, serde::Deserialize)]
struct Scenario {
    scenario: String,
    conversation_id: String,
    posts: u64,
    post_keys: u64,
    streams: u64,
    polls: u64,
    retries: u64,
    tasks_shown: Vec<String>,
    replies_shown: u64,
    faults: HashMap<String, u64>,
}

/// What the server saved for one conversation.
#[derive(Debug, PartialEq, Eq)]
struct Saved {
    tasks: BTreeSet<String>,
    completed_with_reply: usize,
    failed_without_reply: usize,
    cancelled_without_reply: usize,
    /// Of those, the ones stopped once a call may have run (charged, I8).
    cancelled_after_a_call: usize,
    released: i64,
    messages: i64,
    keys: i64,
    charged: i64,
    reservations: i64,
}

async fn saved(app: &TestApp, conversation: &str) -> Saved {
    let db = app.db.raw_client().await;
    let tasks: BTreeSet<String> = db
        .query(
            "SELECT task_id::text FROM reply_tasks WHERE conversation_id = $1",
            &[&conversation],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    let one = |sql: &'static str| {
        let db = &db;
        async move {
            db.query_one(sql, &[&conversation])
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    Saved {
        completed_with_reply: one(
            "SELECT count(*) FROM reply_tasks WHERE conversation_id = $1 \
             AND status = 'completed' AND saved_response IS NOT NULL",
        )
        .await as usize,
        failed_without_reply: one(
            "SELECT count(*) FROM reply_tasks WHERE conversation_id = $1 \
             AND status = 'failed' AND saved_response IS NULL AND failure IS NOT NULL",
        )
        .await as usize,
        cancelled_without_reply: one(
            "SELECT count(*) FROM reply_tasks WHERE conversation_id = $1 \
             AND status = 'cancelled' AND saved_response IS NULL",
        )
        .await as usize,
        cancelled_after_a_call: one(
            "SELECT count(*) FROM reply_tasks WHERE conversation_id = $1 \
             AND status = 'cancelled' AND provider_may_have_run",
        )
        .await as usize,
        released: one(
            "SELECT count(*) FROM quota_reservations r JOIN reply_tasks t USING (task_id) \
             WHERE t.conversation_id = $1 AND r.state = 'released'",
        )
        .await,
        messages: one("SELECT count(*) FROM messages WHERE conversation_id = $1").await,
        keys: one(
            "SELECT count(*) FROM idempotency_keys k JOIN reply_tasks t USING (task_id) \
             WHERE t.conversation_id = $1",
        )
        .await,
        charged: one(
            "SELECT count(*) FROM quota_reservations r JOIN reply_tasks t USING (task_id) \
             WHERE t.conversation_id = $1 AND r.state = 'charged'",
        )
        .await,
        reservations: one(
            "SELECT count(*) FROM quota_reservations r JOIN reply_tasks t USING (task_id) \
             WHERE t.conversation_id = $1",
        )
        .await,
        tasks,
    }
}

/// A browser script as `make client-test` (npm test in clients/typescript) builds it.
fn built_script(name: &str) -> String {
    let script = format!(
        "{}/clients/typescript/build/browser-test/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    assert!(
        std::path::Path::new(&script).exists(),
        "{script} is missing: `make client-test` (npm test in clients/typescript) builds it"
    );
    script
}

/// The chain with a mock that takes 300 ms a reply (the scenarios that need a slow one ask for
/// it in their prompt), and a workspace `acme` with a key.
async fn app_with_acme() -> (TestApp, IssuedKey) {
    app_with_acme_on(MockSettings {
        latency_ms: 300,
        ..MockSettings::default()
    })
    .await
}

/// The chain with `mock`, and a workspace `acme` with a key.
async fn app_with_acme_on(mock: MockSettings) -> (TestApp, IssuedKey) {
    let app = TestApp::start(2, mock, WorkerConfig::default()).await;
    app.db.store.create_workspace("acme").await.unwrap();
    let key = issue(&mut rand::rng());
    app.db.store.create_api_key("acme", &key).await.unwrap();
    (app, key)
}

/// Runs a browser script in Chromium with `env`; its standard output, once it succeeded.
async fn run_script(script: &str, env: &[(&str, String)], limit: Duration) -> String {
    let run = tokio::process::Command::new("node")
        .arg(script)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env(
            "CHROMIUM",
            crate::helpers::infra_opt("CHROMIUM").unwrap_or("/usr/bin/chromium".into()),
        )
        .kill_on_drop(true)
        .output();
    let run = tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("{script} ends within {limit:?}"))
        .expect("node runs (installed by `make infra-up`)");
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(
        run.status.success(),
        "{script} failed:\n{}\n{stdout}",
        String::from_utf8_lossy(&run.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_page_keeps_one_task_per_press_through_double_clicks_lost_answers_reloads_and_cut_streams()
 {
    let script = built_script("run.js");
    let (app, key) = app_with_acme().await;
    let store = &app.db.store;
    // One generation a year: the refusal's Retry-After is far beyond the client's budget.
    store.create_workspace("capped").await.unwrap();
    assert!(
        store
            .set_quota("capped", Some(1), 365 * 24 * 3600)
            .await
            .unwrap()
    );
    let capped = issue(&mut rand::rng());
    store.create_api_key("capped", &capped).await.unwrap();
    app.route(Routes {
        env: vec![("REPLYD_API__DEMO_PAGE".into(), "true".into())],
        ..Routes::default()
    });
    app.spawn_process("serve", "serve");
    let addr = app.wait_for_api_addr("serve", LIMIT).await;

    let out = std::env::temp_dir().join(crate::helpers::unique("browser"));
    std::fs::create_dir_all(&out).unwrap();
    let stdout = run_script(
        &script,
        &[
            ("REPLYD_URL", format!("http://{addr}")),
            ("REPLYD_KEY", key.token.clone()),
            ("REPLYD_QUOTA_KEY", capped.token.clone()),
            ("REPLYD_MOCK_URL", app.mock.base_url()),
            ("REPLYD_OUT", out.display().to_string()),
        ],
        Duration::from_secs(600),
    )
    .await;
    let scenarios: Vec<Scenario> = serde_json::from_str(stdout.trim()).unwrap();
    let names: Vec<&str> = scenarios.iter().map(|s| s.scenario.as_str()).collect();
    assert_eq!(
        names,
        [
            "double_click",
            "lost_answer",
            "reload_mid_post",
            "reload_mid_reply",
            "regenerate",
            "stream_cut",
            "no_streaming",
            "quota",
            "failed",
            "stop",
            "refused"
        ]
    );

    // Every task the page made has reached its end before the durable state is read.
    app.wait_until_committed_to_end(LIMIT).await;
    eprintln!("scenario           posts keys streams polls retries tasks replies faults");
    for s in &scenarios {
        let saved = saved(&app, &s.conversation_id).await;
        eprintln!(
            "{:<18} {:>5} {:>4} {:>7} {:>5} {:>7} {:>5} {:>7} {:?}",
            s.scenario,
            s.posts,
            s.post_keys,
            s.streams,
            s.polls,
            s.retries,
            saved.tasks.len(),
            s.replies_shown,
            s.faults
        );
        // One task per press (a Regenerate is a second press); the quota's refused press and
        // the 422 wrote nothing; a task that failed or was stopped is released, not charged.
        let (presses, failed, stopped) = match s.scenario.as_str() {
            "regenerate" => (2, 0, 0),
            "failed" => (1, 1, 0),
            "stop" => (1, 0, 1),
            "refused" => (0, 0, 0),
            _ => (1, 0, 0),
        };
        let completed = presses - failed - stopped;
        let keys_sent = match s.scenario.as_str() {
            "quota" | "refused" => presses + 1,
            _ => presses,
        };
        assert_eq!(saved.tasks.len(), presses, "{}: {saved:?}", s.scenario);
        assert_eq!(
            s.post_keys as usize, keys_sent,
            "{}: one key per press",
            s.scenario
        );
        assert_eq!(saved.keys, presses as i64, "{}: {saved:?}", s.scenario);
        assert_eq!(
            saved.messages,
            i64::from(presses > 0),
            "{}: one message asked, none refused",
            s.scenario
        );
        assert_eq!(
            saved.tasks,
            s.tasks_shown.iter().cloned().collect::<BTreeSet<_>>(),
            "{}: the page shows exactly the saved tasks",
            s.scenario
        );
        assert_eq!(saved.completed_with_reply, completed, "{}", s.scenario);
        assert_eq!(saved.failed_without_reply, failed, "{}", s.scenario);
        assert_eq!(saved.cancelled_without_reply, stopped, "{}", s.scenario);
        assert_eq!(s.replies_shown as usize, completed, "{}", s.scenario);
        let ran = saved.cancelled_after_a_call;
        assert_eq!(
            (saved.reservations, saved.charged, saved.released),
            (
                presses as i64,
                (completed + ran) as i64,
                (failed + stopped - ran) as i64
            ),
            "{}: each task reserved once, charged once if it completed or was stopped once its call may have run, released if it failed or was stopped before any call",
            s.scenario
        );
    }
    let quota = store.quota("capped").await.unwrap().unwrap();
    assert_eq!((quota.usage.used, quota.usage.reserved), (1, 0));

    app.terminate("serve").await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.duplicate_tasks, 0, "{report:#?}");
    let screenshot = out.join("demo-page.png");
    assert!(
        screenshot.exists(),
        "the regenerate scenario took a screenshot"
    );
    eprintln!("screenshot: {}", screenshot.display());
}

/// Off by default: without `api.demo_page` the API serves no page, and `/demo` is the same
/// problem as any unknown route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_setting_there_is_no_page() {
    let app = TestApp::start(1, MockSettings::default(), WorkerConfig::default()).await;
    app.spawn_process("api", "api");
    let addr = app.wait_for_api_addr("api", LIMIT).await;
    let answer = reqwest::get(format!("http://{addr}/demo")).await.unwrap();
    assert_eq!(answer.status(), 404);
    assert_eq!(answer.headers()["content-type"], "application/problem+json");
    app.terminate("api").await;

    app.route(Routes {
        env: vec![("REPLYD_API__DEMO_PAGE".into(), "true".into())],
        ..Routes::default()
    });
    // Another name: the first process's log still names its address.
    app.spawn_process("api-demo", "api");
    let addr = app.wait_for_api_addr("api-demo", LIMIT).await;
    for path in ["/demo", "/demo/", "/demo/app.js", "/demo/client/index.js"] {
        let answer = reqwest::get(format!("http://{addr}{path}")).await.unwrap();
        assert_eq!(answer.status(), 200, "{path}");
        let policy = answer.headers()["content-security-policy"]
            .to_str()
            .unwrap();
        assert!(policy.starts_with("default-src 'none'"), "{path}: {policy}");
    }
    app.terminate("api-demo").await;
}

/// The demo page as a product serves it: on the product's own origin (`replyd-lab product`,
/// which alone holds the workspace's key), calling the API on another, signed in as an end
/// user whose two-second token expires mid-conversation and is refreshed; Stop during a slow
/// reply; a reload and another tab read the conversation back from the listing; another user
/// sees none of it (`clients/typescript/browser-test/product.ts`). Here: what the server saved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_page_on_a_products_origin_signs_in_with_a_token_refreshes_it_stops_and_restores()
{
    let script = built_script("product.js");
    let (app, key) = app_with_acme().await;
    // The product's origin must be known to the API (CORS) before either starts: a free port,
    // taken and given back.
    let product_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let product = format!("http://127.0.0.1:{product_port}");
    app.route(Routes {
        env: vec![(
            "REPLYD_API__CORS_ALLOWED_ORIGINS".into(),
            format!("[\"{product}\"]"),
        )],
        ..Routes::default()
    });
    app.spawn_process("serve", "serve");
    let addr = app.wait_for_api_addr("serve", LIMIT).await;
    let mut server = tokio::process::Command::new(crate::helpers::lab_bin())
        .args(["product", "--api", &format!("http://{addr}")])
        .args(["--listen", &format!("127.0.0.1:{product_port}")])
        .args(["--token-ttl-s", "2"])
        .env("REPLYD_API_KEY", &key.token)
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    crate::helpers::wait_until("the product serves its page", LIMIT, || async {
        reqwest::get(format!("{product}/demo/config.json"))
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;

    let stdout = run_script(
        &script,
        &[
            ("REPLYD_PRODUCT_URL", product.clone()),
            ("REPLYD_KEY", key.token.clone()),
        ],
        Duration::from_secs(300),
    )
    .await;
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let conversation = report["conversation_id"].as_str().unwrap();
    assert!(report["tokens"].as_u64().unwrap() >= 2, "{report}");

    app.wait_until_committed_to_end(LIMIT).await;
    let db = app.db.raw_client().await;
    let saved: Vec<(String, String)> = db
        .query(
            "SELECT task_id::text, status FROM reply_tasks WHERE conversation_id = $1 \
             ORDER BY created_at",
            &[&conversation],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let shown: Vec<(String, String)> = report["tasks_shown"]
        .as_array()
        .unwrap()
        .iter()
        .zip(report["statuses"].as_array().unwrap())
        .map(|(t, s)| (t.as_str().unwrap().into(), s.as_str().unwrap().into()))
        .collect();
    assert_eq!(saved, shown, "one task per press, as the page showed them");
    let owner: Option<String> = db
        .query_one(
            "SELECT end_user_id FROM conversations WHERE conversation_id = $1",
            &[&conversation],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(owner.as_deref(), Some("alice"));
    // Stopped while its call ran: the provider may have done the work (and the page may have
    // shown its text), so it is charged, as any call that may have run is (I8).
    let charged: i64 = db
        .query_one(
            "SELECT count(*) FROM quota_reservations r JOIN reply_tasks t USING (task_id) \
             WHERE t.conversation_id = $1 AND t.status = 'cancelled' AND r.state = 'charged'",
            &[&conversation],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        charged, 1,
        "the stopped task, whose call had started, is charged"
    );

    server.kill().await.unwrap();
    app.terminate("serve").await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
}

/// The answer as it is written: the mock streams a long reply slowly, the worker forwards its
/// text (`provider.stream` and `worker.live_text_interval_ms` at their defaults), and the demo
/// page shows it growing in its bubble, again after a reload mid-answer, and ends with the
/// saved reply; a second answer stopped mid-way shows none of its text
/// (`clients/typescript/browser-test/live.ts`). Here: the text the page ended with is the reply
/// the server saved, and the stopped task saved none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_page_shows_the_answer_growing_survives_a_reload_and_ends_with_the_saved_reply() {
    let script = built_script("live.js");
    // 3000 characters in deltas of 12, one every 40 ms after 300 ms to the first: 10 s of
    // writing, forwarded to the followers every 75 ms, long enough for a reload in the middle.
    let (app, key) = app_with_acme_on(MockSettings {
        latency_ms: 300,
        stream_chunk_chars: 12,
        stream_chunk_interval_ms: Some(40),
        ..MockSettings::default()
    })
    .await;
    app.route(Routes {
        env: vec![("REPLYD_API__DEMO_PAGE".into(), "true".into())],
        ..Routes::default()
    });
    app.spawn_process("serve", "serve");
    let addr = app.wait_for_api_addr("serve", LIMIT).await;

    let stdout = run_script(
        &script,
        &[
            ("REPLYD_URL", format!("http://{addr}")),
            ("REPLYD_KEY", key.token.clone()),
            (
                "REPLYD_PROMPT",
                "[mock:reply_chars=3000] Tell me all about it.".into(),
            ),
        ],
        Duration::from_secs(300),
    )
    .await;
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    eprintln!("{report:#}");
    for phase in ["lengths_before_reload", "lengths_after_reload"] {
        assert!(
            report[phase].as_array().unwrap().len() >= 3,
            "{phase}: {report}"
        );
    }

    let db = app.db.raw_client().await;
    let rows: Vec<(String, String, Option<String>)> = db
        .query(
            "SELECT task_id::text, status, saved_response FROM reply_tasks \
             WHERE conversation_id = $1 ORDER BY created_at",
            &[&report["conversation_id"].as_str().unwrap()],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let [
        (task, status, saved),
        (stopped, stopped_status, stopped_saved),
    ] = &rows[..]
    else {
        panic!("one task per press: {rows:?}");
    };
    assert_eq!(task, report["task_id"].as_str().unwrap());
    assert_eq!(status, "completed");
    assert_eq!(stopped, report["stopped_task_id"].as_str().unwrap());
    assert_eq!(
        (stopped_status.as_str(), stopped_saved),
        ("cancelled", &None)
    );
    let saved = saved.as_deref().expect("a completed task has its reply");
    assert_eq!(
        saved.chars().count(),
        3000,
        "the mock's reply is as long as asked"
    );
    assert_eq!(
        report["text"].as_str().unwrap(),
        saved,
        "the page ends with the saved reply"
    );

    app.wait_until_committed_to_end(LIMIT).await;
    app.terminate("serve").await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
}
