//! The `replyd-lab` binary: the mock provider, the simulated browsers, the producer, a
//! product's own server (the demo page signing its users in) and an SQS queue's set-up, one
//! subcommand each, for the demo, the benchmarks and the chaos harness. Nothing else lives here.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use replyd::config::Settings;
use replyd_lab::browsers::BrowsersArgs;
use replyd_lab::mock_provider::MockProviderArgs;
use replyd_lab::produce::ProduceArgs;
use replyd_lab::product::ProductArgs;

#[derive(Debug, Parser)]
#[command(
    name = "replyd-lab",
    version,
    about = "Try replyd from outside: a mock LLM provider, simulated browsers, a record producer"
)]
struct Cli {
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, global = true, env = "REPLYD_LOG_JSON")]
    log_json: bool,

    /// replyd's settings file (TOML), read by `produce` for Kafka; `REPLYD_<SECTION>__<KEY>`
    /// environment variables override it.
    #[arg(long, short, global = true, env = "REPLYD_CONFIG")]
    config: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run an OpenAI-compatible mock provider with latency and fault injection.
    MockProvider(MockProviderArgs),
    /// Publish reply-task records to kafka.topic (with duplicates and malformed ones on
    /// request).
    Produce(ProduceArgs),
    /// Simulated browsers pressing Send against a live API (retries with the same key, lost
    /// answers, double clicks, Regenerate, SSE follow); prints a JSON report.
    Browsers(BrowsersArgs),
    /// A product's own server: the demo page on its own origin, signing its users in with
    /// short-lived end-user tokens while it alone holds the workspace's key.
    Product(ProductArgs),
    /// Create an SQS queue with a dead-letter queue behind its RedrivePolicy on an
    /// SQS-compatible server (test credentials), optionally send malformed messages to it;
    /// prints the queue's URL, then the dead-letter queue's.
    SqsQueue(SqsQueueArgs),
}

#[derive(Debug, clap::Args)]
struct SqsQueueArgs {
    /// The server's endpoint (`SQS_ENDPOINT` of deploy/infra.sh).
    #[arg(long)]
    endpoint: String,
    #[arg(long)]
    name: String,
    /// Receives after which the queue moves a message to its dead-letter queue.
    #[arg(long, default_value_t = 10)]
    max_receive_count: u32,
    /// Malformed messages to send, as a broken producer would.
    #[arg(long, default_value_t = 0)]
    malformed: usize,
    /// Demo tasks to send (one message each), over this many conversations.
    #[arg(long, default_value_t = 0)]
    tasks: usize,
    #[arg(long, default_value_t = 8)]
    conversations: usize,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    replyd::telemetry::logging::init(cli.log_json, None);
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("replyd-lab: {}", replyd::telemetry::chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::MockProvider(args) => {
            let shutdown = replyd::serve::shutdown_on_signal();
            replyd_lab::mock_provider::run(args, async move { shutdown.cancelled().await })
                .await
                .context("mock provider")?;
        }
        Command::Produce(args) => {
            let settings = Settings::load(cli.config.as_deref())?;
            let report = replyd_lab::produce::run(&settings, &args)
                .await
                .context("producing")?;
            println!("{}", serde_json::to_string(&report)?);
        }
        Command::Product(args) => {
            let shutdown = replyd::serve::shutdown_on_signal();
            replyd_lab::product::run(args, async move { shutdown.cancelled().await })
                .await
                .context("product")?;
        }
        Command::SqsQueue(args) => {
            let sqs = replyd_lab::sqs::connect(&args.endpoint);
            let queues =
                replyd_lab::sqs::create_queues(&sqs, &args.name, args.max_receive_count).await?;
            let bodies: Vec<String> = (0..args.malformed)
                .map(|n| replyd_lab::sqs::body_of(&replyd_lab::produce::malformed_record(n).1))
                .collect();
            replyd_lab::sqs::send_bodies(&sqs, &queues.url, &bodies).await?;
            let workspace = format!("ws-{}", args.name);
            let tasks: Vec<_> = (0..args.tasks)
                .map(|n| {
                    replyd_lab::produce::demo_task(&workspace, n, args.conversations.max(1), 0)
                })
                .collect();
            replyd_lab::sqs::send_tasks(&sqs, &queues.url, &tasks, 1).await?;
            println!("{}\n{}", queues.url, queues.dead_letter_url);
        }
        Command::Browsers(args) => {
            let report = replyd_lab::browsers::run(&args).await.context("browsers")?;
            if let Some(path) = &args.latencies {
                let lines: String = report.e2e_ms.iter().map(|ms| format!("{ms}\n")).collect();
                std::fs::write(path, lines)
                    .with_context(|| format!("writing --latencies {}", path.display()))?;
            }
            if args.summary {
                println!("{}", report.summary_line());
            } else {
                println!("{}", serde_json::to_string(&report)?);
            }
        }
    }
    Ok(())
}
