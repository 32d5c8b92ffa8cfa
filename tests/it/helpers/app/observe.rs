//! What a test's processes show: their logs, the addresses they serve the API and `/metrics`
//! on, their metrics, and when they have joined the group and been assigned partitions.

use std::time::Duration;

use super::TestApp;
use crate::helpers::wait_until;

impl TestApp {
    /// A `key=value` count from the worker's logs: how many lines of `name`'s logs contain
    /// every one of `needles`.
    pub fn log_lines_with(&self, name: &str, needles: &[&str]) -> usize {
        self.log_of(name)
            .lines()
            .filter(|line| needles.iter().all(|n| line.contains(n)))
            .count()
    }

    /// Everything worker `name` logged, over all its incarnations.
    pub fn log_of(&self, name: &str) -> String {
        let count = self
            .spawns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .copied()
            .unwrap_or(0);
        (1..=count)
            .filter_map(|n| std::fs::read_to_string(self.dir.join(format!("{name}.{n}.log"))).ok())
            .collect()
    }

    /// The last `lines` lines of every worker's latest log, for a failure message.
    pub fn log_tails(&self, lines: usize) -> String {
        let spawns = self
            .spawns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut names: Vec<_> = spawns.into_iter().collect();
        names.sort();
        names
            .into_iter()
            .map(|(name, count)| {
                let path = self.dir.join(format!("{name}.{count}.log"));
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let all: Vec<&str> = text.lines().collect();
                let tail = all[all.len().saturating_sub(lines)..].join("\n");
                format!("--- the end of {} ---\n{tail}", path.display())
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Waits until the latest incarnation of worker `name` has joined (its consumer polls).
    pub async fn wait_until_ready(&self, name: &str) {
        let log = self.workers()[name].log.clone();
        crate::helpers::wait_until(
            &format!("{name} is ready"),
            Duration::from_secs(60),
            || async {
                std::fs::read_to_string(&log).is_ok_and(|text| {
                    text.contains("consumer started") || text.contains("SQS source started")
                })
            },
        )
        .await;
    }

    /// Waits until every named worker has at least one partition assigned (from its
    /// `/metrics`), so work published next is spread over all of them.
    pub async fn wait_until_assigned(&self, names: &[&str]) {
        crate::helpers::wait_until(
            &format!("{names:?} each hold partitions"),
            Duration::from_secs(60),
            || async {
                for name in names {
                    if self
                        .metric(name, "replyd_assigned_partitions")
                        .await
                        .unwrap_or(0.0)
                        < 1.0
                    {
                        return false;
                    }
                }
                true
            },
        )
        .await;
    }

    /// Where the latest incarnation of worker `name` serves `/metrics`, `/healthz` and
    /// `/readyz`, from its start-up log line (None before it logged it).
    pub fn observability_addr(&self, name: &str) -> Option<String> {
        let log = self.log_of(name);
        // The observability server's own line: a `serve` process logs the API's address too.
        let line = log.lines().rfind(|l| l.contains("serving /metrics"))?;
        let (_, rest) = line.split_once("addr=")?;
        Some(rest.split_whitespace().next()?.to_owned())
    }

    /// Where the latest incarnation of process `name` serves the API, from its start-up line
    /// (None before any incarnation logged it; an earlier one's after a restart, until the new
    /// one logs its own).
    pub fn api_addr(&self, name: &str) -> Option<String> {
        let log = self.log_of(name);
        let (_, rest) = log.rsplit_once("API listening addr=")?;
        Some(rest.split_whitespace().next()?.to_owned())
    }

    /// [`Self::api_addr`], waiting up to `limit` for the process to log it.
    pub async fn wait_for_api_addr(&self, name: &str, limit: Duration) -> String {
        wait_until("the process logs the API's address", limit, || {
            let found = self.api_addr(name).is_some();
            async move { found }
        })
        .await;
        self.api_addr(name).unwrap_or_default()
    }

    /// The value of an unlabelled gauge or counter on the `/metrics` page of the running
    /// incarnation of worker `name` (None before it serves the page or names the metric).
    pub async fn metric(&self, name: &str, metric: &str) -> Option<f64> {
        let addr = self.observability_addr(name)?;
        let page = reqwest::get(format!("http://{addr}/metrics"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        page.lines()
            .find_map(|line| line.strip_prefix(metric)?.strip_prefix(' ')?.parse().ok())
    }

    /// The sum of every series of metric family `metric` of worker `name` (0 when none).
    pub async fn metric_total(&self, name: &str, metric: &str) -> f64 {
        let Some(addr) = self.observability_addr(name) else {
            return 0.0;
        };
        let Ok(page) = reqwest::get(format!("http://{addr}/metrics")).await else {
            return 0.0;
        };
        page.text()
            .await
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix(metric)?;
                let value = match rest.strip_prefix('{') {
                    Some(labelled) => labelled.split_once("} ")?.1,
                    None => rest.strip_prefix(' ')?,
                };
                value.parse::<f64>().ok()
            })
            .sum()
    }
}
