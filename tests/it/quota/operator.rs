//! The operator's side: `replyd quota set` and `show` through the binary, and a period change
//! that moves the counter to the new epoch-aligned window with its charges, counted once even
//! while a settlement commits, within the period's bound.

use super::{policy, start};
use crate::helpers::TestDb;
use crate::helpers::api::Api;
use replyd::api::reply_view::Accepted;
use reqwest::StatusCode;
use serde_json::{Value, json};

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
