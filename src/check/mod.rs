//! `replyd check`: reads the durable state — PostgreSQL, the topic and its dead-letter twin, the
//! group's committed offsets, and (when given) the mock provider's counters — and reports
//! whether the invariants hold. Every figure is read back, none is taken from what a producer
//! meant to do. Every rule comes from the same settings as the worker's (`--config`), so a
//! record the worker refuses is a bad record here too.
//!
//! Three rooms: [`facts`] does the I/O ([`read_facts`]: plain values, judged by nothing), the
//! source's records read by their transport's room (`Transports::read_records`,
//! `transport::kafka::records` and `transport::sqs::records`), each judged as it is read by
//! I3's pure rule (`replyd_core::tally`); [`verdict`](mod@verdict) is pure and judges the counts; [`report`]
//! renders what it found. Memory does not grow with the data: a topic is read in batches (the
//! dead-letter copies into a session table, the source records judged against it and the tasks
//! batch by batch), and the tasks and attempts are counted by PostgreSQL. It judges:
//! - I1: `duplicate_replies` counts tasks with more than one accepted attempt in the history
//!   (the schema's constraints make a second saved reply impossible; the history is the
//!   independent witness).
//! - I3: `lost` counts records below the committed offset whose task is not terminal (or was
//!   never created) and bad records below it with no dead-letter copy. A task forgotten by
//!   retention or an erasure (`forgotten_tasks`) is done for good: its records are not lost.
//!   On an SQS source (a queue keeps no history of what it delivered): each task handed to
//!   the queue and not terminal needs a message of its own still in the queue, so `lost` is
//!   the open handed tasks beyond the queue's messages (exact once it is drained; SQS's counts
//!   are approximate for about a minute after a change).
//! - I7: `max_attempts_exceeded` counts tasks with more attempts than their budget: calls that
//!   may have cost money (attempt rows other than `refused`; a refusal gives its attempt back).

mod facts;
mod report;
mod verdict;

use std::process::ExitCode;

use clap::Args;

use crate::config::Settings;

pub use facts::{
    AttemptStats, CheckError, Facts, MockCounts, QuotaFacts, StatusCounts, read_facts,
};
pub use report::{Percentiles, Report};
pub use verdict::{percentile, verdict};

/// Exit code when an invariant is broken.
pub const INVARIANT_BROKEN: u8 = 3;

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// Base URL of the mock provider, to read its request counters.
    #[arg(long)]
    pub mock_url: Option<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Print one `key=value` line of the headline figures instead (for `make demo`).
    #[arg(long, conflicts_with = "json")]
    pub summary: bool,
}

/// Runs `replyd check` and prints the report; exit 3 when an invariant is broken.
pub async fn run_command(settings: &Settings, args: &CheckArgs) -> anyhow::Result<ExitCode> {
    let report = run(settings, args.mock_url.as_deref()).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else if args.summary {
        println!("{}", report.summary_line());
    } else {
        print!("{}", report.render_table());
    }
    Ok(if report.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(INVARIANT_BROKEN)
    })
}

/// Runs every check and returns the report.
pub async fn run(settings: &Settings, mock_url: Option<&str>) -> Result<Report, CheckError> {
    Ok(verdict(read_facts(settings, mock_url, None).await?))
}

/// [`run`] with an SQS client of the caller's (a tool's own credentials) instead of one from
/// the AWS chain.
pub async fn run_with_sqs(
    settings: &Settings,
    mock_url: Option<&str>,
    sqs: crate::transport::sqs::Sqs,
) -> Result<Report, CheckError> {
    Ok(verdict(read_facts(settings, mock_url, Some(sqs)).await?))
}
