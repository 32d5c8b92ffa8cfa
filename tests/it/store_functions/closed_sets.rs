//! Closed sets the code and the database both spell: every one is its column's `CHECK` list,
//! and the labels `replyd_claim` answers with are the claim kinds the store reads back.

use crate::helpers::TestDb;
use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::TaskStatus;

/// The values a column's `CHECK (col in (...))` constraint allows, as the database holds it.
async fn check_list(client: &tokio_postgres::Client, table: &str, constraint: &str) -> Vec<String> {
    let definition: String = client
        .query_one(
            "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c \
             WHERE c.conrelid = $1::text::regclass AND c.conname = $2",
            &[&table, &constraint],
        )
        .await
        .unwrap()
        .get(0);
    // `CHECK ((col = ANY (ARRAY['a'::text, 'b'::text])))`: the quoted values, in order.
    let mut values: Vec<String> = definition
        .split('\'')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    values.sort();
    values
}

/// Every closed set the code spells as text is the set its column's `CHECK` allows: a value
/// the code writes is never refused, and a value the database takes can always be read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_closed_set_is_its_columns_check_list() {
    use replyd_core::domain::AttemptOutcome;
    use replyd_core::quota::ReservationState;
    let db = TestDb::new().await;
    let client = db.raw_client().await;
    let sorted = |mut values: Vec<&str>| {
        values.sort();
        values.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    assert_eq!(
        check_list(&client, "reply_tasks", "reply_tasks_status_check").await,
        sorted(TaskStatus::all().iter().map(|s| s.as_str()).collect())
    );
    assert_eq!(
        check_list(&client, "reply_attempts", "reply_attempts_outcome_check").await,
        sorted(AttemptOutcome::all().iter().map(|o| o.as_str()).collect())
    );
    assert_eq!(
        check_list(
            &client,
            "quota_reservations",
            "quota_reservations_state_check"
        )
        .await,
        sorted(ReservationState::all().iter().map(|s| s.as_str()).collect())
    );
    // And each spelling reads back as its value.
    for status in TaskStatus::all().iter().copied() {
        assert_eq!(TaskStatus::parse(status.as_str()), Some(status));
    }
    for outcome in AttemptOutcome::all().iter().copied() {
        assert_eq!(AttemptOutcome::parse(outcome.as_str()), Some(outcome));
    }
    for state in ReservationState::all().iter().copied() {
        assert_eq!(ReservationState::parse(state.as_str()), Some(state));
    }
}

/// The labels `replyd_claim` answers with, as the database holds the function, are the claim
/// kinds the store reads back: a label the code does not know would fail a claim's read, and
/// a kind the function never answers would be dead code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_function_answers_with_the_claim_kinds() {
    use replyd_core::lease::ClaimKind;
    let db = TestDb::new().await;
    let client = db.raw_client().await;
    let definition: String = client
        .query_one(
            "SELECT pg_get_functiondef(p.oid) FROM pg_proc p \
             WHERE p.proname = 'replyd_claim' AND p.pronamespace = current_schema()::regnamespace \
             ORDER BY p.pronargs DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // The function's answers: `select '<label>'::text`, `then '<label>'`, `else '<label>'`.
    let mut answered: Vec<String> = Vec::new();
    for word in ["select '", "then '", "else '"] {
        for (at, _) in definition.match_indices(word) {
            let rest = &definition[at + word.len()..];
            let label: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !label.is_empty() && rest[label.len()..].starts_with('\'') {
                answered.push(label);
            }
        }
    }
    answered.sort();
    answered.dedup();
    let mut kinds: Vec<String> = ClaimKind::ALL
        .iter()
        .map(|k| k.as_str().to_owned())
        .collect();
    kinds.sort();
    assert_eq!(answered, kinds, "replyd_claim's labels against ClaimKind");
    for kind in ClaimKind::ALL {
        assert_eq!(ClaimKind::parse(kind.as_str()), Some(kind));
    }
}
