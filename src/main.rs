//! The `replyd` binary: parses the command line, sets up logging and signal handling, and
//! hands over to the library. Nothing else lives here.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;

use replyd::cli::{Cli, Command, ConfigCommand, DeadLettersCommand, TasksCommand, TopicsCommand};
use replyd::config::{ConfigError, Settings};
use replyd::serve::{self, Parts};

/// Exit code of settings that do not validate.
const INVALID_SETTINGS: u8 = 2;

/// Exit code of `config check --connect` when a part did not answer as it should.
const UNREACHABLE: u8 = 5;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = cli.log_json;
    // Traces first: the log set-up installs their exporter's layer beside its own.
    let traces = match traces_of(&cli.command) {
        Ok(traces) => traces,
        Err(e) => {
            replyd::telemetry::logging::init(json, None);
            let text = replyd::telemetry::chain(&e);
            if json {
                tracing::error!(error = text, "replyd failed");
            } else {
                eprintln!("replyd: {text}");
            }
            return ExitCode::from(INVALID_SETTINGS);
        }
    };
    replyd::telemetry::logging::init(json, traces.as_ref());
    if let Some(traces) = &traces {
        traces.announce();
    }
    let ran = run(cli).await;
    if let Some(traces) = traces {
        // The exporter's thread blocks while it flushes; the runtime has finished its work.
        tokio::task::block_in_place(|| traces.shutdown());
    }
    match ran {
        Ok(code) => code,
        Err(e) => {
            // Once: a JSON log line for machines, or plain text for people.
            let text = replyd::telemetry::chain(e.as_ref());
            if json {
                tracing::error!(error = text, "replyd failed");
            } else {
                eprintln!("replyd: {text}");
            }
            match e.downcast_ref::<ConfigError>() {
                Some(_) => ExitCode::from(INVALID_SETTINGS),
                None => ExitCode::FAILURE,
            }
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    // Listen for SIGTERM before anything else: a worker stopped during start-up then leaves
    // through its drain path too, instead of dying of the signal.
    let shutdown = serve::shutdown_on_signal();
    let settings = || Settings::load(cli.config.as_deref()).map_err(anyhow::Error::from);
    match cli.command {
        Command::Worker => serve::run(settings()?, Parts::WORKER, shutdown).await?,
        Command::Api => serve::run(settings()?, Parts::API, shutdown).await?,
        Command::Relay => serve::run(settings()?, Parts::RELAY, shutdown).await?,
        Command::Serve => serve::run(settings()?, Parts::ALL, shutdown).await?,
        Command::Reconcile => {
            let settings = settings()?;
            let report =
                replyd::reconcile::run_command(&settings.database, &settings.reconcile_settings())
                    .await
                    .context("reconciling the quota reservations")?;
            println!("{}", serde_json::to_string(&report)?);
        }
        Command::Openapi => print!("{}", replyd::api::openapi::document()),
        Command::Healthz => {
            let listen = settings()?.observability.listen;
            replyd::probes::probe_health(listen)
                .await
                .with_context(|| format!("/healthz on {listen} (observability.listen)"))?;
        }
        Command::Topics(TopicsCommand::Ensure {
            partitions,
            replication_factor,
            json,
        }) => {
            let wanted = replyd::topics::Wanted {
                partitions,
                replication_factor,
            };
            for report in replyd::topics::ensure(&settings()?, wanted).await? {
                print_report(&report, json)?;
            }
        }
        Command::Tasks(TasksCommand::Retry(args)) => {
            print_report(&replyd::retries::run(&settings()?, &args).await?, args.json)?;
        }
        Command::AfterRestore(args) => {
            let report = replyd::restore::run(&settings()?, args.restored_to, args.dry_run).await?;
            print_report(&report, args.json)?;
        }
        Command::Erase(args) => {
            let report = replyd::erasure::command(&settings()?.database, &args).await?;
            print_report(&report, args.json)?;
        }
        Command::DeadLetters(DeadLettersCommand::Replay(args)) => {
            print_report(
                &replyd::dead_letters::replay(&settings()?, &args).await?,
                args.json,
            )?;
        }
        Command::Migrate => {
            let applied = replyd::store::migrate::run_migrations(&settings()?.database)
                .await
                .context("applying migrations")?;
            tracing::info!(applied = applied.len(), migrations = ?applied, "schema is up to date");
        }
        Command::Inspect { task_id, json } => {
            return replyd::inspect::run(&settings()?, &task_id, json).await;
        }
        Command::Check(args) => return replyd::check::run_command(&settings()?, &args).await,
        Command::Config(ConfigCommand::Check { connect }) => {
            let settings = settings()?;
            // The trace variables too, as the long-running parts read them.
            let traces = replyd::telemetry::trace::TraceSettings::from_env(
                |name| std::env::var(name).ok(),
                "replyd",
            )?;
            println!("settings are valid");
            match traces {
                Some(traces) => println!("traces: exported to {}", traces.endpoint),
                None => println!("traces: off (OTEL_EXPORTER_OTLP_ENDPOINT is not set)"),
            }
            if connect {
                let reached = replyd::reach::check(&settings).await;
                for part in &reached {
                    println!("{part}");
                }
                if reached.iter().any(|part| part.answer.is_err()) {
                    return Ok(ExitCode::from(UNREACHABLE));
                }
            }
        }
        Command::Config(ConfigCommand::Show) => print!("{}", settings()?.to_redacted_toml()),
        Command::Config(ConfigCommand::Reference) => {
            print!("{}", replyd::config::reference::markdown())
        }
        Command::Workspace(command) => {
            return replyd::tenants::workspace(&settings()?, &command).await;
        }
        Command::ApiKey(command) => return replyd::tenants::api_key(&settings()?, &command).await,
        Command::EndUserTokens(command) => {
            return replyd::tenants::end_user_tokens(&settings()?, &command).await;
        }
        Command::Quota(command) => return replyd::tenants::quota(&settings()?, &command).await,
    }
    Ok(ExitCode::SUCCESS)
}

/// The trace exporter of a long-running part (`OTEL_EXPORTER_OTLP_ENDPOINT` turns it on),
/// named after the part; the one-shot commands send no traces.
fn traces_of(
    command: &Command,
) -> Result<Option<replyd::telemetry::trace::Traces>, replyd::telemetry::trace::TraceSetupError> {
    use replyd::telemetry::trace::{TraceSettings, Traces};
    let service = match command {
        Command::Worker => "replyd-worker",
        Command::Api => "replyd-api",
        Command::Relay => "replyd-relay",
        Command::Serve => "replyd",
        _ => return Ok(None),
    };
    match TraceSettings::from_env(|name| std::env::var(name).ok(), service)? {
        Some(settings) => Traces::start(&settings).map(Some),
        None => Ok(None),
    }
}

/// Prints a one-shot command's report: one JSON line with `--json`, else its text.
fn print_report<R: serde::Serialize + std::fmt::Display>(
    report: &R,
    json: bool,
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!("{report}");
    }
    Ok(())
}
