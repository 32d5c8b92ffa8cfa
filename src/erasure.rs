//! `replyd erase`: one workspace's, one conversation's or one end user's data deleted, for
//! good (see [`crate::store::forgetting`] for what goes and what is remembered). The
//! operator's command: the scope, a dry run that counts, and a report of what went.

use anyhow::Context as _;
use serde::Serialize;

use crate::store::erasure_log::Erasure;
use crate::store::forgetting::{Erased, ErasurePlan, ErasureScope};
use crate::store::{DatabaseSettings, Store, StoreError};

/// What `replyd erase` erases, and how it reports.
#[derive(Debug, clap::Args)]
pub struct EraseArgs {
    /// The workspace.
    #[arg(long)]
    pub workspace: String,
    /// Only this conversation of it.
    #[arg(long, required_unless_present_any = ["whole_workspace", "end_user"])]
    pub conversation: Option<String>,
    /// Erase the whole workspace (instead of --conversation).
    #[arg(long, conflicts_with_all = ["conversation", "end_user"])]
    pub whole_workspace: bool,
    /// Only the conversations this end user began (their tokens are revoked first).
    #[arg(long, conflicts_with = "conversation")]
    pub end_user: Option<String>,
    /// Count what would be erased; write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What a run did, or with `dry_run` would do.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(tag = "run", rename_all = "snake_case")]
pub enum ErasureReport {
    Counted {
        scope: String,
        #[serde(flatten)]
        plan: ErasurePlan,
    },
    Erased {
        scope: String,
        #[serde(flatten)]
        erased: Erased,
    },
}

/// An erasure in the operator's words, for reports and errors (`replyd erase`, `replyd
/// after-restore`).
pub fn describe(erasure: &Erasure) -> String {
    match erasure {
        Erasure::Scope(scope) => match &scope.conversation_id {
            Some(conversation) => format!(
                "conversation {conversation} of workspace {}",
                scope.workspace_id
            ),
            None => format!("workspace {}", scope.workspace_id),
        },
        Erasure::EndUser {
            workspace_id,
            user_id,
        } => format!("end user {user_id:?} of workspace {workspace_id}"),
    }
}

impl std::fmt::Display for ErasureReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ErasureReport::Counted { scope, plan } => write!(
                f,
                "{scope}: would erase {} tasks ({} not finished: they end now), {} messages, {} API keys; nothing written",
                plan.tasks, plan.open_tasks, plan.messages, plan.api_keys
            ),
            ErasureReport::Erased { scope, erased } => {
                let e = &erased.forgotten;
                write!(
                    f,
                    "{scope}: erased {} tasks with {} attempts and {} messages ({} more messages without a task); {} unfinished tasks ended ({} charged, {} released); {} API keys{}; a record of it that comes later is refused",
                    e.tasks,
                    e.attempts,
                    e.messages,
                    erased.other_messages,
                    e.charged + e.released,
                    e.charged,
                    e.released,
                    erased.api_keys,
                    if erased.workspace {
                        "; the workspace is gone"
                    } else {
                        ""
                    }
                )
            }
        }
    }
}

/// `replyd erase`: an end user's conversations, or one conversation, or a whole workspace.
pub async fn command(
    database: &DatabaseSettings,
    args: &EraseArgs,
) -> anyhow::Result<ErasureReport> {
    match &args.end_user {
        Some(user) => run_end_user(database, &args.workspace, user, args.dry_run).await,
        None => {
            let scope = ErasureScope {
                workspace_id: args.workspace.clone(),
                conversation_id: args.conversation.clone(),
            };
            run(database, &scope, args.dry_run).await
        }
    }
}

/// Erases `scope` (or, with `dry_run`, counts what would go).
async fn run(
    database: &DatabaseSettings,
    scope: &ErasureScope,
    dry_run: bool,
) -> anyhow::Result<ErasureReport> {
    let store = Store::connect(database).context("database settings")?;
    let described = describe(&Erasure::Scope(scope.clone()));
    if dry_run {
        let plan = store
            .erasure_plan(scope)
            .await
            .with_context(|| format!("counting what erasing {described} deletes"))?;
        return Ok(ErasureReport::Counted {
            scope: described,
            plan,
        });
    }
    let erased = erase(&store, scope)
        .await
        .with_context(|| format!("erasing {described} (run it again to finish)"))?;
    Ok(ErasureReport::Erased {
        scope: described,
        erased,
    })
}

/// Erases `scope` and counts the tasks it forgot: the one erasure of the operator's command and
/// of the API's `DELETE /v1/conversations/{id}`. Logged first (`database.erasure_log_url`), so
/// a restore cannot undo it for good.
pub async fn erase(store: &Store, scope: &ErasureScope) -> Result<Erased, StoreError> {
    store.log_erasure(&Erasure::Scope(scope.clone())).await?;
    carry_out(store, scope).await
}

/// Erases `scope`, already logged (or made again from the log).
async fn carry_out(store: &Store, scope: &ErasureScope) -> Result<Erased, StoreError> {
    let erased = store.erase(scope).await?;
    crate::telemetry::tasks_forgotten("erasure", erased.forgotten.tasks);
    Ok(erased)
}

/// Makes a logged erasure again, as it was first made, without logging it twice: after a
/// restore (`replyd after-restore`).
pub async fn make_again(store: &Store, erasure: &Erasure) -> Result<Erased, StoreError> {
    match erasure {
        Erasure::Scope(scope) => carry_out(store, scope).await,
        Erasure::EndUser {
            workspace_id,
            user_id,
        } => Ok(erase_end_user_logged(store, workspace_id, user_id)
            .await?
            .erased),
    }
}

/// Most rounds of an end user's erasure: each erases the conversations the user has, and a
/// request authenticated just before their tokens were revoked may still begin one.
const END_USER_ROUNDS: usize = 5;

/// What erasing an end user did: their conversations, each erased as `DELETE
/// /v1/conversations/{id}` erases one, and all that went with them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ErasedEndUser {
    pub conversations: u64,
    #[serde(flatten)]
    pub erased: Erased,
}

/// Erases every conversation `user` of `workspace` began, after revoking their tokens (so no
/// new one begins meanwhile; the user's id stays, with its token generation, so that the
/// tokens issued before stay refused). Other users' data and the workspace's own
/// conversations are not touched. Running it again finishes an interrupted run.
pub async fn erase_end_user(
    store: &Store,
    workspace: &str,
    user: &str,
) -> Result<ErasedEndUser, StoreError> {
    store
        .log_erasure(&Erasure::EndUser {
            workspace_id: workspace.to_owned(),
            user_id: user.to_owned(),
        })
        .await?;
    erase_end_user_logged(store, workspace, user).await
}

/// [`erase_end_user`] once its entry is in the log: each conversation is part of it, not an
/// entry of its own.
async fn erase_end_user_logged(
    store: &Store,
    workspace: &str,
    user: &str,
) -> Result<ErasedEndUser, StoreError> {
    store.revoke_end_user(workspace, user).await?;
    let mut done = ErasedEndUser::default();
    for _ in 0..END_USER_ROUNDS {
        let conversations = store.end_user_conversations(workspace, user).await?;
        if conversations.is_empty() {
            break;
        }
        for conversation in conversations {
            let scope = ErasureScope {
                workspace_id: workspace.to_owned(),
                conversation_id: Some(conversation),
            };
            done.erased.add(carry_out(store, &scope).await?);
            done.conversations += 1;
        }
    }
    Ok(done)
}

/// `replyd erase --end-user`: erases (or, with `dry_run`, counts) an end user's data.
async fn run_end_user(
    database: &DatabaseSettings,
    workspace: &str,
    user: &str,
    dry_run: bool,
) -> anyhow::Result<ErasureReport> {
    let store = Store::connect(database).context("database settings")?;
    let described = describe(&Erasure::EndUser {
        workspace_id: workspace.to_owned(),
        user_id: user.to_owned(),
    });
    if dry_run {
        let mut plan = ErasurePlan::default();
        for conversation in store
            .end_user_conversations(workspace, user)
            .await
            .with_context(|| format!("reading the conversations of {described}"))?
        {
            let scope = ErasureScope {
                workspace_id: workspace.to_owned(),
                conversation_id: Some(conversation),
            };
            plan.add(
                store
                    .erasure_plan(&scope)
                    .await
                    .with_context(|| format!("counting what erasing {described} deletes"))?,
            );
        }
        return Ok(ErasureReport::Counted {
            scope: described,
            plan,
        });
    }
    let done = erase_end_user(&store, workspace, user)
        .await
        .with_context(|| format!("erasing {described} (run it again to finish)"))?;
    Ok(ErasureReport::Erased {
        scope: format!("{described} ({} conversations)", done.conversations),
        erased: done.erased,
    })
}
