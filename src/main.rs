//! The `replyd` binary: parses the command line, sets up logging and signal handling, and
//! hands over to the library. Nothing else lives here.

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

use replyd::cli::{Cli, Command};
use replyd::config::{DatabaseSettings, Secret, Settings};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_json);
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "replyd failed");
            eprintln!("replyd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Worker { config } => {
            // Listen for SIGTERM before anything else: a worker stopped during start-up then
            // leaves through its drain path too, instead of dying of the signal.
            let shutdown = shutdown_on_signal();
            let settings = Settings::load(config.as_deref()).context("settings")?;
            replyd::worker::run_worker(settings, shutdown).await?;
        }
        Command::Migrate { database_url } => {
            let settings = DatabaseSettings {
                url: Secret::new(database_url),
                ..DatabaseSettings::default()
            };
            let applied = replyd::store::migrate::run_migrations(&settings)
                .await
                .context("applying migrations")?;
            tracing::info!(applied = applied.len(), migrations = ?applied, "schema is up to date");
        }
        Command::MockProvider(args) => {
            let shutdown = shutdown_on_signal();
            replyd::mock_provider::run(args, async move { shutdown.cancelled().await })
                .await
                .context("mock provider")?;
        }
        Command::Produce(args) => {
            let report = replyd::produce::run(&args).await.context("producing")?;
            println!("{}", serde_json::to_string(&report)?);
        }
        Command::Inspect {
            task_id,
            database_url,
            json,
        } => {
            let id = replyd::domain::TaskId::parse(&task_id)
                .with_context(|| format!("task id {task_id:?} is not a UUID"))?;
            let store = replyd::store::Store::connect(&DatabaseSettings {
                url: Secret::new(database_url),
                ..DatabaseSettings::default()
            })?;
            let Some(task) = store.read(id).await? else {
                eprintln!("replyd: no task {id}");
                return Ok(ExitCode::from(4));
            };
            let attempts = store.attempts(id).await?;
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "task_id": id,
                        "status": task.status.as_str(),
                        "attempt_count": task.attempt_count,
                        "max_attempts": task.spec.max_attempts,
                        "deadline": task.spec.deadline,
                        "assignment_version": task.assignment_version,
                        "next_attempt_at": task.next_attempt_at,
                        "last_error_class": task.last_error_class,
                        "last_error": task.last_error,
                        "provider_operation_id": task.provider_operation_id,
                        "failure": task.failure,
                        "saved_response": task.saved_response,
                        "attempts": attempts,
                    })
                );
            } else {
                print!("{}", replyd::inspect::render(&task, &attempts));
            }
        }
        Command::Check(args) => {
            let report = replyd::check::run(&args).await.context("checking")?;
            if args.json {
                println!("{}", serde_json::to_string(&report)?);
            } else if args.summary {
                println!("{}", report.summary_line());
            } else {
                println!("{report:#?}");
            }
            if !report.violations.is_empty() {
                return Ok(ExitCode::from(3));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A token cancelled on the first SIGTERM or SIGINT: the worker drains and leaves the group.
fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        // Installing a handler only fails if the runtime has no signal driver; ours has.
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        }
        cancel.cancel();
    });
    token
}

fn init_logging(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
