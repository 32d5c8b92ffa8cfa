//! Command-line interface: one subcommand per job the binary does. Every command that reads
//! settings reads them the same way: `--config FILE` (or `REPLYD_CONFIG`), then the
//! `REPLYD_<SECTION>__<KEY>` environment variables.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::check::CheckArgs;
use crate::dead_letters::ReplayArgs;
use crate::erasure::EraseArgs;
use crate::retries::RetryArgs;

/// `replyd --version`: the release and the commit it was built from. The commit comes from
/// `REPLYD_COMMIT` at build time (`make image` passes it to the image's build); a build
/// without it says so rather than guess.
pub static VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{} (commit {})",
        env!("CARGO_PKG_VERSION"),
        option_env!("REPLYD_COMMIT").unwrap_or("unknown: built without REPLYD_COMMIT")
    )
});

#[derive(Debug, Parser)]
#[command(
    name = "replyd",
    version = VERSION.as_str(),
    about = "At most one saved LLM reply per task, from Kafka to PostgreSQL"
)]
pub struct Cli {
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, global = true, env = "REPLYD_LOG_JSON")]
    pub log_json: bool,

    /// Settings file (TOML); `REPLYD_<SECTION>__<KEY>` environment variables override it
    /// (e.g. `REPLYD_DATABASE__URL`). Every key is optional (see deploy/replyd.example.toml).
    #[arg(long, short, global = true, env = "REPLYD_CONFIG")]
    pub config: Option<PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Join the consumer group and turn reply-task records into saved replies.
    Worker,
    /// Serve the HTTP API (api.listen) until SIGTERM/SIGINT.
    Api,
    /// Publish the outbox's tasks to kafka.topic until SIGTERM/SIGINT.
    Relay,
    /// The API, the relay and a worker in one process (small installations, the demo).
    Serve,
    /// Reconcile the quota reservations past their TTL once (the relay does it every 10 s) and
    /// print what was decided as JSON.
    Reconcile,
    /// Print the HTTP API's OpenAPI document (what `/openapi.json` serves) and exit.
    Openapi,
    /// Make the task topic (kafka.topic) and its dead-letter topic exist before the workers
    /// start.
    #[command(subcommand)]
    Topics(TopicsCommand),
    /// Work on tasks: retry failed ones.
    #[command(subcommand)]
    Tasks(TasksCommand),
    /// Send dead-lettered records back to the task topic once what refused them is fixed.
    #[command(subcommand)]
    DeadLetters(DeadLettersCommand),
    /// Erase one conversation's data, one end user's (every conversation they began), or a
    /// whole workspace's: its tasks (an unfinished one
    /// ends now, its reservation charged if the provider may have done the work), attempts,
    /// replies, messages, reservations, idempotency records and outbox rows; for a workspace
    /// also its API keys, quota counter and row. The erased tasks' ids and the scope are
    /// remembered for retention.forgotten_ms, so a record of them still in the topic is
    /// refused, not run again. Running it again finishes an interrupted run.
    #[command(
        after_help = "Exit codes: 0 erased (or, with --dry-run, counted); 1 could not read or write."
    )]
    Erase(EraseArgs),
    /// Make a database restored to a point in time safe to run on: make again every erasure
    /// logged since that point (database.erasure_log_url), then move the group's committed
    /// offsets back to the first record written at or after it, so the tasks the restore lost
    /// are read again. Stop every worker first (Kafka moves a group's offsets only while it
    /// has no member), start them after. See OPERATIONS "Backup and restore".
    #[command(
        after_help = "Exit codes: 0 done (or, with --dry-run, counted); 1 could not read or write (run it again: each step is safe to repeat)."
    )]
    AfterRestore(AfterRestoreArgs),
    /// Apply the database migrations (database.url) and exit.
    Migrate,
    /// Ask this machine's replyd process whether it is alive (`/healthz` on
    /// observability.listen): a container health check without curl in the image.
    #[command(after_help = "Exit codes: 0 alive; 1 no answer or not alive.")]
    Healthz,
    /// Check the invariants against PostgreSQL, Kafka (kafka.topic, kafka.group_id) and the
    /// mock provider's counters.
    #[command(
        after_help = "Exit codes: 0 every invariant holds; 3 an invariant is broken \
        (named in the output); 1 the check could not run (settings, connection)."
    )]
    Check(CheckArgs),
    /// Show a task: state, attempts with outcomes and timings, saved reply.
    #[command(after_help = "Exit codes: 0 shown; 4 no such task; 1 could not read it.")]
    Inspect {
        /// The task id (UUID).
        task_id: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Validate or print the settings.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Manage workspaces (the tenants API keys belong to).
    #[command(subcommand)]
    Workspace(WorkspaceCommand),
    /// Manage API keys.
    #[command(subcommand, name = "api-key")]
    ApiKey(ApiKeyCommand),
    /// End users' tokens of a workspace.
    #[command(subcommand)]
    EndUserTokens(EndUserTokensCommand),
    /// Set or show a workspace's generation quota.
    #[command(subcommand)]
    Quota(QuotaCommand),
}

#[derive(Debug, Subcommand)]
pub enum TasksCommand {
    /// Runs failed tasks again as new tasks (the same request, a new attempt budget), after
    /// what failed them is over (a provider outage). Each failed task is retried once
    /// however often this runs; a new task is admitted by its workspace's quota like new work
    /// and handed to the workers by the relay. The failed tasks stay failed, with their history.
    #[command(
        after_help = "Exit codes: 0 done (or, with --dry-run, counted); 1 could not read or write."
    )]
    Retry(RetryArgs),
}

#[derive(Debug, Subcommand)]
pub enum DeadLettersCommand {
    /// Replays the copies on kafka.dead_letter_topic (up to its end now) to kafka.topic: the
    /// original key, value and producer headers. The worker judges each again; one still bad
    /// is dead-lettered again, one whose task exists is answered from it.
    #[command(
        after_help = "Exit codes: 0 replayed (or, with --dry-run, counted); 1 could not read or send."
    )]
    Replay(ReplayArgs),
}

#[derive(Debug, Subcommand)]
pub enum TopicsCommand {
    /// Create kafka.topic and kafka.dead_letter_topic where missing, with `--partitions` each;
    /// a topic that exists is left as it is (one with fewer partitions is named: more would
    /// move conversations' keys).
    #[command(
        after_help = "Exit codes: 0 both exist; 1 could not reach the brokers or create one."
    )]
    Ensure {
        /// Partitions of a topic created now: at least the worker replicas to keep busy.
        #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(i32).range(1..))]
        partitions: i32,
        /// Replicas of each partition of a topic created now; the brokers'
        /// default.replication.factor when not given.
        #[arg(long, value_parser = clap::value_parser!(i32).range(1..))]
        replication_factor: Option<i32>,
        /// Print JSON lines instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum QuotaCommand {
    /// Set a workspace's limits per period: generations (`--limit`), tokens (`--tokens`), or
    /// both; `none` removes one. What is not given stays as it is.
    #[command(
        after_help = "Exit codes: 0 set; 2 a bad limit or period, or nothing to set; 4 no such workspace."
    )]
    Set {
        #[arg(long)]
        workspace: String,
        /// Generations per period, or `none`.
        #[arg(long)]
        limit: Option<String>,
        /// Tokens per period, or `none`: each request reserves its ceiling (its prompt's
        /// bytes, 8 a message, and its output bound) and is charged what its reply reported.
        #[arg(long)]
        tokens: Option<String>,
        /// The period: a number of d, h, m or s (windows aligned to the Unix epoch); the
        /// current one when absent (1d for a new workspace).
        #[arg(long)]
        period: Option<String>,
        /// The share of each limit no one end user may pass in a window, in percent (1 to
        /// 100), or `none`: what their tokens had admitted and not released counts.
        #[arg(long)]
        end_user_share: Option<String>,
    },
    /// Show a workspace's quota: limit, used, reserved, when it resets, and the policy.
    #[command(after_help = "Exit codes: 0 shown; 4 no such workspace.")]
    Show {
        workspace: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum WorkspaceCommand {
    /// Create a workspace (lowercase letters, digits, `-`, `_`; at most 63 characters).
    #[command(after_help = "Exit codes: 0 created or already there; 2 a bad name.")]
    Create { name: String },
    /// Set what a workspace's requests may ask for: the models (`--models a,b` or `any`) and
    /// the most output tokens (`--max-output-tokens N` or `none`). A request outside them is a
    /// `422` naming the field; one that names no `max_output_tokens` asks for the cap. And its
    /// system turn: its own system prompt (`--system-prompt TEXT`, `--system-prompt-file
    /// PATH`, or `none`), which every new task of the workspace is asked with, and whether its
    /// end users' tokens may send `context` (`--end-user-context allow|deny`; deny unless
    /// set: such a request is a `422`). What is not given stays as it is; with nothing given,
    /// the policy is shown.
    #[command(after_help = "Exit codes: 0 set or shown; 2 a bad value; 4 no such workspace.")]
    Policy {
        workspace: String,
        #[arg(long)]
        models: Option<String>,
        #[arg(long)]
        max_output_tokens: Option<String>,
        /// The system prompt (at most 32 KiB, and under `worker.max_prompt_bytes`), or `none`.
        #[arg(long, conflicts_with = "system_prompt_file")]
        system_prompt: Option<String>,
        /// The system prompt, read from a UTF-8 file.
        #[arg(long)]
        system_prompt_file: Option<std::path::PathBuf>,
        /// `allow` or `deny`: whether end users' tokens may send `context`.
        #[arg(long)]
        end_user_context: Option<String>,
    },
    /// Set how long a workspace's finished tasks are kept (their replies, attempts, messages,
    /// reservations and idempotency records): `--tasks 30d` (d, h, m or s), or `none` for the
    /// deployment's `retention.tasks_ms`. Deleted by the relay's retention rounds, never while
    /// a task's idempotency record or open reservation still needs it.
    #[command(after_help = "Exit codes: 0 set; 2 a bad value; 4 no such workspace.")]
    Retention {
        workspace: String,
        #[arg(long)]
        tasks: String,
    },
    /// Set or show a workspace's weight (1 to 1,000; 1 unless set): its share of the provider's
    /// capacity and of the workers' windows while other workspaces' work waits too (I10). A
    /// workspace of weight 2 gets twice the calls of one of weight 1; alone, any workspace gets
    /// all the capacity. Workers read weights every 10 seconds.
    #[command(after_help = "Exit codes: 0 set or shown; 2 a bad value; 4 no such workspace.")]
    Share {
        workspace: String,
        #[arg(long, value_parser = clap::value_parser!(i32).range(1..=1000))]
        weight: Option<i32>,
    },
}

#[derive(Debug, Subcommand)]
pub enum ApiKeyCommand {
    /// Make a key for a workspace. The key is printed once and stored only as its hash.
    #[command(after_help = "Exit codes: 0 made; 4 no such workspace.")]
    Create {
        #[arg(long)]
        workspace: String,
        /// The key stops authenticating this many days from now (and the end-user tokens it
        /// asked for with it). Without it, the key lives until revoked.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=3650))]
        expires_in_days: Option<u32>,
    },
    /// List keys (of one workspace, or all): id, workspace, made, expiry, last use (written
    /// at most once a minute per API process), revoked. Never a key or its hash.
    List {
        #[arg(long)]
        workspace: Option<String>,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key by its id (the part after `rpd_`, before the second `_`).
    #[command(after_help = "Exit codes: 0 revoked (or already); 4 no such key.")]
    Revoke { key_id: String },
}

#[derive(Debug, Subcommand)]
pub enum EndUserTokensCommand {
    /// Revoke every end-user token of a workspace at once: its signing secret is rotated, the
    /// tokens signed so far verify until the overlap ends, and tokens asked for from now on
    /// are signed with a new secret. (One user's tokens: `POST /v1/end-users/{id}/revoke`;
    /// the tokens of one key: `replyd api-key revoke`.) API processes see the rotation
    /// within 10 s.
    #[command(after_help = "Exit codes: 0 rotated; 4 no such workspace.")]
    Rotate {
        #[arg(long)]
        workspace: String,
        /// How long the tokens signed so far keep working (0: they stop now, within the API
        /// processes' 10 s). Default 0.
        #[arg(long, default_value_t = 0)]
        overlap_seconds: u64,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate the settings (file and environment) and name every problem; with
    /// `--connect`, also reach what they point at.
    #[command(
        after_help = "Exit codes: 0 valid (and, with --connect, everything answered); 2 invalid (every problem printed); 5 a part did not answer as it should (each named)."
    )]
    Check {
        /// Also connect: PostgreSQL (and whether its schema has every migration), the Kafka
        /// brokers and both topics, the provider's model list with the configured key. Each
        /// part within 20 s; nothing is written.
        #[arg(long)]
        connect: bool,
    },
    /// Print the effective settings as TOML, secrets shown as ***.
    Show,
    /// Print the reference of every setting (key, type, default, environment variable,
    /// meaning) as Markdown: docs/CONFIGURATION.md.
    Reference,
}

/// The restore `replyd after-restore` makes safe, and how it reports.
#[derive(Debug, Args)]
pub struct AfterRestoreArgs {
    /// The restore's target time (RFC 3339), or a little earlier: the database holds
    /// nothing written after it.
    #[arg(long)]
    pub restored_to: chrono::DateTime<chrono::Utc>,
    /// Say what would be done; write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}
