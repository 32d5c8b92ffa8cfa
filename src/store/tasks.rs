//! Task operations: ensure, claim, renew, complete, fail, release, read. The hot path's two,
//! the claim and the completion, are server-side functions (migration V9), so each is one
//! round trip; the others send their statements from here, each guarded change through the
//! fenced write ([`super::fence`]). Saving the reply and completing the task are one UPDATE
//! (I4); the reply is never overwritten (I1).

use std::time::Duration;

use tokio_postgres::types::Json as PgJson;
use uuid::Uuid;

use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::{
    AttemptOutcome, AttemptRecord, CapacityWait, ProviderRan, RecordSource, StoredTask, StreamEnd,
    TaskId, TaskSpec, TokenUsage,
};

use replyd_core::lease::{ClaimOutcome, Lease, Refusal, classify_refusal};
use replyd_core::provider::Generation;

use super::Store;
use super::claims::{ClaimAnswer, ClaimCall};
use super::completions::BatchAnswer;
use super::error::StoreError;
use super::fence::{self, AttemptWrite, FencedUpdate, is_own_earlier_write, record_refusal};
use super::rows::{
    CompletionOutcome, EnsureOutcome, FailOutcome, Release, ReleaseOutcome, RenewOutcome,
    TASK_COLUMNS, Taken, insert_columns, invalid, seconds, snapshot_from, taken_from, task_from,
};

impl Store {
    /// Inserts the task from a record if it is absent. A record that disagrees with the stored
    /// task's inputs is reported as [`EnsureOutcome::Conflict`] and not applied.
    pub async fn ensure_task(&self, spec: &TaskSpec) -> Result<EnsureOutcome, StoreError> {
        let client = self.client().await?;
        let (request, max_attempts) = insert_columns(spec.task_id.as_uuid(), spec)?;
        // The same insert as the claim's (`replyd_insert_task`, migration V9).
        let statement = client
            .prepare_cached("SELECT replyd_insert_task($1, $2, $3, $4, $5, $6, $7, $8)")
            .await?;
        let inserted: bool = client
            .query_one(
                &statement,
                &[
                    &spec.task_id.as_uuid(),
                    &spec.workspace_id,
                    &spec.conversation_id,
                    &spec.message_id,
                    &spec.document_version,
                    &request,
                    &max_attempts,
                    &spec.deadline,
                ],
            )
            .await?
            .get(0);
        if inserted {
            return Ok(EnsureOutcome::Created);
        }
        drop(client);
        // The row exists (inputs never change once written), so reading it after the failed
        // insert sees the winner's inputs; or the task is forgotten, and no row comes back.
        let Some(stored) = self.read(spec.task_id).await? else {
            return if self.is_forgotten(spec.task_id).await? {
                Ok(EnsureOutcome::Forgotten)
            } else {
                Err(invalid(
                    spec.task_id.as_uuid(),
                    "vanished after insert conflict",
                ))
            };
        };
        let fields = stored.spec.disagreements(spec);
        Ok(if fields.is_empty() {
            EnsureOutcome::Exists
        } else {
            EnsureOutcome::Conflict { fields }
        })
    }

    /// Claims the task for `owner` with a lease of `lease` by the database clock: pending, or
    /// running with an expired lease, under budget and before the deadline, becomes running
    /// with `assignment_version + 1` and one more attempt (and an attempt row). A claim past the
    /// budget or the deadline marks the task failed instead.
    pub async fn claim(
        &self,
        task_id: TaskId,
        owner: &str,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        Ok(self
            .claim_task(task_id, owner, lease, None, None)
            .await?
            .claim)
    }

    /// [`Self::claim`] in one call and one transaction (`replyd_claim`, migration V9), that
    /// also returns the row as the claim left it, so the caller need not read it first. With
    /// `insert`, the record's task is inserted first if it is absent ([`Self::ensure_task`]
    /// in the same call): a record's whole claim is one round trip. A claim made for a record
    /// names it (`source`): a claim that takes the lease writes it on the task and the
    /// attempt (migration V21).
    pub async fn claim_task(
        &self,
        task_id: TaskId,
        owner: &str,
        lease: Duration,
        insert: Option<&TaskSpec>,
        source: Option<RecordSource>,
    ) -> Result<Taken, StoreError> {
        let call = ClaimCall {
            task_id,
            owner,
            lease,
            insert,
            source,
        };
        if let Some(batcher) = &self.claimer {
            match batcher.claim(call).await? {
                ClaimAnswer::Done(taken) => return Ok(*taken),
                ClaimAnswer::Busy { inserted } => {
                    let mut taken = self.claim_alone(call).await?;
                    if inserted {
                        // This record's batch inserted the row; the lone claim found it.
                        taken.ensured = Some(EnsureOutcome::Created);
                    }
                    return Ok(taken);
                }
            }
        }
        self.claim_alone(call).await
    }

    /// One claim, one call: `replyd_claim`, which waits on the row's lock.
    async fn claim_alone(&self, call: ClaimCall<'_>) -> Result<Taken, StoreError> {
        let ClaimCall {
            task_id,
            owner,
            lease,
            insert,
            source,
        } = call;
        let id = task_id.as_uuid();
        let (request, max_attempts) = insert
            .map(|spec| insert_columns(id, spec))
            .transpose()?
            .unzip();
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "SELECT * FROM replyd_claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
            )
            .await?;
        let row = client
            .query_one(
                &statement,
                &[
                    &id,
                    &owner,
                    &seconds(lease),
                    &insert.map(|s| s.workspace_id.as_str()),
                    &insert.map(|s| s.conversation_id.as_str()),
                    &insert.map(|s| s.message_id.as_str()),
                    &insert.map(|s| s.document_version.as_str()),
                    &request,
                    &max_attempts,
                    &insert.and_then(|s| s.deadline),
                    &source.map(|s| s.partition),
                    &source.map(|s| s.offset),
                    &source.is_some_and(|s| s.held_alone),
                ],
            )
            .await?;
        let created: bool = row.get("created");
        taken_from(id, &row, insert, created)
    }

    /// Extends a live lease of the current assignment by `lease` from now (database clock).
    pub async fn renew(&self, lease: &Lease, extend: Duration) -> Result<RenewOutcome, StoreError> {
        super::renewals::renew_one(&self.sessions, lease, extend).await
    }

    /// Saves `response` and completes the task in one guarded UPDATE, accepted only from the
    /// current assignment with a live lease and no saved reply (I1, I2, I4). With
    /// `database.batch_completions`, goes out with the completions that arrive meanwhile
    /// ([`super::completions`]); alone otherwise, or when its row is locked by someone else.
    pub async fn complete(
        &self,
        lease: &Lease,
        response: &str,
        meta: Option<&Generation>,
    ) -> Result<CompletionOutcome, StoreError> {
        if let Some(batcher) = &self.batcher {
            match batcher.complete(lease, response, meta).await? {
                BatchAnswer::Done(outcome) => return Ok(outcome),
                BatchAnswer::Busy => {}
            }
        }
        self.complete_alone(lease, response, meta).await
    }

    /// One completion, one call and one transaction (`replyd_complete`, migration V9) when
    /// accepted; a refusal is recorded on the attempt row by a second statement.
    async fn complete_alone(
        &self,
        lease: &Lease,
        response: &str,
        meta: Option<&Generation>,
    ) -> Result<CompletionOutcome, StoreError> {
        let id = lease.task_id;
        // Written straight into the parameter, with no JSON tree built in between.
        let meta = meta.map(PgJson);
        let client = self.client().await?;
        let statement = client
            .prepare_cached("SELECT * FROM replyd_complete($1, $2, $3, $4)")
            .await?;
        let Some(row) = client
            .query_opt(&statement, &[&id, &lease.version, &response, &meta])
            .await?
        else {
            return Ok(CompletionOutcome::Refused(Refusal::NotFound));
        };
        if row.get::<_, bool>("accepted") {
            return Ok(CompletionOutcome::Accepted);
        }
        // Read under the lock the refused write held: the reason, not a later state.
        let refusal = classify_refusal(&snapshot_from(id, &row)?, lease.version);
        if !is_own_earlier_write(&refusal) {
            record_refusal(&client, lease, &refusal).await?;
        }
        Ok(CompletionOutcome::Refused(refusal))
    }

    /// Marks the task failed for good with `reason`, fenced like a completion. `outcome` is the
    /// attempt's outcome (`provider_error`, `timeout`, `ambiguous`, `failed`); `ran` says
    /// whether this attempt's call may have done work at the provider (remembered on the task:
    /// its reservation is then held unresolved instead of released, I8).
    pub async fn fail(
        &self,
        lease: &Lease,
        reason: &str,
        outcome: AttemptOutcome,
        ran: ProviderRan,
    ) -> Result<FailOutcome, StoreError> {
        self.fail_with(lease, reason, outcome, ran, None).await
    }

    async fn fail_with(
        &self,
        lease: &Lease,
        reason: &str,
        outcome: AttemptOutcome,
        ran: ProviderRan,
        prelude: Option<&'static str>,
    ) -> Result<FailOutcome, StoreError> {
        let result = fence::write(
            &self.sessions,
            lease,
            FencedUpdate {
                set: "status = 'failed', failure = $3, \
                 provider_may_have_run = provider_may_have_run OR $4, \
                 attempt_count = attempt_count - CASE WHEN $5 THEN 1 ELSE 0 END, \
                 refusals = refusals + CASE WHEN $5 THEN 1 ELSE 0 END, \
                 finished_at = clock_timestamp(), updated_at = clock_timestamp()",
                returning: "task_id",
            },
            &[
                &lease.task_id,
                &lease.version,
                &reason,
                &ran.may_have(),
                // A refusal that ends the task still cost nothing: its attempt is given back.
                &(outcome == AttemptOutcome::Refused),
            ],
            AttemptWrite::Outcome {
                outcome,
                detail: Some(reason),
            },
            prelude,
        )
        .await?;
        Ok(match result {
            Ok(_) => FailOutcome::Failed,
            Err(refusal) => FailOutcome::Refused(refusal),
        })
    }

    /// Ends the task as failed with `reason` on behalf of the quota's reconciler, fenced like a
    /// failure, and settles its reservation as `settle` says in the same transaction (the
    /// settlement trigger reads `replyd.settle_as`): `expired` when nobody worked the task in
    /// time, or, for a task whose provider may have run it, what `quota.charge_unresolved`
    /// says.
    pub async fn expire(
        &self,
        lease: &Lease,
        reason: &str,
        settle: replyd_core::quota::Settle,
    ) -> Result<FailOutcome, StoreError> {
        let prelude = match settle {
            replyd_core::quota::Settle::Charge => "SET LOCAL replyd.settle_as = 'charged'",
            replyd_core::quota::Settle::Release => "SET LOCAL replyd.settle_as = 'released'",
            replyd_core::quota::Settle::Expire => "SET LOCAL replyd.settle_as = 'expired'",
        };
        self.fail_with(
            lease,
            reason,
            AttemptOutcome::Abandoned,
            ProviderRan::No,
            Some(prelude),
        )
        .await
    }

    /// Gives the lease back before it runs out: the task returns to pending so the next claim
    /// (another worker after a revocation, or this one retrying) need not wait out the lease.
    /// The attempt keeps its place in the budget (I7) and gets `outcome`. Fenced like a
    /// completion.
    pub async fn release(
        &self,
        lease: &Lease,
        outcome: AttemptOutcome,
        detail: &str,
        ran: ProviderRan,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.release_as(
            lease,
            &Release {
                outcome,
                detail,
                retry_after: Duration::ZERO,
                error_class: None,
                ran,
                give_back: false,
                refusal_budget: None,
            },
        )
        .await
    }

    /// Gives the lease back after an attempt ended without a reply, as `release` says: the
    /// backoff in the row (no claim, by anyone, after any restart, before
    /// `clock_timestamp() + retry_after`), the error class remembered for the next attempt's
    /// decision, whether the call may have run remembered for good, and, for a call that
    /// surely cost nothing, the attempt given back (I7: attempts count calls that may have
    /// cost money), with a provider's refusal counted and the refusal budget started if it has
    /// not started yet.
    pub async fn release_as(
        &self,
        lease: &Lease,
        release: &Release<'_>,
    ) -> Result<ReleaseOutcome, StoreError> {
        let refused = release.refusal_budget.is_some();
        let result = fence::write(
            &self.sessions,
            lease,
            FencedUpdate {
                set: "status = 'pending', lease_owner = NULL, lease_until = NULL, \
                 next_attempt_at = clock_timestamp() + make_interval(secs => $3), \
                 last_error_class = coalesce($4, last_error_class), \
                 last_error = CASE WHEN $4::text IS NULL THEN last_error ELSE $5 END, \
                 provider_may_have_run = provider_may_have_run OR $6, \
                 attempt_count = attempt_count - CASE WHEN $7 THEN 1 ELSE 0 END, \
                 refusals = refusals + CASE WHEN $8 THEN 1 ELSE 0 END, \
                 refusal_deadline = CASE WHEN $8 THEN coalesce(refusal_deadline, \
                     clock_timestamp() + make_interval(secs => $9)) ELSE refusal_deadline END, \
                 updated_at = clock_timestamp()",
                returning: "task_id",
            },
            &[
                &lease.task_id,
                &lease.version,
                &seconds(release.retry_after),
                &release.error_class,
                &release.detail,
                &release.ran.may_have(),
                &release.give_back,
                &refused,
                &seconds(release.refusal_budget.unwrap_or_default()),
            ],
            AttemptWrite::Outcome {
                outcome: release.outcome,
                detail: Some(release.detail),
            },
            None,
        )
        .await?;
        Ok(match result {
            Ok(_) => ReleaseOutcome::Released,
            Err(refusal) => ReleaseOutcome::Refused(refusal),
        })
    }

    /// Stores the provider's id of the operation this assignment started, before waiting on
    /// it, so any later attempt (this worker, a restarted one, a taker-over) looks the
    /// operation up instead of generating again. `None` forgets it (the provider no longer
    /// knows the operation). Fenced like a completion; records nothing on the attempt row.
    /// A stored id also marks the task `provider_may_have_run`: the provider accepted work.
    pub async fn record_operation(
        &self,
        lease: &Lease,
        operation_id: Option<&str>,
    ) -> Result<Result<(), Refusal>, StoreError> {
        let result = fence::write(
            &self.sessions,
            lease,
            FencedUpdate {
                set: "provider_operation_id = $3, \
                 provider_may_have_run = provider_may_have_run OR $3::text IS NOT NULL, \
                 updated_at = clock_timestamp()",
                returning: "task_id",
            },
            &[&lease.task_id, &lease.version, &operation_id],
            AttemptWrite::Nothing,
            None,
        )
        .await?;
        Ok(result.map(|_| ()))
    }

    /// The task as stored, or `None`.
    pub async fn read(&self, task_id: TaskId) -> Result<Option<StoredTask>, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(&format!(
                "SELECT {TASK_COLUMNS} FROM reply_tasks WHERE task_id = $1"
            ))
            .await?;
        client
            .query_opt(&statement, &[&task_id.as_uuid()])
            .await?
            .as_ref()
            .map(task_from)
            .transpose()
    }

    /// The task as stored (or `None`), and whether the API key `key_id` is still live (not
    /// revoked), in one round trip: an event stream re-reads both on every hint and tick, so
    /// a revoked key's open streams end within one tick.
    pub async fn read_followed(
        &self,
        task_id: TaskId,
        key_id: &str,
    ) -> Result<(Option<StoredTask>, bool), StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(&format!(
                "SELECT t.*, coalesce((SELECT k.revoked_at IS NULL \
                 AND (k.expires_at IS NULL OR k.expires_at > now()) FROM api_keys k \
                 WHERE k.key_id = $2), false) AS key_live \
                 FROM (SELECT 1) one LEFT JOIN \
                 (SELECT {TASK_COLUMNS} FROM reply_tasks WHERE task_id = $1) t ON true"
            ))
            .await?;
        let row = client
            .query_one(&statement, &[&task_id.as_uuid(), &key_id])
            .await?;
        let live: bool = row.get("key_live");
        let task = match row.get::<_, Option<Uuid>>("task_id") {
            Some(_) => Some(task_from(&row)?),
            None => None,
        };
        Ok((task, live))
    }

    /// Records why attempt `version` of the task waited for the provider's capacity (V34):
    /// informational, so unfenced; a row of another version is left alone.
    pub async fn record_capacity_wait(
        &self,
        task_id: TaskId,
        version: i64,
        wait: CapacityWait,
    ) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute(
                "UPDATE reply_attempts SET capacity_wait_ms = $3, capacity_calls_ahead = $4, \
                 capacity_own_ahead = $5, capacity_workspaces = $6 \
                 WHERE task_id = $1 AND assignment_version = $2",
                &[
                    &task_id.as_uuid(),
                    &version,
                    &wait.waited_ms,
                    &wait.calls_ahead,
                    &wait.own_ahead,
                    &wait.workspaces,
                ],
            )
            .await?;
        Ok(())
    }

    /// A task's attempts, oldest first.
    pub async fn attempts(&self, task_id: TaskId) -> Result<Vec<AttemptRecord>, StoreError> {
        let rows = self
            .rows(
                "SELECT attempt_no, assignment_version, worker, claimed_at, lease_until, \
                 finished_at, outcome, detail, prompt_tokens, completion_tokens, \
                 source_partition, source_offset, stream_end, streamed_chars, \
                 capacity_wait_ms, capacity_calls_ahead, capacity_own_ahead, \
                 capacity_workspaces \
                 FROM reply_attempts WHERE task_id = $1 ORDER BY assignment_version",
                &[&task_id.as_uuid()],
            )
            .await?;
        rows.iter()
            .map(|r| {
                let outcome: Option<&str> = r.get(6);
                Ok(AttemptRecord {
                    attempt_no: r.get(0),
                    assignment_version: r.get(1),
                    worker: r.get(2),
                    claimed_at: r.get(3),
                    lease_until: r.get(4),
                    finished_at: r.get(5),
                    outcome: outcome
                        .map(|o| {
                            AttemptOutcome::parse(o).ok_or_else(|| {
                                invalid(task_id.as_uuid(), format!("unknown attempt outcome {o:?}"))
                            })
                        })
                        .transpose()?,
                    detail: r.get(7),
                    usage: match (r.get(8), r.get(9)) {
                        (Some(prompt_tokens), Some(completion_tokens)) => Some(TokenUsage {
                            prompt_tokens,
                            completion_tokens,
                        }),
                        _ => None,
                    },
                    source: match (r.get(10), r.get(11)) {
                        (Some(partition), Some(offset)) => Some(RecordSource {
                            partition,
                            offset,
                            held_alone: false,
                        }),
                        _ => None,
                    },
                    stream_end: r
                        .get::<_, Option<&str>>(12)
                        .and_then(StreamEnd::parse)
                        .map(|end| (end, r.get::<_, Option<i32>>(13).unwrap_or(0))),
                    capacity_wait: r.get::<_, Option<i32>>(14).map(|waited_ms| CapacityWait {
                        waited_ms,
                        calls_ahead: r.get::<_, Option<i32>>(15).unwrap_or(0),
                        own_ahead: r.get::<_, Option<i32>>(16).unwrap_or(0),
                        workspaces: r.get::<_, Option<i32>>(17).unwrap_or(0),
                    }),
                })
            })
            .collect()
    }
}
