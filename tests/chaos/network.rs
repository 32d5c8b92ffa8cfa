//! The network between the parts: Toxiproxy in front of PostgreSQL, the provider and (when the
//! broker advertises a proxied listener) Kafka, adding latency and cutting connections.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::harness::{Keep, run_scenario_with};
use super::{Budget, Faults, On, fault_window, pause, selected};
use crate::helpers;
use crate::helpers::app::TestApp;
use crate::helpers::wait_until;
use serde_json::json;

/// A Toxiproxy server of this test, stopped (by its pid) when dropped.
struct Toxiproxy {
    child: std::process::Child,
    api: String,
}

impl Drop for Toxiproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Toxiproxy {
    async fn start() -> Self {
        let output = std::process::Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/infra.sh"))
            .arg("toxiproxy")
            .output()
            .expect("infra.sh runs");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let binary = String::from_utf8(output.stdout).unwrap().trim().to_owned();
        let port = {
            // A free port: bind, read, release.
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let child = std::process::Command::new(binary)
            .args(["-host", "127.0.0.1", "-port", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("toxiproxy starts");
        let proxy = Self {
            child,
            api: format!("http://127.0.0.1:{port}"),
        };
        wait_until("toxiproxy answers", Duration::from_secs(20), || async {
            reqwest::get(format!("{}/version", proxy.api)).await.is_ok()
        })
        .await;
        proxy
    }

    /// A proxy listening on `listen` (port 0: a free one) in front of `upstream`; returns
    /// its `host:port`.
    async fn proxy(&self, name: &str, listen: &str, upstream: &str) -> String {
        let response = reqwest::Client::new()
            .post(format!("{}/proxies", self.api))
            .json(&json!({"name": name, "listen": listen, "upstream": upstream, "enabled": true}))
            .send()
            .await
            .unwrap();
        let status = response.status();
        let created: serde_json::Value = response.json().await.unwrap();
        assert!(status.is_success(), "proxy {name} on {listen}: {created}");
        created["listen"]
            .as_str()
            .expect("the proxy's address")
            .to_owned()
    }

    async fn add_toxic(&self, proxy: &str, toxic: &str, kind: &str, attributes: serde_json::Value) {
        let response = reqwest::Client::new()
            .post(format!("{}/proxies/{proxy}/toxics", self.api))
            .json(&json!({"name": toxic, "type": kind, "stream": "downstream", "toxicity": 1.0, "attributes": attributes}))
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success(), "toxic {toxic} refused");
    }

    async fn remove_toxic(&self, proxy: &str, toxic: &str) {
        let _ = reqwest::Client::new()
            .delete(format!("{}/proxies/{proxy}/toxics/{toxic}", self.api))
            .send()
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_network() {
    if !selected("network") {
        return;
    }
    let toxiproxy = Arc::new(Toxiproxy::start().await);
    // Kafka is proxied through the broker's third listener, which advertises the address the
    // proxy listens on (deploy/infra.sh); an external broker has no such listener.
    let kafka = match (
        helpers::infra_opt("KAFKA_PROXIED_BOOTSTRAP"),
        helpers::infra_opt("KAFKA_PROXIED_UPSTREAM"),
    ) {
        (Some(listen), Some(upstream)) => Some((listen, upstream)),
        _ => {
            eprintln!("network: no proxied Kafka listener (external broker): Kafka is not proxied");
            None
        }
    };
    let mut targets = vec!["postgres", "provider"];
    if kafka.is_some() {
        targets.insert(0, "kafka");
    }
    let proxies = Arc::clone(&toxiproxy);
    let setup = move |app: Arc<TestApp>| async move {
        let db = helpers::infra("DATABASE_URL");
        let at = db.find('@').unwrap() + 1;
        let upstream = &db[at..at + db[at..].find('/').unwrap()];
        let database = proxies.proxy("postgres", "127.0.0.1:0", upstream).await;
        let provider = proxies
            .proxy("provider", "127.0.0.1:0", &app.mock.addr().to_string())
            .await;
        let kafka = match kafka {
            Some((listen, upstream)) => Some(proxies.proxy("kafka", &listen, &upstream).await),
            None => None,
        };
        app.route(helpers::app::Routes {
            database: Some(database),
            provider: Some(format!("http://{provider}")),
            kafka,
            ..helpers::app::Routes::default()
        });
        let keep: Keep = Some(Box::new(proxies));
        keep
    };
    let black_hole = (fault_window() / 4).clamp(Duration::from_secs(3), Duration::from_secs(20));
    run_scenario_with(
        (On::Kafka, Budget::Open),
        "network",
        "classic",
        0.0,
        setup,
        |_app, until, mut rng| async move {
            let mut faults = Faults::default();
            let mut round = 0;
            while Instant::now() < until {
                pause(&mut rng, 1_000, 3_000).await;
                // Every target once first, so even a short run hits each connection.
                let proxy = targets
                    .get(round)
                    .copied()
                    .unwrap_or_else(|| targets[rng.usize(..targets.len())]);
                round += 1;
                faults.fired(match proxy {
                    "kafka" => "on_kafka",
                    "postgres" => "on_postgres",
                    _ => "on_provider",
                });
                match rng.u8(..3) {
                    0 => {
                        toxiproxy
                            .add_toxic(
                                proxy,
                                "latency",
                                "latency",
                                json!({"latency": 300, "jitter": 200}),
                            )
                            .await;
                        faults.fired("latency");
                        pause(&mut rng, 2_000, 4_000).await;
                        toxiproxy.remove_toxic(proxy, "latency").await;
                    }
                    1 => {
                        toxiproxy
                            .add_toxic(proxy, "black_hole", "timeout", json!({"timeout": 0}))
                            .await;
                        faults.fired("black_hole");
                        tokio::time::sleep(black_hole).await;
                        toxiproxy.remove_toxic(proxy, "black_hole").await;
                    }
                    _ => {
                        toxiproxy
                            .add_toxic(proxy, "reset", "reset_peer", json!({"timeout": 0}))
                            .await;
                        faults.fired("reset_peer");
                        pause(&mut rng, 300, 1_000).await;
                        toxiproxy.remove_toxic(proxy, "reset").await;
                    }
                }
            }
            faults
        },
    )
    .await;
}
