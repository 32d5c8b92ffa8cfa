//! The services crashed under everything else: PostgreSQL (stopped and restarted, or its
//! connections cut) and the Kafka broker. Skipped, and said so, with external services.

use std::time::Instant;

use super::harness::{run_scenario, run_scenario_on};
use super::{Faults, On, infra_crash, pause, selected};

/// Crash scenarios need the local services; with external ones they are skipped (and say so).
fn local_services() -> bool {
    let local = std::env::var("DATABASE_URL").is_err() && std::env::var("KAFKA_BOOTSTRAP").is_err();
    if !local {
        eprintln!("skipped: DATABASE_URL or KAFKA_BOOTSTRAP names an external service");
    }
    local
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_postgres() {
    if selected("postgres") && local_services() {
        postgres(On::Kafka).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_postgres_sqs() {
    if selected("postgres_sqs") && local_services() {
        postgres(On::Sqs).await;
    }
}

/// PostgreSQL crashed (immediate stop and restart), or its connections cut under the workers.
async fn postgres(on: On) {
    run_scenario_on(on, "postgres", 0.0, |app, until, mut rng| async move {
        let mut faults = Faults::default();
        while Instant::now() < until {
            pause(&mut rng, 2_000, 4_000).await;
            if rng.bool() {
                // A crash: every session dies, whatever it was doing (COMMIT included).
                infra_crash("postgres-crash").await;
                faults.fired("immediate_restart");
            } else {
                // Connections cut under the workers, some mid-transaction or mid-COMMIT.
                let client = app.db.raw_client().await;
                let cut: i64 = client
                    .query_one(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                         WHERE application_name = 'replyd' AND pid <> pg_backend_pid()",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get(0);
                if cut > 0 {
                    faults.fired("connections_cut");
                }
            }
        }
        faults
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_broker() {
    if !selected("broker") || !local_services() {
        return;
    }
    run_scenario(
        "broker",
        "classic",
        0.0,
        |_app, until, mut rng| async move {
            let mut faults = Faults::default();
            while Instant::now() < until {
                pause(&mut rng, 3_000, 6_000).await;
                infra_crash("kafka-crash").await;
                faults.fired("broker_kill_restart");
            }
            faults
        },
    )
    .await;
}
