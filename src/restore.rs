//! `replyd after-restore`: what makes a database restored to a point in time safe to run on.
//!
//! A point-in-time restore rolls replyd's database back while Kafka and the erasure log go on.
//! What it does to replyd, and what this command mends:
//! - Erasures made since the point are undone: their rows come back, and so does the absence
//!   of the `erasures` row that refuses a later record of the scope. Each one logged since the
//!   point (`database.erasure_log_url`, a database apart) is made again, first, so that no
//!   record read again below can bring an erased task back.
//! - Tasks written since the point are gone while their records are committed past. The
//!   group's offsets move back to the first record written at or after the point
//!   ([`crate::transport::kafka::rewind`]); the workers read those records again, and the worker's
//!   idempotence does the rest: a task the restored database holds finished is done without
//!   a call, a missing one is inserted and run.
//! - Ids forgotten since the point are remembered again by retention's next pass, by the
//!   same rule that forgot them.
//!
//! With SQS as the source, a message is deleted once its outcome is saved, so there is
//! nothing to read again: the command says so, and the tasks the restore lost are lost
//! (OPERATIONS says how to bound that).

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::config::Settings;
use crate::store::Store;
use crate::transport::kafka::rewind::Rewound;

/// What a run did, or with `dry_run` would do.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RestoreReport {
    pub restored_to: DateTime<Utc>,
    pub dry_run: bool,
    /// Erasures logged since the point, made again; None when no log is kept.
    pub erasures: Option<usize>,
    /// Tasks those erasures forgot again (0 in a dry run).
    pub tasks_erased: u64,
    /// Partitions whose committed offset moved back; None when the source is not Kafka.
    pub rewound: Option<Vec<Rewound>>,
}

impl RestoreReport {
    /// Records the workers will read again.
    pub fn records_to_read_again(&self) -> i64 {
        self.rewound.iter().flatten().map(|r| r.from - r.to).sum()
    }
}

impl std::fmt::Display for RestoreReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let verb = if self.dry_run { "would " } else { "" };
        match self.erasures {
            Some(n) => writeln!(
                f,
                "erasures logged since {}: {n}, {verb}made again ({} tasks erased again)",
                self.restored_to.to_rfc3339(),
                self.tasks_erased
            )?,
            None => writeln!(
                f,
                "no erasure log (database.erasure_log_url is empty): erasures made since {} are undone by the restore; make them again by hand",
                self.restored_to.to_rfc3339()
            )?,
        }
        match &self.rewound {
            Some(rewound) if rewound.is_empty() => {
                write!(f, "no partition committed past the restore point")
            }
            Some(rewound) => {
                write!(
                    f,
                    "{} partitions {verb}moved back, {} records to read again:",
                    rewound.len(),
                    self.records_to_read_again()
                )?;
                for r in rewound {
                    write!(f, " {}: {} → {}", r.partition, r.from, r.to)?;
                }
                Ok(())
            }
            None => write!(
                f,
                "the source is SQS: messages are deleted once saved, so tasks written since the restore point cannot be read again"
            ),
        }
    }
}

/// Makes the logged erasures again, then moves the group's offsets back.
pub async fn run(
    settings: &Settings,
    restored_to: DateTime<Utc>,
    dry_run: bool,
) -> anyhow::Result<RestoreReport> {
    let store = Store::connect(&settings.database).context("database settings")?;
    let logged = store
        .logged_erasures_since(restored_to)
        .await
        .context("reading the erasure log (database.erasure_log_url)")?;
    let mut tasks_erased = 0;
    if let Some(logged) = &logged
        && !dry_run
    {
        for entry in logged {
            let erased = crate::erasure::make_again(&store, &entry.erasure)
                .await
                .with_context(|| {
                    format!(
                        "making erasure {} again ({}; run the command again to finish)",
                        entry.id,
                        crate::erasure::describe(&entry.erasure)
                    )
                })?;
            tasks_erased += erased.forgotten.tasks;
        }
    }
    let rewound = settings
        .transports()
        .read_again_from(
            settings.worker.source,
            restored_to.timestamp_millis(),
            dry_run,
        )
        .await?;
    Ok(RestoreReport {
        restored_to,
        dry_run,
        erasures: logged.map(|l| l.len()),
        tasks_erased,
        rewound,
    })
}
