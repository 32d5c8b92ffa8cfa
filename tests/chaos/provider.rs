//! The provider's faults in turn: 5xx, 429 with Retry-After, hangs, answers lost after the
//! work was done.

use std::time::Instant;

use super::harness::run_scenario_on;
use super::{Faults, On, pause, selected};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_provider() {
    if selected("provider") {
        provider(On::Kafka).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_provider_sqs() {
    if selected("provider_sqs") {
        provider(On::Sqs).await;
    }
}

/// The provider's faults in turn: 5xx, 429 with Retry-After, hangs, answers lost after the
/// work was done.
async fn provider(on: On) {
    run_scenario_on(on, "provider", 0.0, |app, until, mut rng| async move {
        let mut faults = Faults::default();
        let kinds = [
            ("5xx", json!({"error_rate": 0.3, "error_status": 502})),
            ("429", json!({"rate_limit_rate": 0.3, "retry_after_s": 1})),
            ("hang", json!({"hang_rate": 0.1, "hang_ms": 600000})),
            ("ambiguous_drop", json!({"drop_after_work_rate": 0.3})),
        ];
        while Instant::now() < until {
            let (kind, faults_json) = &kinds[rng.usize(..kinds.len())];
            app.set_faults(faults_json.clone()).await;
            faults.fired(kind);
            pause(&mut rng, 1_500, 3_000).await;
            app.set_faults(json!({})).await;
            pause(&mut rng, 500, 1_500).await;
        }
        faults
    })
    .await;
}
