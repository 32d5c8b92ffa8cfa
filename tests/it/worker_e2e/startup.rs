//! A worker starting and watched: contradictory settings, an unreachable broker or database,
//! and a missing dead-letter topic are refused by name; `config check --connect` reaches every
//! part; `/healthz` watches the worker's and the relay's loops.

use std::time::Duration;

use super::LIMIT;
use crate::helpers::app::{Routes, TestApp, WorkerConfig};
use crate::helpers::{key_honouring_mock, unique, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_watches_the_worker_s_poll_loop_and_the_relay_s_loop() {
    // A short liveness timeout (its floor is 5 s above every bounded wait, all made short
    // here): a part whose loop did not beat would fail /healthz once it passed.
    let config = WorkerConfig {
        request_timeout_ms: 1_000,
        drain_timeout_ms: 1_000,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, key_honouring_mock(20), config).await;
    app.route(Routes {
        env: vec![
            (
                "REPLYD_OBSERVABILITY__LIVENESS_TIMEOUT_MS".into(),
                "6500".into(),
            ),
            (
                "REPLYD_DATABASE__STATEMENT_TIMEOUT_MS".into(),
                "1000".into(),
            ),
            ("REPLYD_RELAY__PUBLISH_TIMEOUT_MS".into(), "1000".into()),
        ],
        ..Routes::default()
    });
    app.spawn_worker("w1");
    app.spawn_relay("r1");
    app.wait_until_ready("w1").await;
    let mut addrs = Vec::new();
    for name in ["w1", "r1"] {
        wait_until(&format!("{name} serves its probes"), LIMIT, || async {
            app.observability_addr(name).is_some()
        })
        .await;
        addrs.push(app.observability_addr(name).unwrap());
    }
    // Longer than the liveness timeout: only loops that kept beating are still alive.
    tokio::time::sleep(Duration::from_millis(8_000)).await;
    for (addr, part) in addrs.iter().zip(["worker", "relay"]) {
        let answer = reqwest::get(format!("http://{addr}/healthz"))
            .await
            .unwrap();
        let status = answer.status();
        let body = answer.text().await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(body.starts_with("ok\n"), "{body}");
        assert!(body.contains(&format!("{part}: its loop turned")), "{body}");
    }
}

#[tokio::test]
async fn a_worker_with_contradictory_settings_refuses_to_start_and_names_the_setting() {
    let dir = std::env::temp_dir().join(unique("bad-config"));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        (
            "[kafka]\nsession_timeout_ms = 6000\n[worker]\ndrain_timeout_ms = 6000\n",
            "worker.drain_timeout_ms",
        ),
        (
            "[worker]\nparition_window = 8\n",
            "did you mean `worker.partition_window`?",
        ),
        ("[kafka]\ngroup_protocol = \"eager\"\n", "group_protocol"),
        (
            "[kafka]\ngroup_protocol = \"consumer\"\nsession_timeout_ms = 10000\n",
            "kafka.session_timeout_ms",
        ),
        // Refused before anything connects: nothing listens at the default database URL, so
        // reaching the migrations would mean a minute of retries, not a prompt refusal.
        (
            "[kafka.librdkafka]\n\"fetch.wait.max.mss\" = \"50\"\n",
            "fetch.wait.max.mss",
        ),
    ];
    for (text, named) in cases {
        let path = dir.join("replyd.toml");
        std::fs::write(&path, text).unwrap();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
            .args(["worker", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{text}: {stderr}");
        assert!(stderr.contains(named), "{named} not named in: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "said once: {stderr}");
        assert!(!stderr.contains("default."), "{stderr}");
    }

    // `config check` names every problem at once; `config show` prints the effective settings
    // (file, then environment) without their secrets.
    let path = dir.join("many.toml");
    std::fs::write(
        &path,
        "[database]\nurl = \"postgres://u:hunter2@127.0.0.1:1/db\"\n[wroker]\nlease_ms = 1\n\
         [worker]\nrenew_interval_ms = 900000\n",
    )
    .unwrap();
    let run = |args: &[&str], config: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
            .args(args)
            .arg("--config")
            .arg(config)
            .env("REPLYD_WORKER__PARTITION_WINDOW", "32")
            .output()
            .unwrap()
    };
    let checked = run(&["config", "check"], &path);
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert_eq!(checked.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("2 problems in the settings"), "{stderr}");
    assert!(stderr.contains("did you mean `worker`?"), "{stderr}");
    assert!(stderr.contains("worker.renew_interval_ms"), "{stderr}");
    std::fs::write(
        &path,
        "[database]\nurl = \"postgres://u:hunter2@127.0.0.1:1/db\"\n",
    )
    .unwrap();
    let shown = run(&["config", "show"], &path);
    let stdout = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.status.success(),
        "{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    assert!(stdout.contains("partition_window = 32"), "{stdout}");
    assert!(
        !stdout.contains("hunter2") && stdout.contains("url = \"***\""),
        "{stdout}"
    );
    assert!(run(&["config", "check"], &path).status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_is_named_with_its_setting_and_not_logged_per_attempt() {
    let db = crate::helpers::TestDb::new().await;
    let dir = std::env::temp_dir().join(unique("no-kafka"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("replyd.toml");
    std::fs::write(
        &path,
        format!(
            "[database]\nurl = \"{}\"\n[kafka]\nbootstrap_servers = \"127.0.0.1:1\"\nstartup_retry_ms = 8000\n[observability]\nlisten = \"127.0.0.1:0\"\n",
            db.settings.url.expose()
        ),
    )
    .unwrap();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
            .args(["worker", "--config"])
            .arg(&path)
            .env("RUST_LOG", "info")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot reach Kafka at 127.0.0.1:1 (kafka.bootstrap_servers)"),
        "{stderr}"
    );
    // librdkafka retries the connection several times a second for the 8 s; each distinct
    // line is logged once.
    let errors = stderr.lines().filter(|l| l.contains("ERROR")).count();
    assert!(errors <= 6, "{errors} ERROR lines in 8 s:\n{stderr}");
}

#[tokio::test]
async fn an_unreachable_database_is_named_with_its_setting_and_logged_once_per_failure() {
    let dir = std::env::temp_dir().join(unique("no-db"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("replyd.toml");
    // Port 1: nothing listens. Short retry, so the test ends soon.
    std::fs::write(
        &path,
        "[database]\nurl = \"postgres://replyd:hunter2@127.0.0.1:1/replyd\"\nstartup_retry_ms = 3000\n[observability]\nlisten = \"127.0.0.1:0\"\n",
    )
    .unwrap();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
            .args(["worker", "--config"])
            .arg(&path)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot connect to PostgreSQL at 127.0.0.1:1/replyd (database.url)"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
    let retries = stderr
        .lines()
        .filter(|l| l.contains("failed; retrying"))
        .count();
    assert_eq!(
        retries, 1,
        "one line per distinct failure, not per attempt: {stderr}"
    );
    let last = stderr.lines().last().unwrap_or_default();
    assert_eq!(
        last.matches("Connection refused").count(),
        1,
        "the cause is said once: {last}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_check_connect_reaches_every_part_and_names_each_that_does_not_answer() {
    let app = TestApp::start(1, key_honouring_mock(10), WorkerConfig::default()).await;
    let check = |env: &[(&str, String)]| {
        let out = app
            .operator_command(&["config", "check", "--connect"])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    // Everything answers: the schema is current, both topics exist, the key lists models.
    let (code, out) = check(&[]);
    assert_eq!(code, Some(0), "{out}");
    let line = |out: &str, part: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{part}: ")))
            .unwrap_or_else(|| panic!("no {part} line in {out}"))
            .to_owned()
    };
    assert!(
        line(&out, "database").contains("the schema has every migration"),
        "{out}"
    );
    assert!(line(&out, "kafka").contains(": 1 partitions"), "{out}");
    assert!(line(&out, "provider").contains("2 models listed"), "{out}");

    // Each part wrong in its own way: a port nobody listens on, a dead-letter topic nobody
    // made, a base URL that is not the API's root. All three are named, with their settings.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let (code, out) = check(&[
        (
            "REPLYD_DATABASE__URL",
            format!("postgres://replyd:replyd@127.0.0.1:{port}/replyd"),
        ),
        ("REPLYD_KAFKA__DEAD_LETTER_TOPIC", unique("nobody-made-it")),
        (
            "REPLYD_PROVIDER__BASE_URL",
            format!("{}/api", app.mock.base_url()),
        ),
    ]);
    assert_eq!(code, Some(5), "{out}");
    let database = line(&out, "database");
    assert!(
        database.starts_with("database: FAILED")
            && database.contains(&format!("127.0.0.1:{port}"))
            && database.contains("(database.url)"),
        "{out}"
    );
    let kafka = line(&out, "kafka");
    assert!(
        kafka.starts_with("kafka: FAILED")
            && kafka.contains("(kafka.dead_letter_topic)")
            && kafka.contains("replyd topics ensure"),
        "{out}"
    );
    let provider = line(&out, "provider");
    assert!(
        provider.starts_with("provider: FAILED")
            && provider.contains("404")
            && provider.contains("provider.base_url"),
        "{out}"
    );

    // Topics that keep records (the test brokers' default, a day) longer than a forgotten task
    // is remembered: a record of it could come back once its id is let go.
    let (code, out) = check(&[("REPLYD_RETENTION__FORGOTTEN_MS", "3600000".into())]);
    assert_eq!(code, Some(5), "{out}");
    let kafka = line(&out, "kafka");
    assert!(
        kafka.starts_with("kafka: FAILED")
            && kafka.contains(&format!(
                "topic {} keeps records 86400000 ms (retention.ms)",
                app.topic
            ))
            && kafka.contains("retention.forgotten_ms is 3600000 ms"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_to_start_without_its_dead_letter_topic() {
    let config = WorkerConfig {
        dead_letter_topic: unique("missing-dlq"),
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, key_honouring_mock(10), config).await;
    // The topic is waited for within the start-up window (a topic made moments before may
    // not be in the metadata yet), then refused by name.
    app.route(Routes {
        kafka_toml: Some("startup_retry_ms = 2000".into()),
        ..Routes::default()
    });
    app.spawn_worker("w1");
    assert!(
        !app.wait_for_exit("w1", LIMIT).await,
        "the worker must not run"
    );
    let log = app.log_of("w1");
    assert!(
        log.contains("dead-letter topic") && log.contains("does not exist"),
        "{log}"
    );
    assert!(log.contains("of retrying"), "{log}");
    assert!(log.contains("replyd topics ensure"), "{log}");

    // What the error names: `replyd topics ensure` makes the missing topic, leaves the one
    // that exists as it is (naming its fewer partitions), and the worker then starts.
    let ensure = |partitions: &str| {
        let out = app
            .operator_command(&["topics", "ensure", "--partitions", partitions, "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
            .map(|r| {
                (
                    r["role"].as_str().unwrap().to_owned(),
                    r["state"].as_str().unwrap().to_owned(),
                    r["partitions"].as_i64().unwrap(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        ensure("2"),
        vec![
            ("tasks".into(), "fewer_partitions".into(), 1),
            ("dead letters".into(), "created".into(), 2),
        ]
    );
    assert_eq!(
        ensure("2"),
        vec![
            ("tasks".into(), "fewer_partitions".into(), 1),
            ("dead letters".into(), "exists".into(), 2),
        ]
    );
    app.spawn_worker("w1");
    app.wait_until_ready("w1").await;
}
