//! The restore drill: a backup, more work and an erasure after it, the database restored to
//! the backup, `replyd after-restore`, the workers back. Before the procedure the damage is
//! real (the work after the backup is gone while its records are committed past, and the
//! erased conversation is back); after it, `replyd check` holds, the lost tasks are done
//! again, and nothing erased comes back, neither the restored rows nor the records of the
//! erased conversation read again.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{ids, infra, key_honouring_mock, schema_url, unique};

const LIMIT: Duration = Duration::from_secs(120);

/// The newest PostgreSQL client tool named `tool`, as `deploy/infra.sh` finds the server's.
fn pg_tool(tool: &str) -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is installed (deploy/infra.sh up)")
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin").join(tool))
        .filter(|p| p.exists())
        .collect();
    found.sort_by_key(|p| {
        p.components()
            .nth(4)
            .and_then(|c| c.as_os_str().to_str()?.parse::<u32>().ok())
            .unwrap_or(0)
    });
    found
        .pop()
        .unwrap_or_else(|| panic!("no {tool} under /usr/lib/postgresql"))
}

fn run(command: &mut Command) -> String {
    let out = command.output().expect("runs");
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Tasks of `ids` present in the schema.
async fn present(client: &tokio_postgres::Client, ids: &[replyd_core::domain::TaskId]) -> i64 {
    let uuids: Vec<uuid::Uuid> = ids.iter().map(|t| t.as_uuid()).collect();
    client
        .query_one(
            "SELECT count(*) FROM reply_tasks WHERE task_id = ANY($1)",
            &[&uuids],
        )
        .await
        .unwrap()
        .get(0)
}

async fn in_conversation(client: &tokio_postgres::Client, ws: &str, conversation: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM reply_tasks WHERE workspace_id = $1 AND conversation_id = $2",
            &[&ws, &conversation],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_database_is_made_safe_by_after_restore_and_nothing_erased_comes_back() {
    let app = TestApp::start(2, key_honouring_mock(0), WorkerConfig::default()).await;
    // The erasure log, apart from the task store (in production, another cluster).
    let log_schema = unique("log");
    let admin = app.db.raw_client().await;
    admin
        .batch_execute(&format!("CREATE SCHEMA {log_schema}"))
        .await
        .unwrap();
    let log_url = schema_url(&log_schema).expose().to_owned();
    let with_log = |args: &[&str]| {
        let mut command = app.operator_command(args);
        command.env("REPLYD_DATABASE__ERASURE_LOG_URL", &log_url);
        command
    };

    // Work, then the backup.
    let ws = unique("ws");
    let before: Vec<_> = (0..12)
        .map(|n| replyd_lab::produce::demo_task(&ws, n, 3, 0))
        .collect();
    app.produce_tasks(&before, 1).await;
    app.spawn_worker("w1");
    app.wait_until_terminal(&ids(&before), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let dump: PathBuf = std::env::temp_dir().join(format!("{}.dump", app.db.schema));
    run(Command::new(pg_tool("pg_dump"))
        .args(["--format=custom", "--schema", &app.db.schema, "--file"])
        .arg(&dump)
        .arg(infra("DATABASE_URL")));
    // The point: every record of the backup was written before it (they were done and
    // committed before the dump), every later one at or after it.
    let restored_to = chrono::Utc::now();

    // More work, and an erasure of a conversation that has tasks from before and after.
    let after: Vec<_> = (12..24)
        .map(|n| replyd_lab::produce::demo_task(&ws, n, 3, 0))
        .collect();
    app.produce_tasks(&after, 1).await;
    app.wait_until_terminal(&ids(&after), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    run(&mut with_log(&[
        "erase",
        "--workspace",
        &ws,
        "--conversation",
        "conv-0",
    ]));
    assert_eq!(in_conversation(&admin, &ws, "conv-0").await, 0);

    // The restore: workers stopped, the schema back as the backup held it.
    app.terminate("w1").await;
    admin
        .batch_execute(&format!("DROP SCHEMA {} CASCADE", app.db.schema))
        .await
        .unwrap();
    restore(&dump, &infra("DATABASE_URL"));
    let client = app.db.raw_client().await;
    assert_eq!(
        present(&client, &ids(&after)).await,
        0,
        "the later work is gone"
    );
    assert_eq!(
        in_conversation(&client, &ws, "conv-0").await,
        4,
        "the erased conversation is back"
    );

    // A dry run says what it would do and does nothing.
    let dry: Value = serde_json::from_str(&run(&mut with_log(&[
        "after-restore",
        "--restored-to",
        &restored_to.to_rfc3339(),
        "--dry-run",
        "--json",
    ])))
    .unwrap();
    assert_eq!(
        (&dry["erasures"], &dry["dry_run"]),
        (&1.into(), &true.into())
    );
    assert_eq!(in_conversation(&client, &ws, "conv-0").await, 4);

    let report: Value = serde_json::from_str(&run(&mut with_log(&[
        "after-restore",
        "--restored-to",
        &restored_to.to_rfc3339(),
        "--json",
    ])))
    .unwrap();
    assert_eq!(report["erasures"], 1, "{report}");
    assert_eq!(report["tasks_erased"], 4, "{report}");
    let again: i64 = report["rewound"]
        .as_array()
        .expect("the source is Kafka")
        .iter()
        .map(|r| r["from"].as_i64().unwrap() - r["to"].as_i64().unwrap())
        .sum();
    assert_eq!(
        again,
        after.len() as i64,
        "every record since the point: {report}"
    );
    assert_eq!(in_conversation(&client, &ws, "conv-0").await, 0);

    // The workers back: the lost tasks are done again, the erased conversation's are refused.
    app.spawn_worker("w2");
    let kept: Vec<_> = after
        .iter()
        .filter(|t| t.conversation_id != "conv-0")
        .cloned()
        .collect();
    app.wait_until_terminal(&ids(&kept), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    assert_eq!(
        in_conversation(&client, &ws, "conv-0").await,
        0,
        "nothing erased comes back"
    );
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.duplicate_replies, 0, "{report:#?}");
    assert_eq!(report.lost, 0, "{report:#?}");
    assert_eq!(report.pending, 0, "{report:#?}");
    let _ = std::fs::remove_file(&dump);
}

/// `pg_restore` of `dump` into the database at `url`.
fn restore(dump: &Path, url: &str) {
    run(Command::new(pg_tool("pg_restore"))
        .args(["--dbname", url, "--no-owner"])
        .arg(dump));
}

/// An erasure whose log entry cannot be written is not made: the caller hears which setting
/// and where, and asks again once the log is back. So no erasure is ever made that a restore
/// could undo for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_erasure_whose_log_cannot_be_written_is_not_made_and_says_why() {
    let app = TestApp::start(1, key_honouring_mock(0), WorkerConfig::default()).await;
    let ws = unique("ws");
    let tasks: Vec<_> = (0..2)
        .map(|n| replyd_lab::produce::demo_task(&ws, n, 1, 0))
        .collect();
    app.produce_tasks(&tasks, 1).await;
    app.spawn_worker("w1");
    app.wait_until_terminal(&ids(&tasks), LIMIT).await;
    let port = crate::helpers::free_port();
    let out = app
        .operator_command(&["erase", "--workspace", &ws, "--conversation", "conv-0"])
        .env(
            "REPLYD_DATABASE__ERASURE_LOG_URL",
            format!("postgres://replyd:secret-word@127.0.0.1:{port}/log"),
        )
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("database.erasure_log_url"), "{said}");
    assert!(said.contains(&format!("127.0.0.1:{port}")), "{said}");
    assert!(!said.contains("secret-word"), "{said}");
    let client = app.db.raw_client().await;
    assert_eq!(
        in_conversation(&client, &ws, "conv-0").await,
        2,
        "nothing erased"
    );
}
