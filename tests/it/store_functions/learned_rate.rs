//! The learned rate's SQL (`replyd_capacity_grant`, `_refused`, `_reported`) against its
//! twin, `pacing::Learned`: generated runs and one burst step by step move both alike.

use crate::helpers::TestDb;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// One step of the learned rate's life, as the budget sees it.
#[derive(Debug, Clone)]
enum LearnedStep {
    /// A grant for `waiting` calls (the budget decides how many go), with the calls the worker
    /// let go freely since it last told the budget.
    Grant { waiting: usize, sent_freely: u64 },
    /// A refusal for capacity, with the calls let go freely, and the pause the provider asked
    /// for, if any (it holds grants off; the learned rate does not read it).
    Refused {
        sent_freely: u64,
        pause_secs: Option<f64>,
    },
    /// The provider reported its limit, requests a second.
    Reported(f64),
}

/// Runs `step` at `now` on `bucket` through the learned rate's SQL (`replyd_capacity_grant`,
/// `_refused`, `_reported`) and on `rust` through its twin, `pacing::Learned`, and returns the
/// twin after it. The SQL's clock is set to `now` (`replyd.capacity_now`).
fn learned_step(
    runtime: &tokio::runtime::Runtime,
    client: &tokio_postgres::Client,
    bucket: &str,
    now: f64,
    step: &LearnedStep,
    rust: replyd_core::pacing::Learned,
) -> replyd_core::pacing::Learned {
    runtime.block_on(async {
        client
            .execute(
                "SELECT set_config('replyd.capacity_now', $1, false)",
                &[&format!("{now:?}")],
            )
            .await
            .unwrap();
        match step {
            LearnedStep::Grant {
                waiting,
                sent_freely,
            } => {
                let waiters = vec![1i64; *waiting];
                let row = client
                    .query_one(
                        "SELECT coalesce(cardinality(delays), 0), blocked_for \
                         FROM replyd_capacity_grant( \
                         $1, 'holder', $2, $3, 0, NULL, NULL, NULL, 10, true, 0.25, $4)",
                        &[
                            &bucket,
                            &waiters,
                            &(*waiting as i32),
                            &(*sent_freely as i64),
                        ],
                    )
                    .await
                    .unwrap();
                let (granted, blocked_for): (i32, f64) = (row.get(0), row.get(1));
                // A pause grants nothing and regrows nothing; the calls let go freely went.
                let sent = rust.sent(now, *sent_freely);
                if blocked_for > 0.0 {
                    sent
                } else {
                    sent.granted(now, granted as u64)
                }
            }
            LearnedStep::Refused {
                sent_freely,
                pause_secs,
            } => {
                client
                    .query_one(
                        "SELECT * FROM replyd_capacity_refused($1, $2, true, $3)",
                        &[&bucket, pause_secs, &(*sent_freely as i64)],
                    )
                    .await
                    .unwrap();
                rust.sent(now, *sent_freely).refused(now)
            }
            LearnedStep::Reported(rate) => {
                client
                    .execute("SELECT replyd_capacity_reported($1, $2)", &[&bucket, rate])
                    .await
                    .unwrap();
                rust.reported(now, *rate)
            }
        }
    })
}

/// The bucket's learned state as the SQL left it, read into its twin's type.
fn learned_in_sql(
    runtime: &tokio::runtime::Runtime,
    client: &tokio_postgres::Client,
    bucket: &str,
) -> replyd_core::pacing::Learned {
    use replyd_core::pacing::{Learned, Window};
    let row = runtime.block_on(async {
        client
            .query_one(
                "SELECT reported_rps, learned_rps, learned_changed_at, cut_at, refused_at, \
                 good_rps, window_start, window_granted, window_refused, previous_rate, \
                 previous_refused_rate FROM capacity_buckets WHERE bucket = $1",
                &[&bucket],
            )
            .await
            .unwrap()
    });
    Learned {
        reported: row.get("reported_rps"),
        per_second: row.get("learned_rps"),
        changed_at: row.get("learned_changed_at"),
        cut_at: row.get("cut_at"),
        refused_at: row.get("refused_at"),
        good_per_second: row.get("good_rps"),
        window: Window {
            start: row.get("window_start"),
            granted: row.get::<_, i64>("window_granted") as u64,
            refused: row.get::<_, i64>("window_refused") as u64,
            previous_granted_rate: row.get("previous_rate"),
            previous_refused_rate: row.get("previous_refused_rate"),
        },
    }
}

/// The two sides agree, to rounding.
fn learned_agree(sql: &replyd_core::pacing::Learned, rust: &replyd_core::pacing::Learned) -> bool {
    let same = |a: f64, b: f64| (a - b).abs() < 1e-9;
    let same_opt = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => same(a, b),
        (a, b) => a == b,
    };
    same_opt(sql.reported, rust.reported)
        && same_opt(sql.per_second, rust.per_second)
        && same(sql.changed_at, rust.changed_at)
        && same(sql.cut_at, rust.cut_at)
        && same(sql.refused_at, rust.refused_at)
        && same(sql.good_per_second, rust.good_per_second)
        && same(sql.window.start, rust.window.start)
        && sql.window.granted == rust.window.granted
        && sql.window.refused == rust.window.refused
        && same(
            sql.window.previous_granted_rate,
            rust.window.previous_granted_rate,
        )
        && same(
            sql.window.previous_refused_rate,
            rust.window.previous_refused_rate,
        )
}

/// The learned rate's SQL (migration V31, over V16 and V18) moves the bucket exactly as
/// `capacity::pacing::Learned`, its twin, moves: over generated runs of grants, calls let go
/// freely, refusals (some with a pause) and reports at generated instants. The instants are
/// multiples of 1/64 s, so both sides do the same arithmetic on the same doubles.
#[test]
fn the_learned_rate_moves_in_sql_as_pacing_learned_moves() {
    use replyd_core::pacing::Learned;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let client = runtime.block_on(db.raw_client());
    let mut runner = TestRunner::new(Config {
        cases: 150,
        ..Config::default()
    });
    let sent_freely = || prop_oneof![Just(0u64), 1u64..200];
    let step = prop_oneof![
        (0usize..12, sent_freely()).prop_map(|(waiting, sent_freely)| LearnedStep::Grant {
            waiting,
            sent_freely
        }),
        (sent_freely(), proptest::option::of(1u32..128)).prop_map(|(sent_freely, pause)| {
            LearnedStep::Refused {
                sent_freely,
                pause_secs: pause.map(|p| f64::from(p) / 64.0),
            }
        }),
        (1u32..12_800).prop_map(|r| LearnedStep::Reported(f64::from(r) / 64.0)),
    ];
    let case = proptest::collection::vec((0u32..160, step), 1..40);
    let bucket_no = std::sync::atomic::AtomicU64::new(0);
    runner
        .run(&case, |steps| {
            let n = bucket_no.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let bucket = format!("learned-{n}");
            // The bucket row's defaults: nothing learned, every instant at 0.
            let mut rust = Learned::new(0.0);
            let mut now = 1_000.0f64;
            for (sixty_fourths, step) in steps {
                now += f64::from(sixty_fourths) / 64.0;
                rust = learned_step(&runtime, &client, &bucket, now, &step, rust);
                let sql = learned_in_sql(&runtime, &client, &bucket);
                prop_assert!(
                    learned_agree(&sql, &rust),
                    "after {step:?} at {now}: sql {sql:?}, rust {rust:?}"
                );
            }
            Ok::<(), TestCaseError>(())
        })
        .unwrap();
}

/// A burst against a provider that reports no limit, step by step through the SQL and its
/// twin: the first refusal cuts from the calls let go freely (not from nothing, to the floor);
/// the refusals of the same overload do not cut again, but a refusal a second after the cut
/// does, to what got through; quiet seconds go back to it, then probe; a refusal cuts a rate
/// that regrew a moment ago; a first report replaces the learned rate, and a refusal cuts it
/// by 10 %, never to regrow past it.
#[test]
fn the_learned_rate_is_cut_to_what_got_through_in_sql_as_in_pacing() {
    use LearnedStep::{Grant, Refused, Reported};
    use replyd_core::pacing::Learned;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let client = runtime.block_on(db.raw_client());
    let grant = |waiting, sent_freely| Grant {
        waiting,
        sent_freely,
    };
    let refused = |sent_freely, pause_secs| Refused {
        sent_freely,
        pause_secs,
    };
    // (seconds past 1,000, the step, the learned rate after it)
    let script = [
        // 100 calls let go freely, told with a grant; nothing learned yet.
        (0.5, grant(0, 100), None),
        // The first refusal (and a pause of half a second): 95 % of the 99 that got through.
        (1.5, refused(0, Some(0.5)), Some(94.05)),
        // Another worker's free calls, told during the pause: counted, nothing granted.
        (1.75, grant(3, 6), Some(94.05)),
        // The same overload's other refusal: counted, no cut within a second of the cut.
        (2.0, refused(0, None), Some(94.05)),
        (2.25, grant(12, 0), Some(94.05)),
        // A second after the cut: 18 went and 3 were refused in the last second, 15 got
        // through.
        (2.5, refused(0, None), Some(14.25)),
        // Quiet seconds: back to the 15 that got through, then up by 10 % (at least 1).
        (3.5, grant(4, 0), Some(15.0)),
        (4.5, grant(4, 0), Some(16.5)),
        (5.5, grant(4, 0), Some(18.15)),
        // A refusal a quarter of a second after a regrowth step cuts all the same: 4 went in
        // this window and 4 a second in the one before, over three quarters of a second.
        (5.75, refused(0, None), Some(5.7)),
        // The first report replaces the learned rate and holds a cut off for a second.
        (6.0, Reported(50.0), Some(50.0)),
        (6.5, refused(0, None), Some(50.0)),
        (7.0, refused(0, None), Some(45.0)),
        (7.25, Reported(50.0), Some(45.0)),
        // Nothing got through before that cut: regrowth probes, up to the report.
        (8.0, grant(4, 0), Some(49.5)),
        (9.0, grant(4, 0), Some(50.0)),
    ];
    let bucket = "learned-script";
    let mut rust = Learned::new(0.0);
    for (at, step, expected) in script {
        let now = 1_000.0 + at;
        rust = learned_step(&runtime, &client, bucket, now, &step, rust);
        let sql = learned_in_sql(&runtime, &client, bucket);
        assert!(
            learned_agree(&sql, &rust),
            "after {step:?} at {now}: sql {sql:?}, rust {rust:?}"
        );
        let close = match (rust.per_second, expected) {
            (Some(a), Some(b)) => (a - b).abs() < 1e-9,
            (a, b) => a == b,
        };
        assert!(
            close,
            "after {step:?} at {now}: {rust:?}, expected {expected:?}"
        );
    }
}
