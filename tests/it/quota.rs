//! Generation quotas over real HTTP and the real PostgreSQL (I8): admission without
//! oversubscription under concurrency, one reservation per logical request, replays never
//! re-admitted, a `429` that says when to come back, and a reservation settled exactly once
//! by the transaction that ends its task (charged on completion; on failure as the policy says).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::helpers::TestDb;
use crate::helpers::api::{self, Api};
use replyd::api::reply_view::Accepted;
use replyd::api::settings::ApiSettings;
use replyd_core::domain::TaskId;
use replyd_core::lease::ClaimOutcome;
use replyd_core::quota::QuotaPolicy;
use replyd_core::quota::QuotaSettings;
use reqwest::StatusCode;
use serde_json::{Value, json};

fn policy() -> QuotaPolicy {
    QuotaSettings::default().policy()
}

async fn start(policy: QuotaPolicy) -> Api {
    Api::start(ApiSettings::default(), api::limits(10_000), policy).await
}

impl Api {
    async fn quota(&self) -> Value {
        self.client
            .get(format!("{}/v1/quota", self.base))
            .bearer_auth(&self.key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// (tasks, reservations by state reserved/charged/released, counter used, counter reserved)
    async fn ledger(&self) -> (i64, i64, i64, i64, i64, i64) {
        let row = self
            .db
            .raw_client()
            .await
            .query_one(
                "SELECT (SELECT count(*) FROM reply_tasks), \
                 (SELECT count(*) FROM quota_reservations WHERE state = 'reserved'), \
                 (SELECT count(*) FROM quota_reservations WHERE state = 'charged'), \
                 (SELECT count(*) FROM quota_reservations WHERE state = 'released'), \
                 (SELECT used FROM quota_counters WHERE workspace_id = 'acme'), \
                 (SELECT reserved FROM quota_counters WHERE workspace_id = 'acme')",
                &[],
            )
            .await
            .unwrap();
        (
            row.get(0),
            row.get(1),
            row.get(2),
            row.get(3),
            row.get(4),
            row.get(5),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_first_requests_against_a_limit_of_fifty_admit_exactly_fifty() {
    let api = Arc::new(start(policy()).await);
    assert!(
        api.db
            .store
            .set_quota("acme", Some(50), 86_400)
            .await
            .unwrap()
    );
    // Sample used + reserved while the burst runs: it must never pass the limit.
    let running = Arc::new(AtomicBool::new(true));
    let sampler = {
        let client = api.db.raw_client().await;
        let running = Arc::clone(&running);
        tokio::spawn(async move {
            let mut samples = Vec::new();
            while running.load(Ordering::Relaxed) {
                let row = client
                    .query_one(
                        "SELECT used + reserved FROM quota_counters WHERE workspace_id = 'acme'",
                        &[],
                    )
                    .await
                    .unwrap();
                samples.push(row.get::<_, i64>(0));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            samples
        })
    };
    let sends = (0..200).map(|n| {
        let api = Arc::clone(&api);
        async move { api.press(&format!("burst-{n}"), &format!("q{n}")).await }
    });
    let answers = futures_util::future::join_all(sends).await;
    running.store(false, Ordering::Relaxed);
    let samples = sampler.await.unwrap();

    let accepted = answers
        .iter()
        .filter(|r| r.status() == StatusCode::ACCEPTED)
        .count();
    let refused: Vec<_> = answers
        .iter()
        .filter(|r| r.status() == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert_eq!((accepted, refused.len()), (50, 150));
    for response in &refused {
        let retry_after: u64 = response.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(retry_after >= 1);
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
    }
    assert!(!samples.is_empty());
    assert!(
        samples.iter().all(|held| *held <= 50),
        "used + reserved passed the limit: {:?}",
        samples.iter().max()
    );
    assert_eq!(api.ledger().await, (50, 50, 0, 0, 0, 50));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_first_requests_with_one_key_make_one_reservation() {
    let api = Arc::new(start(policy()).await);
    assert!(
        api.db
            .store
            .set_quota("acme", Some(10), 86_400)
            .await
            .unwrap()
    );
    let sends = (0..50).map(|_| {
        let api = Arc::clone(&api);
        async move {
            let response = api.press("one-press", "q").await;
            assert_eq!(response.status(), StatusCode::ACCEPTED);
            response.json::<Accepted>().await.unwrap().task_id
        }
    });
    let tasks = futures_util::future::join_all(sends).await;
    assert!(tasks.iter().all(|t| *t == tasks[0]));
    assert_eq!(api.ledger().await, (1, 1, 0, 0, 0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_answered_whatever_the_quota_says_now_and_new_work_gets_429() {
    let api = start(policy()).await;
    assert!(
        api.db
            .store
            .set_quota("acme", Some(1), 86_400)
            .await
            .unwrap()
    );
    let first = api.press("press-1", "q").await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let first: Accepted = first.json().await.unwrap();

    let over = api.press("press-2", "another").await;
    assert_eq!(over.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(over.headers().contains_key("retry-after"));
    let problem: Value = over.json().await.unwrap();
    assert_eq!(
        problem["type"],
        "https://replyd.dev/problems/quota_exceeded"
    );
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("1 generations per 1d is taken (0 charged, 1 reserved)"),
        "{problem}"
    );

    // The lost answer's retry: the same task, not a second reservation, though the quota is full.
    let again = api.press("press-1", "q").await;
    assert_eq!(again.status(), StatusCode::ACCEPTED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        again.json::<Accepted>().await.unwrap().task_id,
        first.task_id
    );

    // Completed: still the same task on a retry, charged once, and the quota still full.
    api.finish(first.task_id, true).await;
    let late = api.press("press-1", "q").await;
    assert_eq!(late.status(), StatusCode::ACCEPTED);
    assert_eq!(api.ledger().await, (1, 0, 1, 0, 1, 0));
    assert_eq!(
        api.press("press-3", "more").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let quota = api.quota().await;
    assert_eq!(
        (
            &quota["limit"],
            &quota["used"],
            &quota["reserved"],
            &quota["remaining"]
        ),
        (&json!(1), &json!(1), &json!(0), &json!(0)),
        "{quota}"
    );
    assert_eq!(quota["period"], "1d");
    assert_eq!(quota["policy"]["charge_failed"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_charges_once_and_a_failure_is_charged_only_when_the_policy_says_so() {
    for charge_failed in [false, true] {
        let api = start(QuotaPolicy {
            charge_failed,
            ..policy()
        })
        .await;
        let done: Accepted = api.press("done", "q1").await.json().await.unwrap();
        let failed: Accepted = api.press("failed", "q2").await.json().await.unwrap();
        assert_eq!(api.ledger().await, (2, 2, 0, 0, 0, 2));

        api.finish(done.task_id, true).await;
        api.finish(failed.task_id, false).await;
        let (charged, released) = if charge_failed { (2, 0) } else { (1, 1) };
        assert_eq!(
            api.ledger().await,
            (2, 0, charged, released, charged, 0),
            "charge_failed = {charge_failed}"
        );

        // A late write of either task is refused by the fence and settles nothing again.
        let client = api.db.raw_client().await;
        let settled: Vec<(String, String)> = client
            .query(
                "SELECT settled_by, settle_reason FROM quota_reservations ORDER BY settle_reason",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        assert_eq!(settled[0], ("w-test".into(), "task completed".into()));
        assert_eq!(
            settled[1],
            ("w-test".into(), "task failed: the provider refused".into())
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_reservation_is_never_settled_again() {
    let api = start(policy()).await;
    let accepted: Accepted = api.press("p", "q").await.json().await.unwrap();
    let store = &api.db.store;
    let ClaimOutcome::Claimed(zombie) = store
        .claim(accepted.task_id, "w-zombie", Duration::from_millis(1))
        .await
        .unwrap()
    else {
        panic!("claimable");
    };
    let client = api.db.raw_client().await;
    crate::helpers::wait_until_sql(
        &client,
        "the zombie's lease has run out",
        "SELECT lease_until < clock_timestamp() FROM reply_tasks WHERE task_id = $1",
        &[&accepted.task_id.as_uuid()],
    )
    .await;
    // The zombie's lease ran out; another worker takes the task over and completes it.
    api.finish(accepted.task_id, true).await;
    assert_eq!(api.ledger().await, (1, 0, 1, 0, 1, 0));
    // The zombie comes back: its completion and its failure are refused by the fence, and
    // nothing is settled (or charged) again.
    let late = store
        .complete(&zombie, "a late answer", None)
        .await
        .unwrap();
    assert!(
        matches!(late, replyd::store::CompletionOutcome::Refused(_)),
        "{late:?}"
    );
    let late_failure = store
        .fail(
            &zombie,
            "late",
            replyd_core::domain::AttemptOutcome::ProviderError,
            replyd_core::domain::ProviderRan::No,
        )
        .await
        .unwrap();
    assert!(
        matches!(late_failure, replyd::store::FailOutcome::Refused(_)),
        "{late_failure:?}"
    );
    assert_eq!(api.ledger().await, (1, 0, 1, 0, 1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_returns_when_the_window_ends() {
    let api = start(policy()).await;
    assert!(api.db.store.set_quota("acme", Some(1), 2).await.unwrap());
    let first: Accepted = api.press("w-1", "q").await.json().await.unwrap();
    api.finish(first.task_id, true).await;
    let (retry_after, detail) = refusal(&api, "w-2").await;
    let retry_after = retry_after.expect("a Retry-After");
    assert!((1..=2).contains(&retry_after), "{retry_after}");
    assert!(detail.contains("the window resets at"), "{detail}");
    crate::helpers::wait_until(
        "the next 2 s window admits again",
        Duration::from_secs(10),
        || async { api.press("w-2", "q2").await.status() == StatusCode::ACCEPTED },
    )
    .await;
    let quota = api.quota().await;
    assert_eq!(
        (&quota["used"], &quota["reserved"]),
        (&json!(0), &json!(1)),
        "{quota}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_sets_and_shows_a_quota() {
    let db = TestDb::new().await;
    db.store.create_workspace("acme").await.unwrap();
    let replyd = Operator::new(&db);
    let set = replyd.run(&[
        "quota",
        "set",
        "--workspace",
        "acme",
        "--limit",
        "25",
        "--period",
        "12h",
    ]);
    assert!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&set.stdout).trim(),
        "quota of workspace acme: 25 generations per 12h, no limit of tokens"
    );
    // Tokens alone: the generation limit and the period stay.
    let tokens = replyd.run(&["quota", "set", "--workspace", "acme", "--tokens", "5000"]);
    assert_eq!(
        String::from_utf8_lossy(&tokens.stdout).trim(),
        "quota of workspace acme: 25 generations per 12h, 5000 tokens",
        "{}",
        String::from_utf8_lossy(&tokens.stderr)
    );
    let bad_tokens = replyd.run(&["quota", "set", "--workspace", "acme", "--tokens", "lots"]);
    assert_eq!(bad_tokens.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_tokens.stderr).contains("--tokens \"lots\""));
    let nothing = replyd.run(&["quota", "set", "--workspace", "acme"]);
    assert_eq!(nothing.status.code(), Some(2));
    // The workspace's policy: set, shown, refused when bad, and in `quota show`.
    let policy = replyd.run(&[
        "workspace",
        "policy",
        "acme",
        "--models",
        "small,large",
        "--max-output-tokens",
        "700",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&policy.stdout).trim(),
        "workspace acme: models small,large, max_output_tokens 700, end_user_context deny, system_prompt none",
        "{}",
        String::from_utf8_lossy(&policy.stderr)
    );
    let bad_cap = replyd.run(&["workspace", "policy", "acme", "--max-output-tokens", "0"]);
    assert_eq!(bad_cap.status.code(), Some(2));
    let no_models = replyd.run(&["workspace", "policy", "acme", "--models", " , "]);
    assert_eq!(no_models.status.code(), Some(2));
    let nobody = replyd.run(&["workspace", "policy", "nobody", "--models", "any"]);
    assert_eq!(nobody.status.code(), Some(4));
    let shown = replyd.run(&["quota", "show", "acme", "--json"]);
    let view: Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(
        (
            &view["limit"],
            &view["period"],
            &view["tokens"]["limit"],
            &view["workspace_policy"]
        ),
        (
            &json!(25),
            &json!("12h"),
            &json!(5000),
            &json!({"allowed_models": ["small", "large"], "max_output_tokens": 700,
                    "system_prompt": null, "end_user_context": "deny"})
        )
    );

    let bad = replyd.run(&["quota", "set", "--workspace", "acme", "--limit=-3"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--limit \"-3\""));
    let bad_period = replyd.run(&[
        "quota",
        "set",
        "--workspace",
        "acme",
        "--limit",
        "3",
        "--period",
        "1w",
    ]);
    assert_eq!(bad_period.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_period.stderr).contains("unknown unit \"w\""));
    let missing = replyd.run(&["quota", "set", "--workspace", "nobody", "--limit", "3"]);
    assert_eq!(missing.status.code(), Some(4));
    // Nothing the refused commands said was applied.
    let shown = replyd.run(&["quota", "show", "acme", "--json"]);
    let view: Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(view["limit"], 25);
}

/// The `replyd` binary as an operator runs it, against the test's database.
struct Operator {
    config: std::path::PathBuf,
}

impl Operator {
    fn new(db: &TestDb) -> Self {
        let dir = std::env::temp_dir().join(crate::helpers::unique("quota"));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("replyd.toml");
        std::fs::write(
            &config,
            format!("[database]\nurl = \"{}\"\n", db.settings.url.expose()),
        )
        .unwrap();
        Self { config }
    }

    fn command(&self, args: &[&str]) -> std::process::Command {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"));
        command.args(args).arg("--config").arg(&self.config);
        command
    }

    fn run(&self, args: &[&str]) -> std::process::Output {
        self.command(args).output().unwrap()
    }

    /// `replyd quota set --workspace acme`, which must succeed.
    fn set_quota(&self, limit: &str, period: &str) {
        let out = self.run(&[
            "quota",
            "set",
            "--workspace",
            "acme",
            "--limit",
            limit,
            "--period",
            period,
        ]);
        assert!(
            out.status.success(),
            "quota set --limit {limit} --period {period}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Api {
    /// Presses Send and plays the worker that completes the task: one charge.
    async fn charge(&self, key: &str) {
        let response = self.press(key, key).await;
        assert_eq!(response.status(), StatusCode::ACCEPTED, "{key}");
        let accepted: Accepted = response.json().await.unwrap();
        self.finish(accepted.task_id, true).await;
    }

    /// `GET /v1/quota` after a period change: the window is the epoch-aligned one of
    /// `period_s` that holds now, and `used` is what the ledger charged inside it. Returns
    /// the quota as read and the charges the ledger holds in its window.
    async fn assert_window_holds_its_charges(&self, period_s: i64) -> (Value, i64) {
        let quota = self.quota().await;
        let start: chrono::DateTime<chrono::Utc> =
            quota["window_start"].as_str().unwrap().parse().unwrap();
        let resets: chrono::DateTime<chrono::Utc> =
            quota["resets_at"].as_str().unwrap().parse().unwrap();
        assert_eq!(
            (start.timestamp() % period_s, (resets - start).num_seconds()),
            (0, period_s),
            "the window is not aligned to the Unix epoch: {quota}"
        );
        let row = self
            .db
            .raw_client()
            .await
            .query_one(
                "SELECT (SELECT count(*) FROM quota_reservations WHERE state = 'charged' \
                   AND settled_at >= $1 AND settled_at < $2), \
                 clock_timestamp() >= $1 AND clock_timestamp() < $2",
                &[&start, &resets],
            )
            .await
            .unwrap();
        let (charged, holds_now): (i64, bool) = (row.get(0), row.get(1));
        assert!(holds_now, "the window does not hold now: {quota}");
        assert_eq!(
            quota["used"],
            json!(charged),
            "used is not what the ledger charged in the window: {quota}"
        );
        (quota, charged)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_period_change_puts_the_counter_on_the_new_epoch_aligned_window_with_its_charges() {
    let api = start(policy()).await;
    let replyd = Operator::new(&api.db);

    // Two presses charged under 1d, then the period becomes 1h: both were settled inside the
    // current hour, so the hour has them.
    replyd.set_quota("10", "1d");
    api.charge("day-1").await;
    api.charge("day-2").await;
    replyd.set_quota("10", "1h");
    api.assert_window_holds_its_charges(3_600).await;

    // One press charged under 10s (the counter moves to a 10 s window), then 1d: the day
    // starts at 00:00 UTC, not at the change, and holds all three charges.
    replyd.set_quota("10", "10s");
    api.charge("ten-seconds").await;
    replyd.set_quota("10", "1d");
    let (day, charged) = api.assert_window_holds_its_charges(86_400).await;

    // A change of the limit alone keeps the window and what was charged in it: room for
    // exactly one more.
    replyd.set_quota(&(charged + 1).to_string(), "1d");
    let kept = api.quota().await;
    assert_eq!(
        (&kept["window_start"], &kept["used"], &kept["remaining"]),
        (&day["window_start"], &day["used"], &json!(1)),
        "{kept}"
    );
    assert_eq!(
        api.press("one-more", "q").await.status(),
        StatusCode::ACCEPTED
    );
    assert_eq!(
        api.press("over", "q").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_committing_while_the_period_changes_is_counted_once() {
    let api = start(policy()).await;
    let replyd = Operator::new(&api.db);
    replyd.set_quota("10", "1d");
    api.charge("settled-before").await;
    let pending: Accepted = api
        .press("settling-during", "q")
        .await
        .json()
        .await
        .unwrap();

    // A transaction that completes the second task: its trigger settles the reservation and
    // holds the counter row's lock until the commit.
    let settler = api.db.raw_client().await;
    let settler_pid: i32 = settler
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    settler.batch_execute("BEGIN").await.unwrap();
    settler
        .execute(
            "UPDATE reply_tasks SET status = 'completed', saved_response = 'the answer' \
             WHERE task_id = $1",
            &[&pending.task_id.as_uuid()],
        )
        .await
        .unwrap();

    // The period change waits on that lock...
    let change = replyd
        .command(&[
            "quota",
            "set",
            "--workspace",
            "acme",
            "--limit",
            "10",
            "--period",
            "1h",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let observer = api.db.raw_client().await;
    crate::helpers::wait_until_sql(
        &observer,
        "the period change waits on the settling transaction",
        "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid)))",
        &[&settler_pid],
    )
    .await;
    // ...and the settlement commits while it waits.
    settler.batch_execute("COMMIT").await.unwrap();
    let changed = tokio::task::spawn_blocking(move || change.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        changed.status.success(),
        "{}",
        String::from_utf8_lossy(&changed.stderr)
    );

    // Both charges are in the hour's count, once each.
    let (tasks, open, charged, _, _, reserved) = api.ledger().await;
    assert_eq!((tasks, open, charged, reserved), (2, 0, 2, 0));
    api.assert_window_holds_its_charges(3_600).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_period_longer_than_the_bound_is_refused_by_the_command_and_the_database() {
    let api = start(policy()).await;
    let replyd = Operator::new(&api.db);
    for too_long in ["1000000000d", "3651d"] {
        let refused = replyd.run(&[
            "quota",
            "set",
            "--workspace",
            "acme",
            "--limit",
            "5",
            "--period",
            too_long,
        ]);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{too_long}: {stderr}");
        assert!(
            stderr.contains("--period") && stderr.contains("3650d"),
            "{stderr}"
        );
    }
    // Nothing was applied: the workspace still reads and admits.
    let quota = api
        .client
        .get(format!("{}/v1/quota", api.base))
        .bearer_auth(&api.key)
        .send()
        .await
        .unwrap();
    assert_eq!(quota.status(), StatusCode::OK);
    assert_eq!(api.press("after", "q").await.status(), StatusCode::ACCEPTED);

    // The bound itself is accepted, and the database refuses what is past it.
    replyd.set_quota("5", "3650d");
    assert_eq!(api.quota().await["period"], "3650d");
    let past = api
        .db
        .raw_client()
        .await
        .execute(
            "UPDATE quota_counters SET period_seconds = 86400000000000 WHERE workspace_id = 'acme'",
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(
        past.code(),
        Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION),
        "{past}"
    );
}

/// The `429` of a press over the quota: its `Retry-After` in seconds (None: no header) and
/// its `detail`.
async fn refusal(api: &Api, key: &str) -> (Option<u64>, String) {
    let response = api.press(key, key).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS, "{key}");
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    let problem: Value = response.json().await.unwrap();
    assert_eq!(
        problem["type"],
        "https://replyd.dev/problems/quota_exceeded"
    );
    (retry_after, problem["detail"].as_str().unwrap().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_held_by_open_reservations_says_when_the_first_is_expected_to_settle() {
    let api = start(policy()).await;
    assert!(
        api.db
            .store
            .set_quota("acme", Some(1), 86_400)
            .await
            .unwrap()
    );
    let first: Accepted = api.press("first", "q").await.json().await.unwrap();

    // Nothing has settled yet: a short default, not the reservation's hour-long TTL.
    let (retry_after, detail) = refusal(&api, "no-history").await;
    assert_eq!(
        retry_after,
        Some(replyd_core::quota::DEFAULT_SETTLE_WAIT.as_secs()),
        "{detail}"
    );
    assert!(
        detail.contains("no reservation of this workspace has settled yet"),
        "{detail}"
    );

    // The first took 20 s from admission to its charge; the next has been open 5 s.
    api.finish(first.task_id, true).await;
    let client = api.db.raw_client().await;
    client
        .execute(
            "UPDATE quota_reservations SET created_at = settled_at - interval '20 s' \
             WHERE task_id = $1",
            &[&first.task_id.as_uuid()],
        )
        .await
        .unwrap();
    assert!(
        api.db
            .store
            .set_quota("acme", Some(2), 86_400)
            .await
            .unwrap()
    );
    let second: Accepted = api.press("second", "q").await.json().await.unwrap();
    client
        .execute(
            "UPDATE quota_reservations SET created_at = created_at - interval '5 s' \
             WHERE task_id = $1",
            &[&second.task_id.as_uuid()],
        )
        .await
        .unwrap();
    let (retry_after, detail) = refusal(&api, "with-history").await;
    let retry_after = retry_after.expect("a Retry-After");
    assert!((1..=15).contains(&retry_after), "{retry_after}: {detail}");
    assert!(
        detail.contains("based on how long recent reservations took to settle"),
        "{detail}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_behind_a_reservation_past_its_ttl_waits_for_the_reconcilers_next_pass() {
    let api = start(QuotaPolicy {
        reservation_ttl: Duration::from_millis(1),
        ..policy()
    })
    .await;
    assert!(
        api.db
            .store
            .set_quota("acme", Some(1), 86_400)
            .await
            .unwrap()
    );
    let open: Accepted = api.press("open", "q").await.json().await.unwrap();
    let client = api.db.raw_client().await;
    crate::helpers::wait_until_sql(
        &client,
        "the open reservation is past its TTL",
        "SELECT expires_at < clock_timestamp() FROM quota_reservations WHERE task_id = $1",
        &[&open.task_id.as_uuid()],
    )
    .await;
    let (retry_after, detail) = refusal(&api, "behind-it").await;
    let retry_after = retry_after.expect("a Retry-After");
    assert!(
        (1..=replyd::reconcile::INTERVAL.as_secs()).contains(&retry_after),
        "{retry_after}: {detail}"
    );
    assert!(detail.contains("the reconciler's next pass"), "{detail}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_of_zero_is_refused_without_a_time_to_retry() {
    let api = start(policy()).await;
    assert!(
        api.db
            .store
            .set_quota("acme", Some(0), 86_400)
            .await
            .unwrap()
    );
    let (retry_after, detail) = refusal(&api, "never").await;
    assert_eq!(retry_after, None, "{detail}");
    assert!(detail.contains("the limit is 0"), "{detail}");
}

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

    /// Plays a worker that completes the task with a reply whose meta reports `usage`
    /// (`Generation` as JSON, as the worker saves it), or none.
    async fn complete_reporting(&self, task: TaskId, usage: Option<(u32, u32)>) {
        let lease = self.claim(task).await;
        let meta = serde_json::to_value(replyd_core::provider::Generation {
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
        })
        .unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_retries_of_one_failed_task_at_once_make_one_task_and_one_reservation() {
    use replyd::store::retries::Retried;
    let api = Arc::new(start(policy()).await);
    let accepted: Accepted = api.press("p", "q").await.json().await.unwrap();
    // It fails with its reservation released (the provider refused: no work done).
    api.finish(accepted.task_id, false).await;
    assert_eq!(api.ledger().await, (1, 0, 0, 1, 0, 0));
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let mut runs = Vec::new();
    for _ in 0..8 {
        let (api, barrier) = (Arc::clone(&api), Arc::clone(&barrier));
        runs.push(tokio::spawn(async move {
            barrier.wait().await;
            api.db
                .store
                .retry_failed(accepted.task_id, Some(2), &policy())
                .await
                .unwrap()
        }));
    }
    let mut created = Vec::new();
    let mut already = Vec::new();
    for run in runs {
        match run.await.unwrap() {
            Retried::Created { task_id } => created.push(task_id),
            Retried::Already { task_id } => already.push(task_id),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(created.len(), 1, "{created:?} {already:?}");
    assert!(already.iter().all(|t| *t == created[0]), "{already:?}");
    // Two tasks, one reservation of each: the failed one's released, the retry's open.
    assert_eq!(api.ledger().await, (2, 1, 0, 1, 0, 1));
    // The retry is admitted like new work and settled by its own completion, once.
    api.finish(created[0], true).await;
    assert_eq!(api.ledger().await, (2, 0, 1, 1, 1, 0));
}
