//! Command-line interface: one subcommand per job the binary does.

use clap::{Parser, Subcommand};

use crate::config::Secret;

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
    /// Apply the database migrations and exit.
    Migrate {
        /// PostgreSQL URL (the password is never logged).
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
    },
}

impl Command {
    /// The database URL, wrapped so it cannot end up in a log line.
    pub fn database_url(&self) -> Secret {
        match self {
            Command::Migrate { database_url } => Secret::new(database_url.clone()),
        }
    }
}
