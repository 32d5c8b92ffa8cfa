//! The `replyd` binary: parses the command line, sets up logging, and hands over to the
//! library. Nothing else lives here.

use anyhow::Context;
use clap::Parser;
use tracing_subscriber::EnvFilter;

use replyd::cli::{Cli, Command};
use replyd::config::DatabaseSettings;
use replyd::store::migrate::run_migrations;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log_json);
    match &cli.command {
        Command::Migrate { .. } => {
            let settings = DatabaseSettings {
                url: cli.command.database_url(),
                ..DatabaseSettings::default()
            };
            let applied = run_migrations(&settings)
                .await
                .context("applying migrations")?;
            tracing::info!(applied = applied.len(), migrations = ?applied, "schema is up to date");
        }
    }
    Ok(())
}

fn init_logging(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
