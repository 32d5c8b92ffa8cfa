//! Poison: malformed, truncated or oversized records mixed into the steady stream (1 %), which
//! the workers must set aside while every invariant holds.

use std::time::Instant;

use super::harness::run_scenario_on;
use super::{Faults, On, selected};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_poison() {
    if selected("poison") {
        poison(On::Kafka).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_poison_sqs() {
    if selected("poison_sqs") {
        poison(On::Sqs).await;
    }
}

async fn poison(on: On) {
    // 1% malformed, truncated or oversized records, mixed into the steady stream.
    run_scenario_on(on, "poison", 0.01, |_app, until, _rng| async move {
        // The faults are in the stream (counted as malformed_records).
        tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
        Faults::default()
    })
    .await;
}
