//! Every fault at random: kills, stalls, leaves, provider faults and the services' crashes.

use std::time::{Duration, Instant};

use super::harness::run_scenario;
use super::{Faults, WORKERS, infra_crash, kill_front, pause, selected};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_mixed() {
    if !selected("mixed") {
        return;
    }
    let local = std::env::var("DATABASE_URL").is_err() && std::env::var("KAFKA_BOOTSTRAP").is_err();
    run_scenario(
        "mixed",
        "classic",
        0.005,
        |app, until, mut rng| async move {
            let mut faults = Faults::default();
            while Instant::now() < until {
                pause(&mut rng, 1_500, 3_500).await;
                let victim = WORKERS[rng.usize(..WORKERS.len())];
                match rng.u8(..7) {
                    0 => {
                        app.kill(victim);
                        faults.fired("sigkill");
                        pause(&mut rng, 500, 2_000).await;
                        app.spawn_worker(victim);
                    }
                    1 => {
                        app.stop(victim);
                        faults.fired("sigstop");
                        tokio::time::sleep(Duration::from_millis(rng.u64(4_000..6_000))).await;
                        app.resume(victim);
                    }
                    2 => {
                        app.set_faults(json!({"error_rate": 0.2, "drop_after_work_rate": 0.2}))
                            .await;
                        faults.fired("provider_faults");
                        pause(&mut rng, 1_000, 3_000).await;
                        app.set_faults(json!({})).await;
                    }
                    3 if local => {
                        infra_crash("postgres-crash").await;
                        faults.fired("postgres_restart");
                    }
                    4 if local => {
                        infra_crash("kafka-crash").await;
                        faults.fired("broker_restart");
                    }
                    5 => kill_front(&app, &mut rng, &mut faults).await,
                    _ => {
                        app.terminate(victim).await;
                        faults.fired("leave");
                        app.spawn_worker(victim);
                        app.wait_until_ready(victim).await;
                    }
                }
            }
            faults
        },
    )
    .await;
}
