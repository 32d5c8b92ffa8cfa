//! `replyd erase`: one workspace's or one conversation's data deleted, for good (see
//! [`crate::store::forgetting`] for what goes and what is remembered). The operator's command:
//! the scope, a dry run that counts, and a report of what went.

use anyhow::Context as _;
use serde::Serialize;

use crate::config::Settings;
use crate::store::forgetting::{Erased, ErasurePlan, ErasureScope};
use crate::store::{Store, StoreError};

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

fn describe(scope: &ErasureScope) -> String {
    match &scope.conversation_id {
        Some(conversation) => format!(
            "conversation {conversation} of workspace {}",
            scope.workspace_id
        ),
        None => format!("workspace {}", scope.workspace_id),
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

/// Erases `scope` (or, with `dry_run`, counts what would go).
pub async fn run(
    settings: &Settings,
    scope: &ErasureScope,
    dry_run: bool,
) -> anyhow::Result<ErasureReport> {
    let store = Store::connect(&settings.database).context("database settings")?;
    let described = describe(scope);
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
/// of the API's `DELETE /v1/conversations/{id}`.
pub async fn erase(store: &Store, scope: &ErasureScope) -> Result<Erased, StoreError> {
    let erased = store.erase(scope).await?;
    crate::telemetry::tasks_forgotten("erasure", erased.forgotten.tasks);
    Ok(erased)
}
