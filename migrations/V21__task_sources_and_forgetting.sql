-- Two things a platform team asked of the tasks' history: where a task's records came from, and
-- that old or erased data can go.
--
-- Source. A claim made for a record writes the record's partition and offset on the task (the
-- record whose claim started the latest attempt) and on the attempt row, so a stalled
-- partition's oldest unfinished task can be found by its offset.
--
-- Forgetting. Retention deletes finished tasks past their age, and an erasure deletes one
-- workspace's or one conversation's data. A deleted task's records may still be in the topic
-- (or come back from a dead-letter replay): its id goes into `forgotten_tasks`, which the
-- insert of a record's task consults, so a redelivered record finds the task forgotten and is
-- done, without a second generation. An erasure also writes its scope into `erasures`: a
-- record of that scope not seen before is refused and its task forgotten at once. The insert
-- takes a shared advisory lock on the workspace, the erasure an exclusive one while it writes
-- its scope, so no insert that read the scopes before the erasure can commit after it.

alter table reply_tasks
    add column source_partition integer,
    add column source_offset    bigint;
alter table reply_attempts
    add column source_partition integer,
    add column source_offset    bigint;

-- Finished tasks by age, for retention, and by conversation and message, for erasure and for
-- a message's last task. (A conversation's messages are found through V22's index.) Both hold finished rows only: a task's row is written again by every
-- claim, renewal and completion, each version into every index whose predicate it meets, so
-- an index over all rows would cost the hot path three entries a task; these cost one each,
-- at the completion. Open tasks are few and `reply_tasks_open` finds them (the runbook's
-- query of a partition's open tasks, too).
create index reply_tasks_finished on reply_tasks (finished_at)
    where status in ('completed', 'failed');
create index reply_tasks_finished_by_conversation
    on reply_tasks (workspace_id, conversation_id, message_id)
    where status in ('completed', 'failed');

-- A retry outlives the failed task it repeats: deleting the failed one leaves the retry.
alter table reply_tasks drop constraint reply_tasks_retry_of_fkey;
alter table reply_tasks add constraint reply_tasks_retry_of_fkey
    foreign key (retry_of) references reply_tasks on delete set null;

create table forgotten_tasks (
    task_id      uuid        primary key,
    workspace_id text        not null,
    forgotten_at timestamptz not null default clock_timestamp(),
    reason       text        not null check (reason in ('retention', 'erasure'))
);
create index forgotten_tasks_by_age on forgotten_tasks (forgotten_at);

-- An erased scope: a workspace (conversation_id = '') or one of its conversations.
create table erasures (
    workspace_id    text        not null,
    conversation_id text        not null,
    erased_at       timestamptz not null default clock_timestamp(),
    primary key (workspace_id, conversation_id)
);

-- The advisory lock of a workspace's erasures: two-int form (its own key space, apart from
-- the migration lock's), the first being "rpyd" in ASCII.
create function replyd_erasure_lock(p_workspace text) returns integer
language sql immutable as $$ select hashtext(p_workspace) $$;

-- Whether the workspace, or this conversation of it, was erased. Takes the workspace's erasure
-- lock shared, until the end of the transaction: an erasure writes its scope under the same
-- lock exclusive, so a transaction that read "not erased" commits before the scope is written
-- (and the erasure's deletions, which start after that, see what it wrote).
create function replyd_scope_erased(p_workspace text, p_conversation text) returns boolean
language plpgsql volatile as $$
begin
    perform pg_advisory_xact_lock_shared(1920170340, replyd_erasure_lock(p_workspace));
    return exists (select 1 from erasures e where e.workspace_id = p_workspace
                                              and e.conversation_id in ('', p_conversation));
end
$$;

-- V9's insert, refusing forgotten tasks and erased scopes. True when this call inserted.
-- The insert goes first: a record whose task exists (a redelivery) costs one statement, as it
-- did, and only a new row is looked at, by one more. The insert takes the workspace's erasure
-- lock, and the look is the next statement, so its snapshot is taken after the lock was
-- granted and sees the scope of an erasure this waited for (read in the insert's own
-- statement, a scope committed during the wait would not be seen). An insert that waited on
-- the row of a task being forgotten goes in once that row is gone; the forgetting is
-- committed by then, so the look sees it too.
create or replace function replyd_insert_task(
    p_task uuid, p_workspace text, p_conversation text, p_message text,
    p_document_version text, p_request jsonb, p_max_attempts integer, p_deadline timestamptz)
returns boolean
language plpgsql volatile as $$
begin
    insert into reply_tasks (task_id, workspace_id, conversation_id, message_id,
                             document_version, request, max_attempts, deadline)
    select p_task, p_workspace, p_conversation, p_message, p_document_version, p_request,
           p_max_attempts, p_deadline
      from (select pg_advisory_xact_lock_shared(1920170340, replyd_erasure_lock(p_workspace)))
           as erasure_lock
    on conflict (task_id) do nothing;
    if not found then
        return false;
    end if;
    if exists (select 1 from forgotten_tasks f where f.task_id = p_task)
       or exists (select 1 from erasures e where e.workspace_id = p_workspace
                                             and e.conversation_id in ('', p_conversation)) then
        delete from reply_tasks r where r.task_id = p_task;
        insert into forgotten_tasks (task_id, workspace_id, reason)
        values (p_task, p_workspace, 'erasure') on conflict do nothing;
        return false;
    end if;
    return true;
end
$$;

-- The claim functions of V15 with the record's partition and offset (written by a claim that
-- takes the lease), and `forgotten` for a task that is absent because it was forgotten. The
-- V15 signatures stay, calling these without a source, so processes of the previous release
-- keep working while a rolling update replaces them.
create function replyd_claim(
    p_task uuid, p_owner text, p_lease_secs float8,
    p_workspace text, p_conversation text, p_message text, p_document_version text,
    p_request jsonb, p_max_attempts integer, p_deadline timestamptz,
    p_partition integer, p_offset bigint)
returns table (
    claim text, created boolean, now timestamptz,
    task_id uuid, workspace_id text, conversation_id text, message_id text,
    document_version text, request jsonb, max_attempts integer, deadline timestamptz,
    status text, assignment_version bigint, lease_owner text, lease_until timestamptz,
    attempt_count integer, provider_operation_id text, saved_response text, failure text,
    created_at timestamptz, updated_at timestamptz, finished_at timestamptz,
    next_attempt_at timestamptz, last_error_class text, last_error text,
    refusals integer, refusal_deadline timestamptz)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    t reply_tasks;
    v_now timestamptz;
    v_created boolean := false;
    v_claim text;
    v_reason text;
begin
    if p_request is not null then
        v_created := replyd_insert_task(p_task, p_workspace, p_conversation, p_message,
                                        p_document_version, p_request, p_max_attempts,
                                        p_deadline);
    end if;
    select * into t from reply_tasks r where r.task_id = p_task for update;
    if not found then
        -- Absent: forgotten (retention or erasure; its records may still come) or never there.
        v_claim := case when exists (select 1 from forgotten_tasks f where f.task_id = p_task)
                        then 'forgotten' else 'not_found' end;
        return query select v_claim, v_created, clock_timestamp(),
            null::uuid, null::text, null::text, null::text, null::text, null::jsonb,
            null::integer, null::timestamptz, null::text, null::bigint, null::text,
            null::timestamptz, null::integer, null::text, null::text, null::text,
            null::timestamptz, null::timestamptz, null::timestamptz, null::timestamptz,
            null::text, null::text, null::integer, null::timestamptz;
        return;
    end if;
    -- Read with the lock held (a separate statement, so after the lock wait).
    v_now := clock_timestamp();
    v_claim := case
        when t.status = 'completed' then 'already_completed'
        when t.status = 'failed' then 'already_failed'
        when t.status = 'running' and t.lease_until > v_now then 'leased_by_other'
        -- Before the backoff: a task whose deadline passed while it waited fails now.
        when t.deadline <= v_now then 'deadline_passed'
        when t.next_attempt_at > v_now then 'backing_off'
        when t.attempt_count >= t.max_attempts then 'budget_exhausted'
        else 'claimed'
    end;
    if v_claim in ('deadline_passed', 'budget_exhausted') then
        v_reason := case v_claim
            when 'deadline_passed' then format(
                'deadline exceeded: the deadline %s passed before attempt %s',
                to_char(t.deadline at time zone 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
                t.attempt_count + 1)
            else format('attempt budget exhausted: %s of %s attempts used',
                        t.attempt_count, t.max_attempts)
        end;
        update reply_tasks r set status = 'failed', failure = v_reason,
               finished_at = clock_timestamp(), updated_at = clock_timestamp()
         where r.task_id = p_task;
        update reply_attempts a set outcome = 'abandoned', detail = v_reason,
               finished_at = clock_timestamp()
         where a.task_id = p_task and a.outcome is null;
    elsif v_claim = 'claimed' then
        if t.status = 'running' then
            -- The previous assignment's lease ran out without an outcome. If it comes back,
            -- its write is refused and this row is rewritten as `fenced`.
            update reply_attempts a set outcome = 'abandoned',
                   detail = 'lease expired; taken over', finished_at = clock_timestamp()
             where a.task_id = p_task and a.outcome is null;
        end if;
        update reply_tasks r set status = 'running',
               assignment_version = r.assignment_version + 1, lease_owner = p_owner,
               lease_until = clock_timestamp() + make_interval(secs => p_lease_secs),
               attempt_count = r.attempt_count + 1, updated_at = clock_timestamp(),
               source_partition = coalesce(p_partition, r.source_partition),
               source_offset = case when p_partition is null then r.source_offset
                                    else p_offset end
         where r.task_id = p_task
        returning * into t;
        insert into reply_attempts (task_id, attempt_no, assignment_version, worker, lease_until,
                                    source_partition, source_offset)
        values (p_task, t.attempt_count, t.assignment_version, p_owner, t.lease_until,
                p_partition, p_offset);
    end if;
    return query select v_claim, v_created, v_now,
        r.task_id, r.workspace_id, r.conversation_id, r.message_id, r.document_version,
        r.request, r.max_attempts, r.deadline, r.status, r.assignment_version, r.lease_owner,
        r.lease_until, r.attempt_count, r.provider_operation_id, r.saved_response, r.failure,
        r.created_at, r.updated_at, r.finished_at, r.next_attempt_at, r.last_error_class,
        r.last_error, r.refusals, r.refusal_deadline
      from reply_tasks r where r.task_id = p_task;
end
$$;

create function replyd_claim_many(
    p_tasks uuid[], p_owner text, p_lease_secs float8,
    p_workspaces text[], p_conversations text[], p_messages text[],
    p_document_versions text[], p_requests jsonb[], p_max_attempts integer[],
    p_deadlines timestamptz[], p_partitions integer[], p_offsets bigint[])
returns table (
    input_task uuid, busy boolean, inserted boolean,
    claim text, created boolean, now timestamptz,
    task_id uuid, workspace_id text, conversation_id text, message_id text,
    document_version text, request jsonb, max_attempts integer, deadline timestamptz,
    status text, assignment_version bigint, lease_owner text, lease_until timestamptz,
    attempt_count integer, provider_operation_id text, saved_response text, failure text,
    created_at timestamptz, updated_at timestamptz, finished_at timestamptz,
    next_attempt_at timestamptz, last_error_class text, last_error text,
    refusals integer, refusal_deadline timestamptz)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    i bigint;
    v_inserted boolean;
begin
    for i in select u.ord from unnest(p_tasks) with ordinality as u(task, ord)
              order by u.task loop
        v_inserted := false;
        if p_requests[i] is not null then
            v_inserted := replyd_insert_task(p_tasks[i], p_workspaces[i], p_conversations[i],
                                             p_messages[i], p_document_versions[i],
                                             p_requests[i], p_max_attempts[i], p_deadlines[i]);
        end if;
        perform 1 from reply_tasks r where r.task_id = p_tasks[i] for update skip locked;
        if not found and exists (select 1 from reply_tasks r where r.task_id = p_tasks[i]) then
            return query select p_tasks[i], true, v_inserted, null::text, null::boolean,
                null::timestamptz, null::uuid, null::text, null::text, null::text, null::text,
                null::jsonb, null::integer, null::timestamptz, null::text, null::bigint,
                null::text, null::timestamptz, null::integer, null::text, null::text,
                null::text, null::timestamptz, null::timestamptz, null::timestamptz,
                null::timestamptz, null::text, null::text, null::integer, null::timestamptz;
            continue;
        end if;
        -- The row is locked by this call now (or absent): the claim's own lock is granted at
        -- once, and it reads the clock after it.
        return query select p_tasks[i], false, v_inserted, c.*
          from replyd_claim(p_tasks[i], p_owner, p_lease_secs, null, null, null, null, null,
                            null, null, p_partitions[i], p_offsets[i]) c;
    end loop;
end
$$;

create or replace function replyd_claim(
    p_task uuid, p_owner text, p_lease_secs float8,
    p_workspace text, p_conversation text, p_message text, p_document_version text,
    p_request jsonb, p_max_attempts integer, p_deadline timestamptz)
returns table (
    claim text, created boolean, now timestamptz,
    task_id uuid, workspace_id text, conversation_id text, message_id text,
    document_version text, request jsonb, max_attempts integer, deadline timestamptz,
    status text, assignment_version bigint, lease_owner text, lease_until timestamptz,
    attempt_count integer, provider_operation_id text, saved_response text, failure text,
    created_at timestamptz, updated_at timestamptz, finished_at timestamptz,
    next_attempt_at timestamptz, last_error_class text, last_error text,
    refusals integer, refusal_deadline timestamptz)
language sql volatile as $$
    select * from replyd_claim(p_task, p_owner, p_lease_secs, p_workspace, p_conversation,
                               p_message, p_document_version, p_request, p_max_attempts,
                               p_deadline, null::integer, null::bigint)
$$;

create or replace function replyd_claim_many(
    p_tasks uuid[], p_owner text, p_lease_secs float8,
    p_workspaces text[], p_conversations text[], p_messages text[],
    p_document_versions text[], p_requests jsonb[], p_max_attempts integer[],
    p_deadlines timestamptz[])
returns table (
    input_task uuid, busy boolean, inserted boolean,
    claim text, created boolean, now timestamptz,
    task_id uuid, workspace_id text, conversation_id text, message_id text,
    document_version text, request jsonb, max_attempts integer, deadline timestamptz,
    status text, assignment_version bigint, lease_owner text, lease_until timestamptz,
    attempt_count integer, provider_operation_id text, saved_response text, failure text,
    created_at timestamptz, updated_at timestamptz, finished_at timestamptz,
    next_attempt_at timestamptz, last_error_class text, last_error text,
    refusals integer, refusal_deadline timestamptz)
language sql volatile as $$
    select * from replyd_claim_many(p_tasks, p_owner, p_lease_secs, p_workspaces,
                                    p_conversations, p_messages, p_document_versions,
                                    p_requests, p_max_attempts, p_deadlines,
                                    array_fill(null::integer, array[cardinality(p_tasks)]),
                                    array_fill(null::bigint, array[cardinality(p_tasks)]))
$$;

-- Forgets the tasks `p_tasks` (`p_reason`: 'retention' or 'erasure') in one transaction: each
-- row is locked (in id order, as claims lock them; a claim in progress is waited for), its
-- open reservation settled and its open attempt closed, then the task, its attempts, its
-- reservation and the decisions about it, its outbox row, its idempotency records and its
-- message (once no task of that message is left) are deleted, and its id is remembered in
-- `forgotten_tasks`.
--
-- An open reservation (an erasure's: retention takes none) is settled as the work says, never
-- released while the provider may have done it (I8): `charged` when the task is running (its
-- worker may be in the call) or `provider_may_have_run` (a failed task whose reservation was
-- left open for the reconciler, too), else `released`. A worker still holding the lease finds
-- no row at its next fenced write, claims again and finds the task forgotten.
create function replyd_forget(p_tasks uuid[], p_reason text)
returns table (tasks bigint, attempts bigint, messages bigint, charged bigint, released bigint)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    t record;
    v_tasks bigint := 0;
    v_attempts bigint := 0;
    v_messages bigint := 0;
    v_charged bigint := 0;
    v_released bigint := 0;
    v_settled text;
begin
    for t in select r.task_id, r.status, r.provider_may_have_run from reply_tasks r
              where r.task_id = any(p_tasks) order by r.task_id for update loop
        -- Guarded on the reservation being open: a settled one (or none) is left as it is.
        v_settled := replyd_settle_to(
            t.task_id,
            case when t.status = 'running' or t.provider_may_have_run then 'charged'
                 else 'released' end,
            'replyd ' || p_reason, 'task ' || p_reason);
        if v_settled = 'charged' then v_charged := v_charged + 1;
        elsif v_settled = 'released' then v_released := v_released + 1;
        end if;
        update reply_attempts a set outcome = 'abandoned', detail = 'task ' || p_reason,
               finished_at = clock_timestamp()
         where a.task_id = t.task_id and a.outcome is null;
    end loop;
    insert into forgotten_tasks (task_id, workspace_id, reason)
    select r.task_id, r.workspace_id, p_reason from reply_tasks r where r.task_id = any(p_tasks)
    on conflict do nothing;
    delete from reply_attempts a where a.task_id = any(p_tasks);
    get diagnostics v_attempts = row_count;
    delete from quota_decisions d where d.task_id = any(p_tasks);
    delete from quota_reservations q where q.task_id = any(p_tasks);
    delete from outbox o where o.task_id = any(p_tasks);
    delete from idempotency_keys k where k.task_id = any(p_tasks);
    with gone as (
        delete from reply_tasks r where r.task_id = any(p_tasks)
        returning r.workspace_id, r.conversation_id, r.message_id
    ), counted as (
        select count(*) as n from gone
    ), left_alone as (
        delete from messages m using gone g
         where m.workspace_id = g.workspace_id and m.conversation_id = g.conversation_id
           and m.message_id::text = g.message_id
           and not exists (select 1 from reply_tasks r
                            where r.status in ('completed', 'failed')
                              and r.workspace_id = g.workspace_id
                              and r.conversation_id = g.conversation_id
                              and r.message_id = g.message_id
                              and not (r.task_id = any(p_tasks)))
           and not exists (select 1 from reply_tasks r
                            where r.status in ('pending', 'running')
                              and r.workspace_id = g.workspace_id
                              and r.conversation_id = g.conversation_id
                              and r.message_id = g.message_id
                              and not (r.task_id = any(p_tasks)))
        returning 1
    )
    select (select n from counted), (select count(*) from left_alone)
      into v_tasks, v_messages;
    return query select v_tasks, v_attempts, v_messages, v_charged, v_released;
end
$$;
