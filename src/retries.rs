//! `replyd tasks retry`: failed tasks (after a provider outage, say) run again as new tasks,
//! within a new budget, one per failed task however often the command runs. See
//! [`crate::store::retries`] for what one retry writes; this is the operator's command: the
//! selection, a dry run, and a report of what each failed task got.

use std::collections::BTreeMap;

use anyhow::Context as _;
use serde::Serialize;

use crate::config::Settings;
use crate::store::Store;
use crate::store::retries::{Retried, RetrySelection};

/// The failed tasks `replyd tasks retry` runs again, and how it reports.
#[derive(Debug, clap::Args)]
pub struct RetryArgs {
    /// Only this workspace's.
    #[arg(long)]
    pub workspace: Option<String>,
    /// Only tasks that failed at or after this time (RFC 3339).
    #[arg(long)]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only tasks that failed before this time (RFC 3339).
    #[arg(long)]
    pub until: Option<chrono::DateTime<chrono::Utc>>,
    /// Only tasks whose failure reason contains this text (e.g. `status 503`).
    #[arg(long)]
    pub reason_contains: Option<String>,
    /// At most this many, the oldest failure first.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
    pub limit: i64,
    /// The new tasks' attempt budget; the failed task's when not given.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: Option<u32>,
    /// Count what would be retried; write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What a run did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct RetryReport {
    /// Failed tasks selected.
    pub selected: usize,
    /// New tasks written (or, with `dry_run`, that would be).
    pub retried: usize,
    /// Failed tasks a retry named already (a run that raced this one).
    pub already: usize,
    /// Refused by their workspace's quota now, by workspace.
    pub over_quota: BTreeMap<String, usize>,
    /// The failed task's id → its retry's, for the ones retried now.
    pub tasks: BTreeMap<String, String>,
    pub dry_run: bool,
}

impl std::fmt::Display for RetryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let over: usize = self.over_quota.values().sum();
        write!(
            f,
            "{} failed tasks selected; {} {}; {} retried before; {} over their workspace's quota{}",
            self.selected,
            self.retried,
            if self.dry_run {
                "would be retried"
            } else {
                "retried as new tasks (the relay hands them to the workers)"
            },
            self.already,
            over,
            if over > 0 {
                format!(
                    " ({})",
                    self.over_quota
                        .iter()
                        .map(|(ws, n)| format!("{ws}: {n}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else {
                String::new()
            }
        )
    }
}

/// Retries the selected failed tasks, one transaction each, the oldest failure first.
pub async fn run(settings: &Settings, args: &RetryArgs) -> anyhow::Result<RetryReport> {
    let selection = RetrySelection {
        workspace: args.workspace.clone(),
        since: args.since,
        until: args.until,
        reason_contains: args.reason_contains.clone(),
        limit: args.limit,
    };
    let (max_attempts, dry_run) = (args.max_attempts, args.dry_run);
    let store = Store::connect(&settings.database).context("database settings")?;
    let failed = store
        .failed_tasks(&selection)
        .await
        .context("selecting the failed tasks")?;
    let mut report = RetryReport {
        selected: failed.len(),
        dry_run,
        ..RetryReport::default()
    };
    if dry_run {
        report.retried = failed.len();
        return Ok(report);
    }
    let quota = settings.quota.policy();
    for task in failed {
        match store
            .retry_failed(task.task_id, max_attempts, &quota)
            .await
            .with_context(|| format!("retrying task {}", task.task_id))?
        {
            Retried::Created { task_id } => {
                report.retried += 1;
                report
                    .tasks
                    .insert(task.task_id.to_string(), task_id.to_string());
            }
            Retried::Already { .. } | Retried::NotFailed => report.already += 1,
            Retried::OverQuota(_) => {
                *report.over_quota.entry(task.workspace_id).or_default() += 1;
            }
        }
    }
    Ok(report)
}
