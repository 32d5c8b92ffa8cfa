//! The intake transaction of `POST /v1/replies` (I6): the user's message, its reply task, the
//! idempotency record and the outbox row are written in one transaction, or nothing is. The
//! unique key of the idempotency record decides between concurrent first requests with one
//! key: the loser's insert waits for the winner's transaction, finds the row, and answers with
//! the winner's task. The same transaction admits new work against the workspace's quota and
//! writes its reservation (I8); work the quota refuses writes nothing. A reuse is judged by [`replyd_core::idempotency::decide_reuse`] on the
//! database clock.

use chrono::{DateTime, TimeDelta, Utc};
use prost::Message as _;
use uuid::Uuid;

use replyd_core::domain::{ChatMessage, ProviderRequest, Role, TaskId, TaskSpec};
use replyd_core::history::KeptError;
use replyd_core::idempotency::{BoundInputs, IdempotencyKey, Operation, Reuse, decide_reuse};
use replyd_core::quota::QuotaPolicy;
use replyd_core::workspace_policy::{Admitted, PolicyRefusal};

use super::quota::QuotaRefusal;

use super::{Store, StoreError};

/// A submission, as the API parsed it.
#[derive(Debug, Clone)]
pub struct Submission {
    pub workspace_id: String,
    pub operation: Operation,
    pub key: IdempotencyKey,
    pub inputs: BoundInputs,
    pub max_attempts: u32,
    /// How long the key is remembered.
    pub retention: TimeDelta,
    /// A regenerate answers an existing message again: its id, and no new message row.
    pub existing_message: Option<String>,
    /// The quota policy new work is admitted and reserved under.
    pub quota: QuotaPolicy,
    /// The request's trace context, kept with the outbox row so the task's record continues
    /// its trace (`None` when traces are off).
    pub traceparent: Option<String>,
    /// The workspace policy's verdict on the request ([`replyd_core::workspace_policy::judge`]):
    /// what new work asks the provider for and reserves, or why new work is refused. A replay
    /// is answered whatever it says now, as it is whatever the quota says.
    pub verdict: Result<Admitted, PolicyRefusal>,
    /// The turns the provider is asked with before the message (`replyd_core::history`), or
    /// why the request's `kept_replies` cannot be used. Like the verdict, a replay is answered
    /// whatever it says now: the history is fixed when the task is created.
    pub history: Result<Vec<ChatMessage>, KeptError>,
    /// The end user whose token asks (`None`: the workspace's key): the conversation must be
    /// theirs, or new, and then becomes theirs.
    pub end_user: Option<String>,
}

/// What the intake did.
#[derive(Debug, Clone, PartialEq)]
pub enum Submitted {
    /// New work: message, task, key, outbox row and quota reservation written.
    Created { task_id: TaskId },
    /// The same request again: the existing task, nothing written.
    Replayed { task_id: TaskId },
    /// The key was used with other inputs; nothing written.
    Mismatch { fields: Vec<&'static str> },
    /// New work the workspace's quota does not admit now; nothing written.
    OverQuota { quota: QuotaRefusal },
    /// New work the workspace's policy refuses (a model it may not use, output over its cap);
    /// nothing written.
    Refused(PolicyRefusal),
    /// New work in a conversation (or workspace) that was erased; nothing written.
    Erased,
    /// New work whose `kept_replies` name no earlier reply of the conversation; nothing
    /// written.
    BadKeptReplies(KeptError),
    /// An end user's request in a conversation that is not theirs; nothing written.
    NotTheirs,
    /// New work over the end user's share of the workspace's quota (the workspace may have
    /// room); nothing written.
    OverEndUserShare {
        share: super::quota::EndUserShare,
        /// The request's token ceiling.
        ceiling: i64,
    },
}

/// The provider request a submission asks for: the context as a system message, the
/// conversation's history, then the user's message.
pub fn provider_request(inputs: &BoundInputs, history: &[ChatMessage]) -> ProviderRequest {
    let mut messages = Vec::new();
    if let Some(context) = inputs.context.as_ref().filter(|c| !c.is_empty()) {
        messages.push(ChatMessage {
            role: Role::System,
            content: context.clone(),
        });
    }
    messages.extend_from_slice(history);
    messages.push(ChatMessage {
        role: Role::User,
        content: inputs.message.clone(),
    });
    ProviderRequest {
        model: inputs.model.clone(),
        messages,
        max_output_tokens: inputs.max_output_tokens,
    }
}

/// The task a submission becomes, pure: the intake writes it, and the API sizes its Kafka
/// record with it before anything is written. `task_id` and `new_message_id` are the ids the
/// intake makes (a regenerate keeps its message's id); the text of every UUID is as long, so
/// any ids give the record's exact size.
pub fn task_spec(s: &Submission, task_id: TaskId, new_message_id: Uuid) -> TaskSpec {
    let history = s.history.as_deref().unwrap_or_default();
    let mut request = provider_request(&s.inputs, history);
    if let Ok(admitted) = &s.verdict {
        // The workspace's cap stands in for an absent bound: the provider keeps to the
        // ceiling the reservation holds.
        request.max_output_tokens = admitted.max_output_tokens;
    }
    TaskSpec {
        task_id,
        workspace_id: s.workspace_id.clone(),
        conversation_id: s.inputs.conversation_id.clone(),
        message_id: s
            .existing_message
            .clone()
            .unwrap_or_else(|| new_message_id.to_string()),
        document_version: s.inputs.document_version.clone(),
        request,
        max_attempts: s.max_attempts,
        deadline: None,
    }
}

/// Whether the submission's scope was erased, under the workspace's shared erasure lock
/// (`replyd_scope_erased`, V21): an erasure that writes the scope waits for this transaction.
const SCOPE_ERASED: &str = "SELECT replyd_scope_erased($1, $2)";
/// A key is the caller's (V27): the workspace's key and each of its end users (`$4`, '' for
/// the key) have keys of their own, so no caller's key is judged against another's request.
const EXPIRE_KEY: &str = "DELETE FROM idempotency_keys WHERE workspace_id = $1 AND operation = $2 \
     AND idempotency_key = $3 AND end_user_id = $4 AND expires_at <= clock_timestamp()";
const INSERT_TASK: &str = "INSERT INTO reply_tasks (task_id, workspace_id, conversation_id, message_id, \
     document_version, request, max_attempts) VALUES ($1, $2, $3, $4, $5, $6, $7)";
const INSERT_KEY: &str = "INSERT INTO idempotency_keys (workspace_id, operation, idempotency_key, \
     request_hash, request, task_id, expires_at, end_user_id) \
     VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp() + make_interval(secs => $7), $8) \
     ON CONFLICT DO NOTHING RETURNING task_id";
/// The message; the insert numbers it next in its conversation (V22's trigger), and the
/// conversation's row stays locked until the commit, so numbers are given in commit order.
const INSERT_MESSAGE: &str = "INSERT INTO messages (message_id, workspace_id, conversation_id, content) \
     VALUES ($1, $2, $3, $4)";
/// A conversation belongs to whoever began it, from any source: one the workspace already
/// has tasks in (a producer's records make no conversation row) is the workspace's, so an end
/// user's first request in it makes its row the workspace's and is refused. (A record whose
/// task comes after the user began the conversation stays the workspace's too:
/// [`Store::task_owner`] shows an end user only tasks of messages written through the API.)
const CLAIM_CONVERSATION: &str = "INSERT INTO conversations (workspace_id, conversation_id, end_user_id, last_seq) \
     SELECT $1, $2, CASE WHEN EXISTS (SELECT 1 FROM reply_tasks WHERE status IN ('pending', 'running') \
                                      AND workspace_id = $1 AND conversation_id = $2) \
                           OR EXISTS (SELECT 1 FROM reply_tasks \
                                      WHERE status IN ('completed', 'failed', 'cancelled') \
                                      AND workspace_id = $1 AND conversation_id = $2) \
                         THEN NULL ELSE $3 END, 0 \
     ON CONFLICT DO NOTHING";
/// A statement of its own after the claim: it sees the row a concurrent claim committed.
const CONVERSATION_OWNER: &str = "SELECT end_user_id FROM conversations \
     WHERE workspace_id = $1 AND conversation_id = $2 FOR UPDATE";
const INSERT_OUTBOX: &str =
    "INSERT INTO outbox (task_id, record_key, payload, traceparent) VALUES ($1, $2, $3, $4)";

impl Store {
    /// Runs the intake transaction. A key whose record expired between the attempt and the
    /// read is tried once more as new work.
    pub async fn submit(&self, submission: &Submission) -> Result<Submitted, StoreError> {
        for _ in 0..2 {
            if let Some(done) = self.try_submit(submission).await? {
                return Ok(done);
            }
        }
        Err(StoreError::Config(
            "an idempotency record kept expiring while it was read".into(),
        ))
    }

    async fn try_submit(&self, s: &Submission) -> Result<Option<Submitted>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let op = s.operation.as_str();
        let task_id = TaskId::new_random();
        let message_id = Uuid::new_v4();
        let request = serde_json::to_value(&s.inputs)
            .map_err(|e| StoreError::Config(format!("bound inputs: {e}")))?;
        let spec = task_spec(s, task_id, message_id);
        let provider_request = serde_json::to_value(&spec.request)
            .map_err(|e| StoreError::Config(format!("request: {e}")))?;
        let max_attempts = i32::try_from(spec.max_attempts)
            .map_err(|_| StoreError::Config("max_attempts over i32".into()))?;
        let retention_s = s.retention.as_seconds_f64();
        let payload = spec.to_proto().encode_to_vec();
        let caller_scope = s.end_user.as_deref().unwrap_or_default();
        if let Some(user) = &s.end_user {
            // Claimed first, so the conversation's row is locked for the rest: a new one is
            // made this user's (number 0: its first message is 1); two first requests of two
            // users at once, the second waits here and finds it the first's.
            let conversation = &s.inputs.conversation_id;
            tx.execute(CLAIM_CONVERSATION, &[&s.workspace_id, conversation, user])
                .await?;
            let owner: Option<String> = tx
                .query_one(CONVERSATION_OWNER, &[&s.workspace_id, conversation])
                .await?
                .get(0);
            if owner.as_deref() != Some(user.as_str()) {
                tx.rollback().await?;
                return Ok(Some(Submitted::NotTheirs));
            }
        }
        let (erased, expire, insert_task, insert_key, insert_message, insert_outbox, admit) = futures_util::try_join!(
            tx.prepare_cached(SCOPE_ERASED),
            tx.prepare_cached(EXPIRE_KEY),
            tx.prepare_cached(INSERT_TASK),
            tx.prepare_cached(INSERT_KEY),
            tx.prepare_cached(INSERT_MESSAGE),
            tx.prepare_cached(INSERT_OUTBOX),
            tx.prepare_cached(super::quota::ADMIT),
        )?;
        // The statements are sent at once (tokio-postgres pipelines the futures of one session)
        // and run in this order, each after the one before: the round trips of a submission
        // are BEGIN, this batch and COMMIT. The message and the outbox row are written before
        // the key's verdict is known; a loser rolls all of it back below.
        let message = async {
            match s.existing_message {
                Some(_) => Ok(0),
                None => {
                    tx.execute(
                        &insert_message,
                        &[
                            &message_id,
                            &s.workspace_id,
                            &s.inputs.conversation_id,
                            &s.inputs.message,
                        ],
                    )
                    .await
                }
            }
        };
        let key = s.key.as_str();
        let task_uuid = task_id.as_uuid();
        let hash = s.inputs.hash();
        let ttl_s = s.quota.reservation_ttl.as_secs_f64();
        let ceiling = s.verdict.as_ref().map_or(0, |a| a.token_ceiling);
        let (erased, _, _, won, _, _, admitted) = futures_util::try_join!(
            // First, so the erasure lock is held before anything of the scope is written.
            async {
                tx.query_one(&erased, &[&s.workspace_id, &s.inputs.conversation_id])
                    .await
                    .map(|row| row.get::<_, bool>(0))
            },
            // A remembered key past its retention is new work: take its row out first.
            async {
                tx.execute(&expire, &[&s.workspace_id, &op, &key, &caller_scope])
                    .await
            },
            // The task exists before the key refers to it.
            async {
                tx.execute(
                    &insert_task,
                    &[
                        &task_uuid,
                        &spec.workspace_id,
                        &spec.conversation_id,
                        &spec.message_id,
                        &spec.document_version,
                        &provider_request,
                        &max_attempts,
                    ],
                )
                .await
            },
            // The unique key decides: a concurrent first request's insert waits here for the
            // winner's commit, then inserts nothing.
            async {
                tx.query_opt(
                    &insert_key,
                    &[
                        &s.workspace_id,
                        &op,
                        &key,
                        &hash,
                        &request,
                        &task_uuid,
                        &retention_s,
                        &caller_scope,
                    ],
                )
                .await
            },
            message,
            async {
                tx.execute(
                    &insert_outbox,
                    &[&task_uuid, &spec.record_key(), &payload, &s.traceparent],
                )
                .await
            },
            // Last, so the workspace's counter row is locked only from here to the commit. Work
            // the policy refuses is not admitted (and is rolled back below).
            async {
                if s.verdict.is_err() {
                    return Ok(None);
                }
                if let Some(user) = &s.end_user {
                    tx.execute(super::quota::END_USER_LOCK, &[&s.workspace_id, user])
                        .await?;
                }
                tx.query_opt(
                    &admit,
                    &[
                        &s.workspace_id,
                        &task_uuid,
                        &op,
                        &key,
                        &s.quota.pending_reserves,
                        &ttl_s,
                        &s.quota.charge_failed,
                        &ceiling,
                        &s.end_user,
                    ],
                )
                .await
            },
        )?;
        if won.is_some() {
            if erased {
                tx.rollback().await?;
                return Ok(Some(Submitted::Erased));
            }
            if let Err(refusal) = &s.verdict {
                tx.rollback().await?;
                return Ok(Some(Submitted::Refused(refusal.clone())));
            }
            if let Err(bad) = &s.history {
                tx.rollback().await?;
                return Ok(Some(Submitted::BadKeptReplies(bad.clone())));
            }
            if admitted.is_some() {
                tx.commit().await?;
                return Ok(Some(Submitted::Created { task_id }));
            }
            // New work over the quota: nothing of it may stay. A replay (the key lost) is
            // answered below whatever the quota says now.
            tx.rollback().await?;
            drop(client);
            if let Some(user) = &s.end_user
                && let Some(share) = self
                    .end_user_share(&s.workspace_id, user, s.quota.pending_reserves)
                    .await?
                && !share.admits(ceiling)
            {
                return Ok(Some(Submitted::OverEndUserShare { share, ceiling }));
            }
            let quota = self
                .quota_refusal(&s.workspace_id, ceiling)
                .await?
                .ok_or_else(|| {
                    StoreError::Config(format!("workspace {} has no quota counter", s.workspace_id))
                })?;
            return Ok(Some(Submitted::OverQuota { quota }));
        }
        // Lost (or a retry): nothing of this attempt may stay.
        tx.rollback().await?;
        let Some(row) = client
            .query_opt(
                "SELECT request_hash, request, task_id, expires_at, clock_timestamp() AS now \
                 FROM idempotency_keys \
                 WHERE workspace_id = $1 AND operation = $2 AND idempotency_key = $3 \
                   AND end_user_id = $4",
                &[&s.workspace_id, &op, &s.key.as_str(), &caller_scope],
            )
            .await?
        else {
            // Purged between the insert and this read: try again as new work.
            return Ok(None);
        };
        let stored: BoundInputs = serde_json::from_value(row.get("request"))
            .map_err(|e| StoreError::Config(format!("stored bound inputs: {e}")))?;
        let stored_hash: String = row.get("request_hash");
        let expires_at: DateTime<Utc> = row.get("expires_at");
        let now: DateTime<Utc> = row.get("now");
        let task: Uuid = row.get("task_id");
        Ok(
            match decide_reuse(&stored_hash, &stored, expires_at, &s.inputs, now) {
                Reuse::Replay => Some(Submitted::Replayed {
                    task_id: TaskId::from(task),
                }),
                Reuse::Mismatch { fields } => Some(Submitted::Mismatch { fields }),
                Reuse::Expired => None,
            },
        )
    }
}
