//! A test's processes: started (or restarted) as `replyd <command>`, signalled (SIGKILL,
//! SIGSTOP, SIGCONT, SIGTERM), healed and waited for.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{TestApp, WorkerProcess};

impl TestApp {
    pub(super) fn workers(&self) -> std::sync::MutexGuard<'_, HashMap<String, WorkerProcess>> {
        // A panic elsewhere in the test poisons nothing we rely on: the map is still right.
        self.workers.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn take(&self, name: &str) -> WorkerProcess {
        self.workers()
            .remove(name)
            .unwrap_or_else(|| panic!("worker {name} is not running"))
    }

    /// Starts (or restarts) worker `name`.
    pub fn spawn_worker(&self, name: &str) {
        self.spawn_process(name, "worker");
    }

    /// Starts (or restarts) `replyd relay` as process `name`, with the workers' settings.
    pub fn spawn_relay(&self, name: &str) {
        self.spawn_process(name, "relay");
    }

    /// Starts (or restarts) `replyd <command>` as process `name`, with the workers' settings.
    pub fn spawn_process(&self, name: &str, command: &str) {
        let config = self.dir.join(format!("{name}.toml"));
        std::fs::write(&config, self.worker_toml(name)).unwrap();
        let incarnation = {
            let mut spawns = self.spawns.lock().unwrap_or_else(|p| p.into_inner());
            let n = spawns.entry(name.to_owned()).or_default();
            *n += 1;
            *n
        };
        let log = self.dir.join(format!("{name}.{incarnation}.log"));
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let mut env = self
            .routes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .env
            .clone();
        if self.sqs.is_some() {
            env.extend(
                replyd_lab::sqs::TEST_ENV
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string())),
            );
        }
        // The routes' environment last, so a test may set its own log levels.
        let child = Command::new(env!("CARGO_BIN_EXE_replyd"))
            .args([command, "--config"])
            .arg(&config)
            .env("RUST_LOG", "info,replyd=debug,librdkafka=warn")
            .envs(env)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("worker starts");
        self.workers().insert(
            name.to_owned(),
            WorkerProcess {
                child,
                log,
                stopped: false,
            },
        );
    }

    /// The process id of the running incarnation of worker `name`.
    pub fn pid(&self, name: &str) -> u32 {
        self.workers()
            .get(name)
            .unwrap_or_else(|| panic!("worker {name} is not running"))
            .child
            .id()
    }

    /// Starts process `name` (`replyd <command>`) if it is not running, continues it if it is
    /// stopped: how a chaos scenario heals.
    #[allow(dead_code)] // the chaos binary's, which shares these fixtures
    pub fn ensure_running_as(&self, name: &str, command: &str) {
        let stopped = self.workers().get(name).map(|w| w.stopped);
        match stopped {
            None => self.spawn_process(name, command),
            Some(true) => self.resume(name),
            Some(false) => {}
        }
    }

    /// Waits for worker `name` to exit by itself (bounded) and returns whether it succeeded.
    pub async fn wait_for_exit(&self, name: &str, limit: Duration) -> bool {
        let mut worker = self.take(name);
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(status) = worker.child.try_wait().expect("try_wait") {
                return status.success();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name} did not exit within {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL: a crash with work in flight.
    pub fn kill(&self, name: &str) {
        let mut worker = self.take(name);
        worker.signal("-KILL");
        let _ = worker.child.wait();
    }

    /// SIGSTOP: the process stalls, connections open, locks and leases held.
    pub fn stop(&self, name: &str) {
        let mut workers = self.workers();
        let worker = workers.get_mut(name).expect("worker exists");
        worker.signal("-STOP");
        worker.stopped = true;
    }

    /// SIGCONT: the stalled process resumes as a zombie.
    pub fn resume(&self, name: &str) {
        let mut workers = self.workers();
        let worker = workers.get_mut(name).expect("worker exists");
        worker.signal("-CONT");
        worker.stopped = false;
    }

    /// SIGTERM, then waits for a clean exit (drain, commit, leave).
    pub async fn terminate(&self, name: &str) {
        let mut worker = self.take(name);
        worker.signal("-TERM");
        let waited = tokio::task::spawn_blocking(move || {
            let status = worker.child.wait();
            (status, worker)
        })
        .await
        .unwrap();
        let status = waited.0.expect("wait");
        assert!(
            status.success(),
            "worker exited with {status}; log {:?}",
            waited.1.log
        );
    }
}
