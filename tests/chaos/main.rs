//! The chaos harness: three `replyd worker` processes on a 6-partition topic, tasks arriving at
//! a steady rate, faults injected every few seconds from a recorded seed, then heal, drain and
//! check every invariant from the durable state (`replyd check`). Each scenario writes
//! `target/chaos/<scenario>.json`; `summary.json` gathers them.
//!
//! Half the tasks are published to Kafka by a producer; the other half are presses of Send:
//! `POST /v1/replies` to a `replyd api` process with a key of their own, asked again with the
//! same key until answered (some once more after their answer, a double click), against a
//! workspace with a quota, and handed to Kafka by a `replyd relay` process. So every scenario
//! judges the intake (I6) and the quota reservations (I8) under its faults too.
//!
//! `cargo test --test chaos` runs the short version of every scenario (CI). `make chaos` runs
//! the long one: `CHAOS_SECONDS=180 cargo test --release --test chaos -- --test-threads=1`,
//! and `make chaos SCENARIO=kill` one of them. A scenario that injected no fault fails: a run
//! must prove the fault fired. `CHAOS_PROFILE` picks the provider it plays: `key-honouring` (the
//! default), `openai-chat` (no recovery of a lost answer) or `openai-responses` (looked up by id).
//!
//! This file holds what every scenario names: the processes, where the tasks travel, the
//! provider's budget, the fault window, the faults' tally and the faults more than one
//! scenario injects. The rooms: [`harness`] (a scenario's run: start, produce, inject, heal,
//! drain, check, report), [`traffic`] (the tasks and presses that arrive meanwhile),
//! [`workers`] (kills, zombies and rebalances of workers), [`provider`] (the provider's
//! faults), [`poison`] (malformed records), [`infra`] (PostgreSQL and the broker crashed),
//! [`mixed`] (every fault at random) and [`network`] (Toxiproxy between the parts).

// The fixtures of the integration tests (`tests/it`). The chaos scenarios are a binary of their
// own because they crash PostgreSQL and Kafka, which every other test relies on; they use only
// part of the fixtures.
#[allow(dead_code)]
#[path = "../it/helpers/mod.rs"]
mod helpers;

mod harness;
mod infra;
mod mixed;
mod network;
mod poison;
mod provider;
mod traffic;
mod workers;

use std::collections::BTreeMap;
use std::time::Duration;

use helpers::app::TestApp;

const PARTITIONS: i32 = 6;
const WORKERS: [&str; 3] = ["w1", "w2", "w3"];
/// The processes of the front half: presses go to `API`, `RELAY` hands their tasks to Kafka.
const API: &str = "api";
const RELAY: &str = "relay";
/// The presses' workspace and its quota: generous, so every press is admitted and the count
/// of tasks is known; the reservations and the counter are what the check judges.
const WORKSPACE: &str = "chaos";
const QUOTA_LIMIT: i64 = 1_000_000;

/// Where the harness's tasks travel: Kafka (a 6-partition topic) or an SQS Standard queue
/// (`worker.source` and `relay.sink` = `sqs`), the same faults on each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum On {
    Kafka,
    Sqs,
}

/// The provider's limits a scenario runs under: none (every scenario but one), or a request
/// limit declared to the workers and enforced by the mock. Under a limit calls wait for their
/// turn at the shared budget and give their window slots back meanwhile (I10), which is the
/// path the `kill_limited` scenario puts under kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Budget {
    Open,
    Limited,
}

/// How long faults are injected; short by default (CI), longer for `make chaos`.
fn fault_window() -> Duration {
    let seconds = std::env::var("CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    Duration::from_secs(seconds)
}

/// Runs only the scenario named in `SCENARIO`, when set.
fn selected(name: &str) -> bool {
    std::env::var("SCENARIO").map_or(true, |s| s.is_empty() || s == name)
}

/// What a scenario did, for its report.
#[derive(Default)]
struct Faults {
    counts: BTreeMap<&'static str, u64>,
    /// Seconds from a worker's SIGKILL until the group had all partitions assigned again.
    reassign_s: Vec<f64>,
}

impl Faults {
    fn fired(&mut self, kind: &'static str) {
        *self.counts.entry(kind).or_default() += 1;
    }
}

async fn pause(rng: &mut fastrand::Rng, from_ms: u64, to_ms: u64) {
    tokio::time::sleep(Duration::from_millis(rng.u64(from_ms..to_ms))).await;
}

/// SIGKILL of the API or the relay, then a restart: presses in flight lose their answers and
/// are asked again; outbox rows published but not yet marked so go out again.
async fn kill_front(app: &TestApp, rng: &mut fastrand::Rng, faults: &mut Faults) {
    let (front, command, fault) = if rng.bool() {
        (API, "api", "api_sigkill")
    } else {
        (RELAY, "relay", "relay_sigkill")
    };
    app.kill(front);
    faults.fired(fault);
    pause(rng, 200, 1_500).await;
    app.spawn_process(front, command);
}

/// Runs `deploy/infra.sh <command>` (a crash and restart of a local service).
async fn infra_crash(command: &'static str) {
    let status = tokio::task::spawn_blocking(move || {
        std::process::Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/infra.sh"))
            .arg(command)
            .stdout(std::process::Stdio::null())
            .status()
    })
    .await
    .unwrap()
    .expect("infra.sh runs");
    assert!(status.success(), "infra.sh {command} failed");
}
