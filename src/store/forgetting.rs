//! Forgetting tasks (migration V21): retention deletes finished tasks past their age, an
//! erasure deletes one workspace's or one conversation's data. Both delete through
//! `replyd_forget`, which remembers each deleted id in `forgotten_tasks`: a record of a
//! forgotten task (still in the topic, or replayed from the dead letters) finds it forgotten
//! and is done without a call, so forgetting never buys a second generation. The ids are
//! remembered for `retention.forgotten_ms`, which must outlast the topic's own retention.

use std::time::Duration;

use tokio_postgres::types::ToSql;
use uuid::Uuid;

use replyd_core::domain::TaskId;

use super::Store;
use super::error::StoreError;

/// The advisory lock class of erasures (`replyd_insert_task`, V21): "rpyd" in ASCII.
const ERASURE_LOCK_CLASS: i32 = 0x7270_7964;

/// Tasks forgotten per `replyd_forget` call: one bounded transaction each.
const FORGET_BATCH: i64 = 500;

/// What an erasure covers: a whole workspace, or one of its conversations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErasureScope {
    pub workspace_id: String,
    pub conversation_id: Option<String>,
}

impl ErasureScope {
    /// The scope's key in `erasures`: the conversation, or `''` for the whole workspace.
    fn conversation_key(&self) -> &str {
        self.conversation_id.as_deref().unwrap_or("")
    }

    /// The condition on `reply_tasks` or `messages` rows of the scope: `$1` the workspace, and
    /// `$2` the conversation when there is one.
    fn rows(&self) -> &'static str {
        match self.conversation_id {
            Some(_) => "workspace_id = $1 AND conversation_id = $2",
            None => "workspace_id = $1",
        }
    }

    /// The parameters of [`Self::rows`]: the workspace, then the conversation if there is one.
    fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&self.workspace_id];
        if let Some(conversation) = &self.conversation_id {
            params.push(conversation);
        }
        params
    }

    /// The scope's tasks, finished ones and open ones apart, so that each half is read through
    /// its own partial index (`reply_tasks_finished_by_conversation`, `reply_tasks_open`).
    fn tasks(&self, select: &str) -> String {
        let rows = self.rows();
        format!(
            "SELECT {select} FROM reply_tasks WHERE status IN ('completed', 'failed', 'cancelled') AND {rows} \
             UNION ALL SELECT {select} FROM reply_tasks WHERE status IN ('pending', 'running') AND {rows}"
        )
    }
}

/// What forgetting deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Forgotten {
    pub tasks: u64,
    pub attempts: u64,
    pub messages: u64,
    /// Open tasks ended by an erasure, and how their reservations were settled.
    pub charged: u64,
    pub released: u64,
}

impl Forgotten {
    fn add(&mut self, other: Forgotten) {
        self.tasks += other.tasks;
        self.attempts += other.attempts;
        self.messages += other.messages;
        self.charged += other.charged;
        self.released += other.released;
    }
}

/// What an erasure deleted besides the tasks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Erased {
    #[serde(flatten)]
    pub forgotten: Forgotten,
    /// Messages of the scope that had no task left.
    pub other_messages: u64,
    /// For a workspace: its API keys, and whether its row (with its quota counter) went.
    pub api_keys: u64,
    pub workspace: bool,
}

impl Erased {
    /// Both erasures' counts together (an end user's conversations, erased one by one).
    pub fn add(&mut self, other: Erased) {
        self.forgotten.add(other.forgotten);
        self.other_messages += other.other_messages;
        self.api_keys += other.api_keys;
        self.workspace |= other.workspace;
    }
}

/// What an erasure would delete, counted without deleting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ErasurePlan {
    pub tasks: i64,
    pub open_tasks: i64,
    pub messages: i64,
    pub api_keys: i64,
}

impl ErasurePlan {
    /// Both plans' counts together.
    pub fn add(&mut self, other: ErasurePlan) {
        self.tasks += other.tasks;
        self.open_tasks += other.open_tasks;
        self.messages += other.messages;
        self.api_keys += other.api_keys;
    }
}

/// The counts of a row that selected `tasks, attempts, messages, charged, released` from
/// `replyd_forget`. The statements name them, never `*`: they are kept prepared per session,
/// and a later release that adds a column to the function's result would make every kept
/// `SELECT *` fail ("cached plan must not change result type") while this release still runs
/// beside it.
fn counts(row: &tokio_postgres::Row) -> Forgotten {
    let n = |i: usize| u64::try_from(row.get::<_, i64>(i)).unwrap_or(0);
    Forgotten {
        tasks: n(0),
        attempts: n(1),
        messages: n(2),
        charged: n(3),
        released: n(4),
    }
}

impl Store {
    /// Whether `task_id` was forgotten (and is still remembered as such).
    pub async fn is_forgotten(&self, task_id: TaskId) -> Result<bool, StoreError> {
        Ok(self
            .row(
                "SELECT EXISTS (SELECT 1 FROM forgotten_tasks WHERE task_id = $1)",
                &[&task_id.as_uuid()],
            )
            .await?
            .get(0))
    }

    /// Forgets `tasks` in one transaction (`replyd_forget`).
    async fn forget(&self, tasks: &[Uuid], reason: &str) -> Result<Forgotten, StoreError> {
        let row = self
            .row(
                "SELECT tasks, attempts, messages, charged, released \
                 FROM replyd_forget($1, $2)",
                &[&tasks, &reason],
            )
            .await?;
        Ok(counts(&row))
    }

    /// One round of retention: forgets up to `limit` tasks finished longer ago than their
    /// workspace's retention (`workspaces.task_retention_seconds`, V25), else `age` (none:
    /// kept unless their workspace says otherwise), oldest first. A task whose idempotency
    /// record is still remembered (a client's retry must still find it), whose reservation is
    /// still open (unresolved work), or whose reservation was settled in its workspace's
    /// current quota window (a period change recounts the window from the reservations) waits.
    pub async fn forget_finished(
        &self,
        age: Option<Duration>,
        limit: i64,
    ) -> Result<Forgotten, StoreError> {
        // The selection and the deletion in one statement (one round trip); an empty
        // selection forgets nothing. The shortest retention of any workspace bounds the scan
        // of the finished tasks' index; each task is then held to its own workspace's.
        let secs = age.map(|a| a.as_secs_f64());
        let row = self
            .row(
                "WITH shortest AS (SELECT least($1::float8, \
                     (SELECT min(task_retention_seconds)::float8 FROM workspaces)) AS secs) \
                 SELECT tasks, attempts, messages, charged, released FROM replyd_forget(ARRAY(SELECT t.task_id FROM reply_tasks t \
                   LEFT JOIN workspaces w ON w.workspace_id = t.workspace_id, shortest \
                   WHERE t.status IN ('completed', 'failed', 'cancelled') \
                     AND t.finished_at < clock_timestamp() - make_interval(secs => shortest.secs) \
                     AND t.finished_at < clock_timestamp() \
                         - make_interval(secs => coalesce(w.task_retention_seconds::float8, $1)) \
                     AND NOT EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.task_id = t.task_id \
                                      AND k.expires_at > clock_timestamp()) \
                     AND NOT EXISTS (SELECT 1 FROM quota_reservations r \
                                     JOIN quota_counters q USING (workspace_id) \
                                     WHERE r.task_id = t.task_id \
                                       AND (r.state = 'reserved' OR r.settled_at >= q.window_start)) \
                   ORDER BY t.finished_at LIMIT $2), 'retention')",
                &[&secs, &limit],
            )
            .await?;
        Ok(counts(&row))
    }

    /// Sets (or, `None`, removes) the workspace's own retention of its finished tasks; whether
    /// the workspace exists.
    pub async fn set_task_retention(
        &self,
        workspace_id: &str,
        seconds: Option<i64>,
    ) -> Result<bool, StoreError> {
        self.wrote_one_row(
            "UPDATE workspaces SET task_retention_seconds = $2 WHERE workspace_id = $1",
            &[&workspace_id, &seconds],
        )
        .await
    }

    /// Deletes up to `limit` remembered ids (and erased scopes) older than `age`: by then no
    /// record of them is left in the topic.
    pub async fn purge_forgotten(&self, age: Duration, limit: i64) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let secs = age.as_secs_f64();
        let ids = client
            .execute(
                "DELETE FROM forgotten_tasks WHERE task_id IN (SELECT task_id FROM forgotten_tasks \
                 WHERE forgotten_at < clock_timestamp() - make_interval(secs => $1) \
                 ORDER BY forgotten_at LIMIT $2)",
                &[&secs, &limit],
            )
            .await?;
        let scopes = client
            .execute(
                "DELETE FROM erasures WHERE erased_at < clock_timestamp() - make_interval(secs => $1)",
                &[&secs],
            )
            .await?;
        Ok(ids + scopes)
    }

    /// What [`Self::erase`] would delete now.
    pub async fn erasure_plan(&self, scope: &ErasureScope) -> Result<ErasurePlan, StoreError> {
        let client = self.client().await?;
        let rows = scope.rows();
        let sql = format!(
            "SELECT (SELECT count(*) FROM ({tasks}) t), \
               (SELECT count(*) FROM reply_tasks WHERE status IN ('pending', 'running') AND {rows}), \
               (SELECT count(*) FROM messages WHERE {rows}), \
               (SELECT count(*) FROM api_keys WHERE workspace_id = $1 AND {whole})",
            tasks = scope.tasks("task_id"),
            whole = scope.conversation_id.is_none(),
        );
        let row = client.query_one(&sql, &scope.params()).await?;
        Ok(ErasurePlan {
            tasks: row.get(0),
            open_tasks: row.get(1),
            messages: row.get(2),
            api_keys: row.get(3),
        })
    }

    /// Up to `limit` task ids of `scope`.
    async fn scope_tasks(&self, scope: &ErasureScope, limit: i64) -> Result<Vec<Uuid>, StoreError> {
        let client = self.client().await?;
        let sql = format!("{} LIMIT {limit}", scope.tasks("task_id"));
        let rows = client.query(&sql, &scope.params()).await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Erases `scope`: first its scope is written (under the workspace's erasure lock, so every
    /// insert that read the scopes before is committed, and every later one refuses the
    /// scope's records), then its tasks are forgotten in batches until none is left, then its
    /// remaining messages go, and for a whole workspace its API keys, its quota counter and
    /// its row. Running it again finishes what an interrupted run left.
    pub async fn erase(&self, scope: &ErasureScope) -> Result<Erased, StoreError> {
        let conversation = scope.conversation_key();
        {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            tx.execute(
                "SELECT pg_advisory_xact_lock($1, replyd_erasure_lock($2))",
                &[&ERASURE_LOCK_CLASS, &scope.workspace_id],
            )
            .await?;
            tx.execute(
                "INSERT INTO erasures (workspace_id, conversation_id) VALUES ($1, $2) \
                 ON CONFLICT DO NOTHING",
                &[&scope.workspace_id, &conversation],
            )
            .await?;
            tx.commit().await?;
        }
        let mut erased = Erased::default();
        loop {
            let ids = self.scope_tasks(scope, FORGET_BATCH).await?;
            if ids.is_empty() {
                break;
            }
            erased.forgotten.add(self.forget(&ids, "erasure").await?);
        }
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        erased.other_messages = tx
            .execute(
                &format!("DELETE FROM messages WHERE {}", scope.rows()),
                &scope.params(),
            )
            .await?;
        tx.execute(
            &format!("DELETE FROM conversations WHERE {}", scope.rows()),
            &scope.params(),
        )
        .await?;
        if scope.conversation_id.is_none() {
            // What is left of the workspace refers to it alone: its keys (hashes), the
            // idempotency records and reservations of tasks gone above (none), its counter.
            erased.api_keys = tx
                .execute(
                    "DELETE FROM api_keys WHERE workspace_id = $1",
                    &[&scope.workspace_id],
                )
                .await?;
            for table in [
                "idempotency_keys",
                "quota_counters",
                // Its end users' generations, its signing secrets (no token of it verifies)
                // and the charges its end users' forgotten tasks kept.
                "end_users",
                "end_user_token_secrets",
                "end_user_signing_keys",
                "end_user_charges_kept",
            ] {
                tx.execute(
                    &format!("DELETE FROM {table} WHERE workspace_id = $1"),
                    &[&scope.workspace_id],
                )
                .await?;
            }
            erased.workspace = tx
                .execute(
                    "DELETE FROM workspaces WHERE workspace_id = $1",
                    &[&scope.workspace_id],
                )
                .await?
                > 0;
        }
        tx.commit().await?;
        Ok(erased)
    }
}
