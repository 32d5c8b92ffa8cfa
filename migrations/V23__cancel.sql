-- Stop: a task may end `cancelled` (`POST /v1/replies/{id}/cancel`). No call starts after it,
-- the call running when it comes is fenced (its next renewal or write is refused, and its
-- worker cuts the call short), and its reservation is released: the user stopped it and saw
-- no reply. The lease model (`crates/core/tests/lease_model.rs`) has it as an action.
--
-- A process of the previous release does not know the status: while a rolling update replaces
-- it, a record whose task was cancelled makes its claim fail ("unknown claim outcome") and is
-- tried again until a new process takes the partition. Nothing is written twice meanwhile.

alter table reply_tasks drop constraint reply_tasks_status_check;
alter table reply_tasks add constraint reply_tasks_status_check
    check (status in ('pending', 'running', 'completed', 'failed', 'cancelled'));

alter table reply_attempts drop constraint reply_attempts_outcome_check;
alter table reply_attempts add constraint reply_attempts_outcome_check
    check (outcome in ('accepted', 'fenced', 'abandoned', 'provider_error', 'timeout',
                       'ambiguous', 'refused', 'cancelled'));

-- Finished rows now include cancelled ones (V21 says why these indexes hold finished rows
-- only); every query of finished tasks names the three, so that it uses them.
drop index reply_tasks_finished;
drop index reply_tasks_finished_by_conversation;
create index reply_tasks_finished on reply_tasks (finished_at)
    where status in ('completed', 'failed', 'cancelled');
create index reply_tasks_finished_by_conversation
    on reply_tasks (workspace_id, conversation_id, message_id)
    where status in ('completed', 'failed', 'cancelled');

-- Cancels task `id`: the row is locked, and only an open task (pending, or running whatever its
-- lease) is changed. It becomes `cancelled` with a new assignment version, so the running
-- assignment's fence (`replyd_lease_holds`) refuses its every later write; its open attempt is
-- stamped `cancelled`. The reservation is released by the status trigger below. A task that
-- is already finished is left as it is: `already_completed` (the cancel lost the race to the
-- saved reply), `already_failed`, `already_cancelled` (a repeated cancel). `forgotten` and
-- `not_found` when there is no row. Returns what it did and the task's status after it.
create function replyd_cancel(p_task uuid)
returns table (outcome text, status text)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    v_status text;
begin
    select r.status into v_status from reply_tasks r where r.task_id = p_task for update;
    if not found then
        return query select case when exists (select 1 from forgotten_tasks f
                                               where f.task_id = p_task)
                                 then 'forgotten' else 'not_found' end, null::text;
        return;
    end if;
    if v_status not in ('pending', 'running') then
        return query select 'already_' || v_status, v_status;
        return;
    end if;
    update reply_attempts a set outcome = 'cancelled', detail = 'task cancelled',
           finished_at = clock_timestamp()
     where a.task_id = p_task and a.outcome is null;
    -- A running task's call may be under way, live lease or not (the lapsed-call trigger
    -- notes only a lapsed one): remembered for `replyd inspect`, as a takeover would.
    update reply_tasks r
       set status = 'cancelled', assignment_version = r.assignment_version + 1,
           provider_may_have_run = r.provider_may_have_run or r.status = 'running',
           lease_owner = null, lease_until = null, next_attempt_at = null,
           finished_at = clock_timestamp(), updated_at = clock_timestamp()
     where r.task_id = p_task;
    return query select 'cancelled'::text, 'cancelled'::text;
end
$$;

-- V13's settlement on a terminal status, with `cancelled` released whatever the provider may
-- have done: the user stopped the task and was shown no reply (the design's rule for Stop;
-- a failure keeps I8's rule, below).
create or replace function replyd_settle_reservation() returns trigger language plpgsql as $$
declare
    settle_as text := nullif(current_setting('replyd.settle_as', true), '');
    by_whom text := coalesce(new.lease_owner, 'replyd');
    why text := case when new.status = 'completed' then 'task completed'
                     when new.status = 'cancelled' then 'task cancelled'
                     else 'task failed: ' || coalesce(new.failure, '') end;
begin
    if new.status is not distinct from old.status
       or new.status not in ('completed', 'failed', 'cancelled') then
        return new;
    end if;
    if new.status = 'cancelled' then
        perform replyd_settle_to(new.task_id, 'released', 'replyd cancel', why);
        return new;
    end if;
    if settle_as is not null then
        perform replyd_settle_to(new.task_id, settle_as, by_whom, why);
        return new;
    end if;
    if new.status = 'failed' and new.provider_may_have_run and exists (
        select 1 from quota_reservations r
         where r.task_id = new.task_id and r.state = 'reserved' and not r.charge_on_failure) then
        return new;
    end if;
    perform replyd_settle(new.task_id, new.status, by_whom, why, false);
    return new;
end;
$$;

-- V21's claim, answering `already_cancelled` for a cancelled task.
create or replace function replyd_claim(
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
        when t.status = 'cancelled' then 'already_cancelled'
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

-- V21's forgetting, keeping a message while a cancelled task of it is left.
create or replace function replyd_forget(p_tasks uuid[], p_reason text)
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
                            where r.status in ('completed', 'failed', 'cancelled')
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
