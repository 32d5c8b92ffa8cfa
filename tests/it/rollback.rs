//! Rolling back is changing the image (docs/OPERATIONS.md, "Rollback"): a binary runs against
//! the schema of the release after it, which only expanded it, and refuses one that a later
//! release contracted past what it knows, naming the release it needs. The release after this
//! one is played by hand: one more migration in refinery's history, with the column and the
//! table it adds.

use std::time::Duration;

use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{demo_tasks, ids, key_honouring_mock};

const LIMIT: Duration = Duration::from_secs(120);

/// Applies "the next release's" migration to the test's schema, as its binary would: what it
/// adds, and its row in the history. Returns its version.
async fn apply_next_release(app: &TestApp) -> i32 {
    let client = app.db.raw_client().await;
    let newest: i32 = client
        .query_one("SELECT max(version) FROM refinery_schema_history", &[])
        .await
        .unwrap()
        .get(0);
    let next = newest + 1;
    client
        .batch_execute(&format!(
            "ALTER TABLE reply_tasks ADD COLUMN from_the_next_release text; \
             CREATE TABLE next_release_things (id bigint PRIMARY KEY); \
             INSERT INTO refinery_schema_history (version, name, applied_on, checksum) \
             VALUES ({next}, 'from_the_next_release', '2026-12-06T00:00:00Z', '1')"
        ))
        .await
        .unwrap();
    next
}

fn stderr_of(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_runs_against_the_next_release_s_schema_and_refuses_one_contracted_past_it() {
    let app = TestApp::start(2, key_honouring_mock(20), WorkerConfig::default()).await;
    let next = apply_next_release(&app).await;

    // The rollback's migration Job: `replyd migrate` of this release applies nothing and
    // succeeds, where refinery alone refused a history with a migration it has no file for.
    let migrate = app.operator_command(&["migrate"]).output().unwrap();
    let said = stderr_of(&migrate);
    assert!(migrate.status.success(), "{said}");
    assert!(
        said.contains("migrated further by a later release"),
        "{said}"
    );
    assert!(said.contains(&next.to_string()), "{said}");

    // Through the chain: a worker (which migrates at start, as by default) takes tasks to
    // their replies on that schema, and the checker holds.
    app.spawn_worker("w1");
    let tasks = demo_tasks(12, 4);
    app.produce_tasks(&tasks, 1).await;
    app.wait_until_terminal(&ids(&tasks), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.duplicate_replies, 0, "{report:#?}");
    assert_eq!(report.lost, 0, "{report:#?}");
    assert_eq!(report.completed, 12, "{report:#?}");
    // The next release's migration is still recorded, and nothing of this one's was redone.
    let client = app.db.raw_client().await;
    let recorded: i64 = client
        .query_one(
            "SELECT count(*) FROM refinery_schema_history WHERE version = $1",
            &[&next],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(recorded, 1);
    app.terminate("w1").await;

    // A later release contracts the schema past this binary and raises its floor.
    client
        .execute(
            "UPDATE schema_compatibility SET oldest_version = $1, oldest_release = '9.4.0'",
            &[&next],
        )
        .await
        .unwrap();
    let migrate = app.operator_command(&["migrate"]).output().unwrap();
    let said = stderr_of(&migrate);
    assert!(!migrate.status.success(), "{said}");
    for part in [
        format!("needs a binary that knows migration V{next}"),
        "replyd 9.4.0 or later".to_string(),
        format!("up to V{}", next - 1),
    ] {
        assert!(said.contains(&part), "{part} not in: {said}");
    }
    // A worker refuses to start, saying the same.
    app.spawn_worker("w2");
    assert!(
        !app.wait_for_exit("w2", LIMIT).await,
        "a worker on a schema contracted past it exits with an error"
    );
    let log = app.log_of("w2");
    assert!(log.contains("replyd 9.4.0 or later"), "{log}");
    // And so does a process that only checks the schema (migrate_on_start off, the chart's).
    let settings = replyd::store::DatabaseSettings {
        migrate_on_start: false,
        ..app.settings().database
    };
    let refused =
        replyd::connect_retry::migrate(&settings, &tokio_util::sync::CancellationToken::new())
            .await
            .expect_err("a contracted schema is refused");
    assert!(
        format!("{refused:#}").contains("replyd 9.4.0 or later"),
        "{refused:#}"
    );
}
