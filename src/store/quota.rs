//! The quota's SQL (I8): setting a workspace's limit and period (a period change recounted
//! from the ledger under the counter row's lock), reading its counter and, for a refusal, the
//! facts its `Retry-After` is decided from, and the admission statement of the intake
//! transaction. Settling is not here: the trigger of `migrations/V7__quotas.sql` settles a
//! reservation in the transaction that ends its task.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::IsolationLevel;

use super::{Store, StoreError};
use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::{TaskId, TaskStatus};
use replyd_core::lease::lease_live;
use replyd_core::quota::{
    ExpiredTask, FirstExpiry, Limited, QuotaPolicy, RefusalFacts, Settle, Usage,
};

/// Admits one request and writes its reservation, in one statement: the workspace's counter
/// row is updated only while `used + reserved < limit` (`$5`: whether open reservations count)
/// and, in tokens, `tokens_used + tokens_reserved + ceiling <= token_limit`, rolling the window
/// over first when it has ended. The row lock serializes concurrent admissions of one
/// workspace, and the condition is evaluated again on the locked row, so two requests cannot
/// both take the last unit (or token). Only a submission whose key this transaction has just
/// written is admitted: a replay (the key was there) never touches the counter row, so it
/// neither waits on that lock nor holds it. A retry of a failed task (`replyd tasks retry`)
/// has no key: it is admitted as operation `retry`, keyed by the failed task's id, when the
/// task is the retry of that one. No row returned: refused or a replay, nothing changed.
/// `$1` workspace, `$2` task, `$3` operation, `$4` key, `$6` TTL in seconds, `$7` whether a
/// failure is charged, `$8` the request's token ceiling, `$9` the end user (or null): with the
/// workspace's `end_user_share_percent`, the user's own admitted-and-not-released
/// generations and tokens in the window must leave room too (their lock taken before, see
/// [`END_USER_LOCK`]).
pub(crate) const ADMIT: &str = "WITH now AS (SELECT clock_timestamp() AS at), \
     admitted AS ( \
       UPDATE quota_counters q \
          SET used = CASE WHEN replyd_quota_window(q.window_start, q.period_seconds, now.at) = q.window_start \
                          THEN q.used ELSE 0 END, \
              tokens_used = CASE WHEN replyd_quota_window(q.window_start, q.period_seconds, now.at) = q.window_start \
                          THEN q.tokens_used ELSE 0 END, \
              window_start = replyd_quota_window(q.window_start, q.period_seconds, now.at), \
              reserved = q.reserved + 1, tokens_reserved = q.tokens_reserved + $8, updated_at = now.at \
         FROM now \
        WHERE q.workspace_id = $1 \
          AND (EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.workspace_id = $1 \
                       AND k.operation = $3 AND k.idempotency_key = $4 AND k.task_id = $2) \
               OR EXISTS (SELECT 1 FROM reply_tasks r WHERE r.task_id = $2 \
                          AND $3 = 'retry' AND r.retry_of::text = $4)) \
          AND (q.generation_limit IS NULL OR \
              CASE WHEN replyd_quota_window(q.window_start, q.period_seconds, now.at) = q.window_start \
                   THEN q.used ELSE 0 END + CASE WHEN $5 THEN q.reserved ELSE 0 END < q.generation_limit) \
          AND (q.token_limit IS NULL OR \
              CASE WHEN replyd_quota_window(q.window_start, q.period_seconds, now.at) = q.window_start \
                   THEN q.tokens_used ELSE 0 END + CASE WHEN $5 THEN q.tokens_reserved ELSE 0 END + $8 \
              <= q.token_limit) \
          AND ($9::text IS NULL OR q.end_user_share_percent IS NULL OR ( \
              SELECT (q.generation_limit IS NULL \
                      OR u.generations < q.generation_limit * q.end_user_share_percent / 100) \
                 AND (q.token_limit IS NULL \
                      OR u.tokens + $8 <= q.token_limit * q.end_user_share_percent / 100) \
                FROM replyd_end_user_usage($1, $9, \
                       replyd_quota_window(q.window_start, q.period_seconds, now.at), $5) u)) \
       RETURNING q.workspace_id, now.at) \
     INSERT INTO quota_reservations (task_id, workspace_id, operation, idempotency_key, expires_at, \
       charge_on_failure, token_ceiling, end_user_id) \
     SELECT $2, workspace_id, $3, $4, at + make_interval(secs => $6), $7, $8, $9 FROM admitted \
     RETURNING task_id";

/// Taken in an end user's intake transaction just before [`ADMIT`]: the admission's snapshot,
/// taken after it, then holds every earlier reservation of the user, so two of their requests
/// at once cannot both take the share's last unit. (The counter row's lock alone would not do:
/// a statement that waited for it re-checks the row, not its subquery over the reservations.)
pub(crate) const END_USER_LOCK: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended('replyd.end_user/' || $1 || '/' || $2, 0))";

/// What an end user has of the workspace's quota in the current window, when a share is set.
#[derive(Debug, Clone, PartialEq)]
pub struct EndUserShare {
    pub percent: i16,
    /// The user's limits: the share of each workspace limit (none where it has none).
    pub generation_limit: Option<i64>,
    pub token_limit: Option<i64>,
    /// Admitted in the window and not released: charged, or reserved while open
    /// reservations count.
    pub generations: i64,
    pub tokens: i64,
    pub resets_at: DateTime<Utc>,
    /// The database's clock when this was read.
    pub now: DateTime<Utc>,
}

impl EndUserShare {
    /// Whether a request of `ceiling` tokens fits.
    pub fn admits(&self, ceiling: i64) -> bool {
        self.generation_limit.is_none_or(|l| self.generations < l)
            && self.token_limit.is_none_or(|l| self.tokens + ceiling <= l)
    }
}

/// A workspace's quota as `GET /v1/quota` and `replyd quota show` report it.
#[derive(Debug, Clone, PartialEq)]
pub struct QuotaState {
    pub usage: Usage,
    /// The same counter in tokens (`limit`: the workspace's token limit).
    pub tokens: Usage,
    pub period_seconds: i64,
    /// The share of each limit no one end user may pass, in percent; none when absent.
    pub end_user_share_percent: Option<i16>,
    /// The current window (the one that holds now).
    pub window_start: DateTime<Utc>,
    pub resets_at: DateTime<Utc>,
    /// The earliest `expires_at` of an open reservation.
    pub first_expiry: Option<DateTime<Utc>>,
    pub now: DateTime<Utc>,
}

impl QuotaState {
    pub fn until_reset(&self) -> Duration {
        (self.resets_at - self.now).to_std().unwrap_or_default()
    }
}

/// A workspace's quota read right after it refused a submission, with what the refusal's
/// `Retry-After` is estimated from.
#[derive(Debug, Clone, PartialEq)]
pub struct QuotaRefusal {
    pub state: QuotaState,
    /// The refused request's token ceiling.
    pub asked_tokens: i64,
    /// When the oldest open reservation was admitted.
    pub oldest_open_since: Option<DateTime<Utc>>,
    /// How long the workspace's latest [`SETTLE_HISTORY`] settled reservations (charged or
    /// released) took from admission to settlement, newest first.
    pub recent_settle_times: Vec<Duration>,
}

impl QuotaRefusal {
    /// Which limit refused the request: generations when they have no room, else tokens
    /// when the request's ceiling does not fit; generations (with room again) when neither.
    pub fn limited_by(&self, policy: QuotaPolicy) -> Limited {
        if !self.state.usage.admits(policy) {
            Limited::Generations
        } else if !self
            .state
            .tokens
            .in_units_of(self.asked_tokens)
            .admits(policy)
        {
            Limited::Tokens {
                asked: self.asked_tokens,
            }
        } else {
            Limited::Generations
        }
    }

    /// The facts as durations from the database's now, for [`replyd_core::quota::advise_retry`],
    /// about the limit that refused the request.
    pub fn facts(&self, policy: QuotaPolicy) -> RefusalFacts {
        let now = self.state.now;
        let since = |at: DateTime<Utc>| (now - at).to_std().unwrap_or_default();
        RefusalFacts {
            usage: match self.limited_by(policy) {
                Limited::Generations => self.state.usage,
                Limited::Tokens { asked } => self.state.tokens.in_units_of(asked),
            },
            until_window_end: self.state.until_reset(),
            first_expiry: self.state.first_expiry.map(|at| {
                if at > now {
                    FirstExpiry::In((at - now).to_std().unwrap_or_default())
                } else {
                    FirstExpiry::Passed(since(at))
                }
            }),
            oldest_open_age: self.oldest_open_since.map(since),
            recent_settle_times: self.recent_settle_times.clone(),
        }
    }
}

/// How many of a workspace's latest settlements a refusal's estimate looks at: enough for a
/// median that one slow reply does not move, few enough to be recent and to be read by one
/// short scan of `quota_reservations_settled` (V14).
pub const SETTLE_HISTORY: i64 = 50;

/// A workspace's counter as of now (a window that has ended reads as the new, empty one), its
/// open reservations' first expiry and oldest admission, and the settle times of its latest
/// `$2` settled reservations (0 for a plain read: `LIMIT 0` reads none of them).
const READ_QUOTA: &str = "SELECT q.generation_limit, q.period_seconds, \
     CASE WHEN w.start = q.window_start THEN q.used ELSE 0 END AS used, q.reserved, \
     q.token_limit, CASE WHEN w.start = q.window_start THEN q.tokens_used ELSE 0 END AS tokens_used, \
     q.tokens_reserved, q.end_user_share_percent, \
     w.start AS window_start, \
     w.start + make_interval(secs => q.period_seconds) AS resets_at, \
     o.first_expiry, o.oldest_open_since, \
     ARRAY(SELECT extract(epoch FROM r.settled_at - r.created_at)::float8 \
             FROM quota_reservations r \
            WHERE r.workspace_id = q.workspace_id AND r.state IN ('charged', 'released') \
            ORDER BY r.settled_at DESC LIMIT $2) AS recent_settle_seconds, \
     now.at AS now \
     FROM quota_counters q, (SELECT clock_timestamp() AS at) now, \
     LATERAL (SELECT replyd_quota_window(q.window_start, q.period_seconds, now.at) AS start) w, \
     LATERAL (SELECT min(r.expires_at) AS first_expiry, min(r.created_at) AS oldest_open_since \
                FROM quota_reservations r \
               WHERE r.workspace_id = q.workspace_id AND r.state = 'reserved') o \
     WHERE q.workspace_id = $1";

/// A period change's counter: the new period's epoch-aligned window that holds now, and as
/// `used` what the ledger charged inside it (settled at or after its start; nothing settles
/// after now). Run only under the counter row's lock (see [`Store::set_quota`]).
/// `$1` workspace, `$2` limit, `$3` period in seconds.
const RECOUNT_ON_PERIOD_CHANGE: &str = "WITH w AS ( \
       SELECT replyd_quota_window_of($3, clock_timestamp()) AS start) \
     UPDATE quota_counters q \
        SET generation_limit = $2, period_seconds = $3, window_start = w.start, \
            used = (SELECT count(*) FROM quota_reservations r \
                     WHERE r.workspace_id = q.workspace_id AND r.state = 'charged' \
                       AND r.settled_at >= w.start), \
            tokens_used = (SELECT coalesce(sum(r.tokens_charged), 0) FROM quota_reservations r \
                     WHERE r.workspace_id = q.workspace_id AND r.state = 'charged' \
                       AND r.settled_at >= w.start), \
            updated_at = clock_timestamp() \
       FROM w \
      WHERE q.workspace_id = $1";

impl Store {
    /// Sets `workspace_id`'s limit (None: no limit) and period; `false` when there is no such
    /// workspace. A change of the limit alone keeps the window and what was charged in it. A
    /// change of the period puts the counter on the new period's epoch-aligned window that
    /// holds now, with `used` recounted from the ledger: the reservations charged inside it.
    ///
    /// Why the recount is exact: a charge is a reservation turned `charged` (with its
    /// `settled_at`) by the same transaction that adds its unit to the counter row, which it
    /// locks to do so (`replyd_settle`), and the ledger is never purged. This transaction
    /// locks the counter row first, in a statement of its own; the recount is the next
    /// statement and, under READ COMMITTED, reads a snapshot taken after the lock was
    /// granted. So a settlement that committed before then is in the recount, and one that
    /// had not committed has not touched the counter row yet (else this lock would have
    /// waited for its commit): it waits for this commit, then adds its unit to the row
    /// written here. Every charge is counted once, by the recount or by itself. (One
    /// statement would not do: its snapshot is taken before it waits for the lock.) The
    /// recount places a charge by its `settled_at`, its own update by the clock a moment
    /// later in the same transaction; only a charge straddling a window's boundary by those
    /// microseconds could be counted in the neighbouring window, as either rule would.
    /// Admissions change `reserved` and roll the window over, never `used` within it.
    pub async fn set_quota(
        &self,
        workspace_id: &str,
        limit: Option<i64>,
        period_seconds: i64,
    ) -> Result<bool, StoreError> {
        let mut client = self.client().await?;
        // READ COMMITTED, stated: the recount must read a snapshot taken after the lock is
        // granted, where REPEATABLE READ would keep the locking statement's.
        let tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::ReadCommitted)
            .start()
            .await?;
        let Some(row) = tx
            .query_opt(
                "SELECT period_seconds FROM quota_counters WHERE workspace_id = $1 FOR UPDATE",
                &[&workspace_id],
            )
            .await?
        else {
            return Ok(false);
        };
        if row.get::<_, i64>("period_seconds") == period_seconds {
            tx.execute(
                "UPDATE quota_counters SET generation_limit = $2, updated_at = clock_timestamp() \
                 WHERE workspace_id = $1",
                &[&workspace_id, &limit],
            )
            .await?;
        } else {
            tx.execute(
                RECOUNT_ON_PERIOD_CHANGE,
                &[&workspace_id, &limit, &period_seconds],
            )
            .await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Sets `workspace_id`'s limit in tokens per period (None: no limit); `false` when there
    /// is no such workspace. The window and what was charged in it stay.
    pub async fn set_token_limit(
        &self,
        workspace_id: &str,
        limit: Option<i64>,
    ) -> Result<bool, StoreError> {
        self.wrote_one_row(
            "UPDATE quota_counters SET token_limit = $2, updated_at = clock_timestamp() \
             WHERE workspace_id = $1",
            &[&workspace_id, &limit],
        )
        .await
    }

    /// Sets (or, `None`, removes) the share of each of the workspace's limits no one end user
    /// may pass; whether the workspace exists.
    pub async fn set_end_user_share(
        &self,
        workspace_id: &str,
        percent: Option<i16>,
    ) -> Result<bool, StoreError> {
        self.wrote_one_row(
            "UPDATE quota_counters SET end_user_share_percent = $2, \
             updated_at = clock_timestamp() WHERE workspace_id = $1",
            &[&workspace_id, &percent],
        )
        .await
    }

    /// What `user` has of the workspace's quota in the current window, counted as [`ADMIT`]
    /// counts it; `None` when the workspace sets no share.
    pub async fn end_user_share(
        &self,
        workspace_id: &str,
        user: &str,
        pending_reserves: bool,
    ) -> Result<Option<EndUserShare>, StoreError> {
        let row = self
            .row_opt(
                "WITH now AS (SELECT clock_timestamp() AS at), \
                 q AS (SELECT q.*, now.at, replyd_quota_window(q.window_start, q.period_seconds, now.at) AS win \
                       FROM quota_counters q, now WHERE q.workspace_id = $1 \
                       AND q.end_user_share_percent IS NOT NULL) \
                 SELECT q.end_user_share_percent, \
                        q.generation_limit * q.end_user_share_percent / 100, \
                        q.token_limit * q.end_user_share_percent / 100, \
                        u.generations, u.tokens, \
                        q.win + make_interval(secs => q.period_seconds), q.at \
                 FROM q, replyd_end_user_usage($1, $2, q.win, $3) u",
                &[&workspace_id, &user, &pending_reserves],
            )
            .await?;
        Ok(row.map(|row| EndUserShare {
            percent: row.get(0),
            generation_limit: row.get(1),
            token_limit: row.get(2),
            generations: row.get(3),
            tokens: row.get(4),
            resets_at: row.get(5),
            now: row.get(6),
        }))
    }

    /// The workspace's quota now (a window that has ended reads as the new, empty one).
    pub async fn quota(&self, workspace_id: &str) -> Result<Option<QuotaState>, StoreError> {
        Ok(self
            .read_quota(workspace_id, 0)
            .await?
            .map(|refusal| refusal.state))
    }

    /// The workspace's quota right after a refusal, with the facts its `Retry-After` is
    /// estimated from.
    pub async fn quota_refusal(
        &self,
        workspace_id: &str,
        asked_tokens: i64,
    ) -> Result<Option<QuotaRefusal>, StoreError> {
        Ok(self
            .read_quota(workspace_id, SETTLE_HISTORY)
            .await?
            .map(|refusal| QuotaRefusal {
                asked_tokens,
                ..refusal
            }))
    }

    async fn read_quota(
        &self,
        workspace_id: &str,
        history: i64,
    ) -> Result<Option<QuotaRefusal>, StoreError> {
        let Some(row) = self.row_opt(READ_QUOTA, &[&workspace_id, &history]).await? else {
            return Ok(None);
        };
        let settle_seconds: Vec<f64> = row.get("recent_settle_seconds");
        Ok(Some(QuotaRefusal {
            state: QuotaState {
                usage: Usage {
                    limit: row.get("generation_limit"),
                    used: row.get("used"),
                    reserved: row.get("reserved"),
                },
                tokens: Usage {
                    limit: row.get("token_limit"),
                    used: row.get("tokens_used"),
                    reserved: row.get("tokens_reserved"),
                },
                period_seconds: row.get("period_seconds"),
                end_user_share_percent: row.get("end_user_share_percent"),
                window_start: row.get("window_start"),
                resets_at: row.get("resets_at"),
                first_expiry: row.get("first_expiry"),
                now: row.get("now"),
            },
            asked_tokens: 0,
            oldest_open_since: row.get("oldest_open_since"),
            // A settlement before its admission cannot happen (both by the database clock);
            // a negative or odd value reads as 0 rather than failing the refusal.
            recent_settle_times: settle_seconds
                .into_iter()
                .map(|s| Duration::try_from_secs_f64(s).unwrap_or_default())
                .collect(),
        }))
    }
}

/// A reservation past its TTL and what the reconciler needs of its task.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpiredReservation {
    pub task_id: TaskId,
    pub task: ExpiredTask,
    pub operation_id: Option<String>,
}

/// The statement that runs `$settling` (a settlement function over the terminal task `t`, `$1`
/// its id, `$2` who, `$3` why) and records the decision it made, in one statement. A macro, so
/// that each use is one constant text: the statements are kept prepared per session, and a
/// text made per call would grow each session's cache.
macro_rules! settle_recorded {
    ($settling:literal) => {
        concat!(
            "WITH settled AS ( \
               SELECT ",
            $settling,
            " AS state \
               FROM reply_tasks t WHERE t.task_id = $1 AND t.status IN ('completed', 'failed', 'cancelled')), \
             noted AS ( \
               INSERT INTO quota_decisions (task_id, decided_by, decision, reason) \
               SELECT $1, $2, state, $3 FROM settled WHERE state IS NOT NULL RETURNING decision) \
             SELECT (SELECT decision FROM noted)"
        )
    };
}

impl Store {
    /// How many open reservations are past their TTL now.
    pub async fn overdue_reservations(&self) -> Result<i64, StoreError> {
        let row = self
            .row(
                "SELECT count(*) FROM quota_reservations \
                 WHERE state = 'reserved' AND expires_at < clock_timestamp()",
                &[],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Up to `limit` open reservations past their TTL, the oldest first, with their tasks as
    /// the database sees them now. A task not yet terminal whose row changed (a claim, a
    /// renewal, a release) within `redelivery` was worked recently.
    pub async fn expired_reservations(
        &self,
        limit: i64,
        redelivery: Duration,
    ) -> Result<Vec<ExpiredReservation>, StoreError> {
        let rows = self
            .rows(
                "SELECT r.task_id, t.status, \
                 t.lease_until, c.now, \
                 t.provider_operation_id, coalesce(t.next_attempt_at > c.now, false) AS retry_due, \
                 t.provider_may_have_run, \
                 (t.status IN ('pending', 'running') \
                  AND t.updated_at > c.now - make_interval(secs => $2)) AS worked_recently \
                 FROM quota_reservations r JOIN reply_tasks t USING (task_id), \
                 (SELECT clock_timestamp() AS now) c \
                 WHERE r.state = 'reserved' AND r.expires_at < c.now \
                 ORDER BY r.expires_at LIMIT $1",
                &[&limit, &redelivery.as_secs_f64()],
            )
            .await?;
        rows.iter()
            .map(|row| {
                let status: &str = row.get("status");
                let status = TaskStatus::parse(status)
                    .ok_or_else(|| StoreError::Config(format!("unknown task status {status:?}")))?;
                let operation_id: Option<String> = row.get("provider_operation_id");
                Ok(ExpiredReservation {
                    task_id: TaskId::from(row.get::<_, uuid::Uuid>("task_id")),
                    task: ExpiredTask {
                        status,
                        lease_live: lease_live(status, row.get("lease_until"), row.get("now")),
                        has_operation: operation_id.is_some(),
                        retry_due_later: row.get("retry_due"),
                        may_have_run: row.get("provider_may_have_run"),
                        worked_recently: row.get("worked_recently"),
                    },
                    operation_id,
                })
            })
            .collect()
    }

    /// Keeps an open reservation for another `ttl` and records why; `false` when it was
    /// settled meanwhile (guarded on state = 'reserved').
    pub async fn extend_reservation(
        &self,
        task_id: TaskId,
        ttl: Duration,
        by: &str,
        why: &str,
    ) -> Result<bool, StoreError> {
        let row = self
            .row(
                "WITH extended AS ( \
                   UPDATE quota_reservations SET expires_at = clock_timestamp() + make_interval(secs => $2), \
                   extensions = extensions + 1 WHERE task_id = $1 AND state = 'reserved' RETURNING task_id), \
                 noted AS ( \
                   INSERT INTO quota_decisions (task_id, decided_by, decision, reason) \
                   SELECT task_id, $3, 'extend', $4 FROM extended RETURNING 1) \
                 SELECT count(*) FROM noted",
                &[&task_id.as_uuid(), &ttl.as_secs_f64(), &by, &why],
            )
            .await?;
        Ok(row.get::<_, i64>(0) == 1)
    }

    /// Settles the open reservation of a task that is already terminal, from its status (the
    /// trigger does this when the status is written; this mends a reservation that missed it).
    /// Returns the state it went to, or None when it was settled already.
    pub async fn settle_terminal(
        &self,
        task_id: TaskId,
        by: &str,
        why: &str,
    ) -> Result<Option<String>, StoreError> {
        self.settled(
            settle_recorded!("replyd_settle(t.task_id, t.status, $2, $3, false)"),
            &[&task_id.as_uuid(), &by, &why],
        )
        .await
    }

    /// Settles the open reservation of a task that is already terminal to `settle`, outright
    /// (an unresolved one: the task failed while the provider may have done its work).
    /// Returns the state it went to, or None when it was settled already.
    pub async fn settle_as(
        &self,
        task_id: TaskId,
        settle: Settle,
        by: &str,
        why: &str,
    ) -> Result<Option<String>, StoreError> {
        self.settled(
            settle_recorded!("replyd_settle_to(t.task_id, $4, $2, $3)"),
            &[&task_id.as_uuid(), &by, &why, &settle.state().as_str()],
        )
        .await
    }

    /// Runs one of `settle_recorded!`'s statements: the state the reservation went to, or
    /// None. `&'static str`: a constant text, as a statement kept prepared per session must be.
    async fn settled(
        &self,
        statement: &'static str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Option<String>, StoreError> {
        Ok(self.row(statement, params).await?.get(0))
    }

    /// Records a reconciler decision that changed the task itself (completed from the
    /// provider's work, or expired).
    pub async fn record_decision(
        &self,
        task_id: TaskId,
        by: &str,
        decision: &str,
        why: &str,
    ) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute(
                "INSERT INTO quota_decisions (task_id, decided_by, decision, reason) \
                 VALUES ($1, $2, $3, $4)",
                &[&task_id.as_uuid(), &by, &decision, &why],
            )
            .await?;
        Ok(())
    }
}
