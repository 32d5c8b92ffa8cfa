-- Reply tasks and their attempts: the durable state behind I1 (one reply), I2 (fenced), I4
-- (atomic completion) and I7 (bounded effort). Every time in these tables comes from the
-- database clock (clock_timestamp()), never from a worker's clock.

create table reply_tasks (
    task_id             uuid        primary key,
    workspace_id        text        not null,
    conversation_id     text        not null,
    message_id          text        not null,
    document_version    text        not null default '',
    -- What to ask the provider (model, messages, max output tokens), as the record gave it.
    request             jsonb       not null,
    status              text        not null default 'pending'
                        check (status in ('pending', 'running', 'completed', 'failed')),
    -- Increases on every claim or takeover; completion and renewal must present the current one.
    assignment_version  bigint      not null default 0,
    lease_owner         text,
    lease_until         timestamptz,
    -- The attempt budget (I7): attempt_count never exceeds max_attempts.
    attempt_count       integer     not null default 0,
    max_attempts        integer     not null check (max_attempts > 0),
    deadline            timestamptz,
    -- The provider's id for the generation, stored before waiting on it, to recover ambiguity.
    provider_operation_id text,
    saved_response      text,
    response_meta       jsonb,
    failure             text,
    created_at          timestamptz not null default clock_timestamp(),
    updated_at          timestamptz not null default clock_timestamp(),
    finished_at         timestamptz,
    constraint attempts_within_budget check (attempt_count <= max_attempts),
    -- I1: a completed task has its response and only a completed task has one.
    constraint response_iff_completed check ((status = 'completed') = (saved_response is not null)),
    constraint failure_iff_failed check ((status = 'failed') = (failure is not null)),
    constraint running_has_lease check (status <> 'running' or (lease_owner is not null and lease_until is not null))
);

create index reply_tasks_open on reply_tasks (status, lease_until) where status in ('pending', 'running');

-- One row per claim. The outcome is written by whoever learns it: the worker when it completes
-- or fails the attempt, or the next claim when it takes over an attempt whose lease ran out.
--   accepted   this attempt's reply was saved
--   fenced     this attempt's write was refused (not the current assignment, or lease expired)
--   abandoned  the lease ran out or was given back without a reply (may become fenced later)
--   provider_error / timeout / ambiguous   the provider call failed in that way
--   failed     the task failed for good in this attempt
create table reply_attempts (
    task_id             uuid        not null references reply_tasks (task_id),
    attempt_no          integer     not null,
    assignment_version  bigint      not null,
    worker              text        not null,
    claimed_at          timestamptz not null default clock_timestamp(),
    lease_until         timestamptz not null,
    finished_at         timestamptz,
    outcome             text
                        check (outcome in ('accepted', 'fenced', 'abandoned', 'provider_error',
                                           'timeout', 'ambiguous', 'failed')),
    detail              text,
    primary key (task_id, assignment_version)
);

create index reply_attempts_outcome on reply_attempts (outcome);
