//! The provider's capacity in SQL: `replyd_pace` (migration V16) schedules what
//! `capacity::pacing::schedule` schedules, workers share one budget and its pauses, get the
//! rate in parts by the workspaces that wait in them, and the previous release's calls still
//! work.

use std::time::Duration;

use crate::helpers::TestDb;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// `replyd_pace` (migration V16) schedules what `capacity::pacing::schedule`, its
/// specification, schedules, over generated buckets, waiters and instants.
#[test]
fn the_capacity_function_schedules_what_pacing_schedules() {
    use replyd_core::pacing::{Budget, HORIZON_SECONDS, schedule};
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let client = runtime.block_on(db.raw_client());
    let mut runner = TestRunner::new(Config {
        cases: 400,
        ..Config::default()
    });
    let case = (
        proptest::option::of(0.0f64..20.0),
        proptest::option::of(0.0f64..20.0),
        proptest::option::of(0.1f64..400.0),
        proptest::option::of(10.0f64..50_000.0),
        0.0f64..20.0,
        proptest::collection::vec(1u64..5_000, 0..40),
    );
    runner
        .run(
            &case,
            |(requests_tat, tokens_tat, rps, tps, now, waiters)| {
                let spec = schedule(
                    Budget {
                        requests_tat,
                        tokens_tat,
                        requests_per_second: rps,
                        tokens_per_second: tps,
                    },
                    now,
                    &waiters,
                );
                let waiters: Vec<i64> = waiters.iter().map(|t| *t as i64).collect();
                let row = runtime.block_on(async {
                    client
                        .query_one(
                            "SELECT delays, new_requests_tat, new_tokens_tat, wait \
                         FROM replyd_pace($1, $2, $3, $4, $5, $6, $7)",
                            &[
                                &requests_tat,
                                &tokens_tat,
                                &rps,
                                &tps,
                                &now,
                                &HORIZON_SECONDS,
                                &waiters,
                            ],
                        )
                        .await
                        .unwrap()
                });
                let delays: Vec<f64> = row.get(0);
                let close = |a: Option<f64>, b: Option<f64>| match (a, b) {
                    (Some(a), Some(b)) => (a - b).abs() < 1e-6,
                    (a, b) => a == b,
                };
                prop_assert_eq!(delays.len(), spec.delays.len(), "{:?}", spec);
                for (sql, rust) in delays.iter().zip(&spec.delays) {
                    prop_assert!((sql - rust).abs() < 1e-6, "{sql} vs {rust}");
                }
                prop_assert!(close(row.get(1), spec.requests_tat));
                prop_assert!(close(row.get(2), spec.tokens_tat));
                prop_assert!((row.get::<_, f64>(3) - spec.wait).abs() < 1e-6);
                Ok::<(), TestCaseError>(())
            },
        )
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_share_one_budget_and_a_refusal_pauses_both() {
    use replyd::store::capacity::GrantAsk;
    let db = TestDb::new().await;
    let waiters = [10u64; 8];
    let ask = |holder: &'static str, n: usize, slots: u32, in_use: u32| GrantAsk {
        bucket: "model-a",
        holder,
        waiters: &waiters[..n],
        want_slots: slots,
        in_use,
        // 600 a minute: one every 100 ms.
        requests_per_second: Some(10.0),
        tokens_per_second: None,
        slot_limit: Some(4),
        slot_ttl: Duration::from_secs(10),
        adaptive: false,
        horizon: Duration::from_millis(250),
        sent_freely: 0,
        demand: &[],
    };
    let a = db.store.capacity_grant(&ask("w-a", 8, 3, 0)).await.unwrap();
    let b = db.store.capacity_grant(&ask("w-b", 8, 3, 0)).await.unwrap();
    // The four slots between them; the schedule is one: w-a's three calls go 100 ms apart,
    // and w-b's one slot gets a send time after theirs, past the quarter second (none yet).
    assert_eq!((a.slots, b.slots), (3, 1));
    assert_eq!(a.delays.len(), 3, "{a:?}");
    assert!(a.delays[2] >= Duration::from_millis(199), "{a:?}");
    assert!(b.delays.is_empty() && b.wait > Duration::ZERO, "{b:?}");
    // w-b waits for a share: w-a, asked again, keeps no more than a fair one (it uses one).
    let a = db.store.capacity_grant(&ask("w-a", 0, 3, 1)).await.unwrap();
    assert_eq!(a.slots, 2);
    let b = db.store.capacity_grant(&ask("w-b", 0, 3, 0)).await.unwrap();
    assert_eq!(b.slots, 2);

    db.store
        .capacity_refused("model-a", Some(Duration::from_secs(30)), false, 0)
        .await
        .unwrap();
    let paused = db.store.capacity_grant(&ask("w-b", 5, 2, 0)).await.unwrap();
    assert!(paused.delays.is_empty());
    assert!(paused.blocked_for > Duration::from_secs(25), "{paused:?}");
    // Another model's budget is its own.
    let other = db
        .store
        .capacity_grant(&GrantAsk {
            bucket: "model-b",
            ..ask("w-b", 5, 2, 0)
        })
        .await
        .unwrap();
    assert_eq!(other.delays.len(), 2, "two slots, two calls: {other:?}");
}

/// I10 across workers: worker w1 holds only workspace A's backlog, w2 holds the other half of
/// A's and all of B's. Each workspace is owed half the rate, so w2 is owed three quarters of
/// it (half through B, a quarter through A). Without the parts, whoever asks first takes the
/// whole horizon. With B of weight 3, B is owed three quarters and w2 seven eighths. A worker
/// alone is held to nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_get_the_rate_in_parts_by_the_workspaces_that_wait_in_them() {
    use replyd::store::capacity::GrantAsk;
    let db = TestDb::new().await;
    let waiters = [10u64; 120];
    let only_a = [("a".to_owned(), 100usize)];
    let a_and_b = [("a".to_owned(), 100usize), ("b".to_owned(), 10usize)];
    let ask = |bucket: &'static str, holder: &'static str, n: usize, demand| GrantAsk {
        bucket,
        holder,
        waiters: &waiters[..n],
        want_slots: 0,
        in_use: 0,
        // 400 a second over a quarter-second horizon: 100 calls a grant at most.
        requests_per_second: Some(400.0),
        tokens_per_second: None,
        slot_limit: None,
        slot_ttl: Duration::from_secs(10),
        adaptive: false,
        horizon: Duration::from_millis(250),
        sent_freely: 0,
        demand,
    };
    for (bucket, b_weight, w2_part) in [("m-even", 1, 75), ("m-weighted", 3, 87)] {
        for workspace in ["a", "b"] {
            db.store.create_workspace(workspace).await.unwrap();
        }
        assert!(db.store.set_workspace_weight("b", b_weight).await.unwrap());
        // w1 tells its demand first (a grant with none of its waiters asked for yet).
        let w1 = db
            .store
            .capacity_grant(&ask(bucket, "w1", 0, &only_a))
            .await
            .unwrap();
        assert!(w1.delays.is_empty(), "{w1:?}");
        let w2 = db
            .store
            .capacity_grant(&ask(bucket, "w2", 110, &a_and_b))
            .await
            .unwrap();
        assert_eq!(
            w2.delays.len(),
            w2_part,
            "{bucket}: w2's part of 100: {w2:?}"
        );
        let w1 = db
            .store
            .capacity_grant(&ask(bucket, "w1", 100, &only_a))
            .await
            .unwrap();
        assert_eq!(
            w1.delays.len(),
            100 - w2_part - usize::from(b_weight == 3),
            "{bucket}: w1's part of 100 (12.5 rounds down), after w2's: {w1:?}"
        );
        // Asked again at once, w1 has spent its credit: nothing, and a wait till it has one.
        let again = db
            .store
            .capacity_grant(&ask(bucket, "w1", 100, &only_a))
            .await
            .unwrap();
        assert!(
            again.delays.len() <= 1 && again.wait > Duration::ZERO,
            "{again:?}"
        );
    }
    // Alone (w2 gone, its demand with it): w1's part is the whole rate.
    let w2_done = db
        .store
        .capacity_grant(&ask("m-alone", "w2", 0, &[]))
        .await
        .unwrap();
    assert!(w2_done.delays.is_empty());
    let alone = db
        .store
        .capacity_grant(&ask("m-alone", "w1", 120, &only_a))
        .await
        .unwrap();
    assert_eq!(alone.delays.len(), 100, "{alone:?}");
}

/// A refusal that reaches the budget before the provider's first report of its limit (another
/// call of the same worker reported it, in its own round trip) cuts a rate measured from
/// nothing; the report then replaces it. A cut made once a report is known stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_report_replaces_a_rate_cut_before_it_and_a_later_cut_stands() {
    let db = TestDb::new().await;
    let client = db.raw_client().await;
    let learned = || async {
        client
            .query_one(
                "SELECT learned_rps FROM capacity_buckets WHERE bucket = 'model-a'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, Option<f64>>(0)
    };
    let cut = db
        .store
        .capacity_refused("model-a", Some(Duration::from_secs(1)), true, 0)
        .await
        .unwrap();
    assert_eq!(cut, Some(0.5), "a rate measured from nothing: the floor");
    db.store.capacity_reported("model-a", 50.0).await.unwrap();
    assert_eq!(
        learned().await,
        Some(50.0),
        "the first report replaces the guess"
    );
    // Once the report is known, a refusal (over a second after the report set the rate) cuts
    // it, and the same report again does not undo the cut.
    client
        .execute(
            "UPDATE capacity_buckets SET learned_changed_at = learned_changed_at - 2, \
             cut_at = cut_at - 2, refused_at = refused_at - 2",
            &[],
        )
        .await
        .unwrap();
    let cut = db
        .store
        .capacity_refused("model-a", None, true, 0)
        .await
        .unwrap()
        .unwrap();
    assert!((cut - 45.0).abs() < 1e-9, "{cut}");
    db.store.capacity_reported("model-a", 50.0).await.unwrap();
    assert_eq!(learned().await, Some(cut));
}

/// During a rolling upgrade the previous release's workers call the capacity functions with
/// the signatures they knew (no calls sent freely): those still grant, pause and cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_releases_capacity_calls_still_work() {
    let db = TestDb::new().await;
    let client = db.raw_client().await;
    let granted: i32 = client
        .query_one(
            "SELECT cardinality(delays) FROM replyd_capacity_grant( \
             'model-a', 'old', '{1,1,1}'::bigint[], 3, 0, NULL, NULL, NULL, 10, true, 0.25)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(granted, 3, "nothing learned: every waiter goes");
    let row = client
        .query_one(
            "SELECT requests_per_second, blocked_for \
             FROM replyd_capacity_refused('model-a', 1.0, true)",
            &[],
        )
        .await
        .unwrap();
    let (rate, blocked_for): (Option<f64>, f64) = (row.get(0), row.get(1));
    // 3 went, 1 was refused: 95 % of the 2 that got through.
    assert!(rate.is_some_and(|r| (r - 1.9).abs() < 1e-9), "{rate:?}");
    assert!(blocked_for > 0.5, "{blocked_for}");
}
