//! Migrations as processes run them: workers starting together migrate one schema, migrators
//! waiting past the lock timeout all succeed, a process with `migrate_on_start` off refuses a
//! schema that lacks a migration, and an index built afterwards is built concurrently.

use std::sync::Arc;
use std::time::Duration;

use crate::helpers::TestDb;
use tokio::sync::Barrier;

#[tokio::test]
async fn workers_starting_together_migrate_one_schema_without_racing() {
    // Every worker migrates at start; a fresh schema must survive eight at once.
    let db = TestDb::new().await;
    let client = db.raw_client().await;
    let fresh = crate::helpers::unique("t");
    client
        .batch_execute(&format!("CREATE SCHEMA {fresh}"))
        .await
        .unwrap();
    let settings = replyd::store::DatabaseSettings {
        url: crate::helpers::schema_url(&fresh),
        ..replyd::store::DatabaseSettings::default()
    };
    let barrier = Arc::new(Barrier::new(8));
    let mut runs = Vec::new();
    for _ in 0..8 {
        let (settings, barrier) = (settings.clone(), barrier.clone());
        runs.push(tokio::spawn(async move {
            barrier.wait().await;
            replyd::store::migrate::run_migrations(&settings).await
        }));
    }
    let mut applied = Vec::new();
    for run in runs {
        applied.extend(run.await.unwrap().expect("migration succeeds"));
    }
    applied.sort();
    let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .count();
    let mut unique = applied.clone();
    unique.dedup();
    assert_eq!(unique, applied, "no migration applied twice");
    assert_eq!(
        applied.len(),
        files,
        "every migration applied once: {applied:?}"
    );
}

#[tokio::test]
async fn migrators_waiting_longer_than_the_lock_timeout_for_another_all_succeed() {
    // N replicas start while one migrates for longer than `database.lock_timeout_ms` (a slow
    // migration, a Job mid-upgrade): the others wait for it and then find nothing to do; a
    // wait past the lock timeout is not a failure to exit on (a crash loop).
    let db = TestDb::new().await;
    let holder = db.raw_client().await;
    let settings = replyd::store::DatabaseSettings {
        url: crate::helpers::schema_url(&db.schema),
        lock_timeout_ms: 200,
        ..replyd::store::DatabaseSettings::default()
    };
    holder
        .execute(
            "SELECT pg_advisory_lock($1)",
            &[&replyd::store::migrate::MIGRATION_LOCK],
        )
        .await
        .unwrap();
    let mut runs = Vec::new();
    for _ in 0..4 {
        let settings = settings.clone();
        runs.push(tokio::spawn(async move {
            replyd::store::migrate::run_migrations(&settings).await
        }));
    }
    // Five lock timeouts long: every migrator has asked for the lock and waited past it.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    holder
        .execute(
            "SELECT pg_advisory_unlock($1)",
            &[&replyd::store::migrate::MIGRATION_LOCK],
        )
        .await
        .unwrap();
    for run in runs {
        let applied = run.await.unwrap().expect("a migrator that waited succeeds");
        assert_eq!(
            applied,
            Vec::<String>::new(),
            "the schema was already current"
        );
    }
}

#[tokio::test]
async fn with_migrate_on_start_off_a_process_refuses_a_schema_that_lacks_a_migration() {
    // Where a migration Job runs first, the processes only check: a schema behind the build is
    // refused at start, naming what is missing and the command; once migrated, it starts.
    let db = TestDb::new().await;
    let fresh = crate::helpers::unique("t");
    db.raw_client()
        .await
        .batch_execute(&format!("CREATE SCHEMA {fresh}"))
        .await
        .unwrap();
    let settings = replyd::store::DatabaseSettings {
        url: crate::helpers::schema_url(&fresh),
        migrate_on_start: false,
        ..replyd::store::DatabaseSettings::default()
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let refused = replyd::connect_retry::migrate(&settings, &stop)
        .await
        .expect_err("an empty schema is refused");
    let message = format!("{refused:#}");
    assert!(message.contains("V1__reply_tasks"), "{message}");
    assert!(message.contains("replyd migrate"), "{message}");
    // Nothing was created by the check.
    let tables: i64 = db
        .raw_client()
        .await
        .query_one(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1",
            &[&fresh],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 0);
    replyd::store::migrate::run_migrations(&settings)
        .await
        .unwrap();
    replyd::connect_retry::migrate(&settings, &stop)
        .await
        .expect("a current schema is accepted");
}

#[tokio::test]
async fn an_index_built_after_the_migrations_is_built_concurrently_and_a_failed_build_again() {
    // An index on a table that holds rows is built CONCURRENTLY after refinery's run, outside
    // any transaction and with no statement timeout: a build that takes longer than the
    // session's timeout finishes. One that failed (a duplicate under a unique index) left an
    // invalid index; the next migrate drops it and builds it again, and later ones find it
    // there. An index whose migration is not applied is not built.
    use replyd::store::migrate::{ConcurrentIndex, build_concurrent_indexes};
    let db = TestDb::with(|s| s.statement_timeout_ms = 300).await;
    let client = db.raw_client().await;
    // Each row takes 50 ms to index: a build of 20 rows scans for a second, twice.
    client
        .batch_execute(
            "SET statement_timeout = 0;
             CREATE FUNCTION slow_key(k integer) RETURNS integer IMMUTABLE LANGUAGE sql
                 AS 'SELECT k FROM pg_sleep(0.05)';
             CREATE TABLE indexed (k integer NOT NULL);
             INSERT INTO indexed SELECT g % 19 FROM generate_series(1, 20) g;
             RESET statement_timeout;",
        )
        .await
        .unwrap();
    let plain = client
        .batch_execute("CREATE INDEX indexed_plain ON indexed (slow_key(k))")
        .await
        .expect_err("a build longer than the statement timeout fails in the session");
    assert!(
        format!("{plain:?}").contains("statement timeout"),
        "{plain:?}"
    );
    const INDEXES: &[ConcurrentIndex] = &[
        ConcurrentIndex {
            after: 1,
            name: "indexed_by_slow_key",
            unique: true,
            on: "ON indexed (slow_key(k))",
        },
        ConcurrentIndex {
            after: 100_000,
            name: "indexed_not_yet",
            unique: false,
            on: "ON indexed (k)",
        },
    ];
    let valid = async |name: &str| -> Option<bool> {
        client
            .query_one(
                "SELECT (SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1))",
                &[&name],
            )
            .await
            .unwrap()
            .get(0)
    };

    let failed = build_concurrent_indexes(&db.settings, INDEXES)
        .await
        .expect_err("a duplicate fails the unique build");
    assert!(format!("{failed:?}").contains("duplicate"), "{failed:?}");
    assert_eq!(
        valid("indexed_by_slow_key").await,
        Some(false),
        "left invalid"
    );
    // While it is invalid, writers go on.
    client
        .execute("INSERT INTO indexed VALUES (100)", &[])
        .await
        .unwrap();

    client
        .execute("DELETE FROM indexed WHERE k = 1", &[])
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let built = build_concurrent_indexes(&db.settings, INDEXES)
        .await
        .expect("the build after the failed one");
    assert!(
        started.elapsed() > Duration::from_millis(300),
        "longer than the timeout"
    );
    assert_eq!(built, ["indexed_by_slow_key"]);
    assert_eq!(valid("indexed_by_slow_key").await, Some(true));
    assert_eq!(
        valid("indexed_not_yet").await,
        None,
        "its migration is not applied"
    );

    let again = build_concurrent_indexes(&db.settings, INDEXES)
        .await
        .expect("a later migrate");
    assert_eq!(again, Vec::<&str>::new(), "nothing to build");
}
