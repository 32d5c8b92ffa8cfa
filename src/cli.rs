//! Command-line interface: one subcommand per job the binary does.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::check::CheckArgs;
use crate::mock_provider::MockProviderArgs;
use crate::produce::ProduceArgs;

#[derive(Debug, Parser)]
#[command(
    name = "replyd",
    version,
    about = "At most one saved LLM reply per task, from Kafka to PostgreSQL"
)]
pub struct Cli {
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, global = true, env = "REPLYD_LOG_JSON")]
    pub log_json: bool,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Join the consumer group and turn reply-task records into saved replies.
    Worker {
        /// Settings file (TOML); `REPLYD_*` environment variables override it.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Apply the database migrations and exit.
    Migrate {
        /// PostgreSQL URL (the password is never logged).
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
    },
    /// Run an OpenAI-compatible mock provider with latency and fault injection.
    MockProvider(MockProviderArgs),
    /// Publish reply-task records (with duplicates and malformed ones on request).
    Produce(ProduceArgs),
    /// Check the invariants against PostgreSQL, Kafka and the mock provider's counters.
    Check(CheckArgs),
    /// Show a task: state, attempts with outcomes and timings, saved reply.
    Inspect {
        /// The task id (UUID).
        task_id: String,
        /// PostgreSQL URL.
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
}
