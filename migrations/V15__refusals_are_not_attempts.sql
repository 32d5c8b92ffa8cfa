-- A refusal is not an attempt (I7). A provider that refuses a call without doing it (a 429, a
-- 503 that says so, a refused connection) spent nothing: the attempt the claim took is given
-- back, so `attempt_count` counts only calls that may have cost money, and `max_attempts`
-- bounds those. Refusals have a budget of their own, in time: the first refusal sets
-- `refusal_deadline` (`retry.refusal_budget_ms` later), and no retry after a refusal is planned
-- past it; `refusals` counts them. The attempt row of a refused call says `refused`.

alter table reply_tasks
    add column refusals         integer     not null default 0 check (refusals >= 0),
    add column refusal_deadline timestamptz;

alter table reply_attempts drop constraint reply_attempts_outcome_check;
alter table reply_attempts add constraint reply_attempts_outcome_check
    check (outcome in ('accepted', 'fenced', 'abandoned', 'provider_error', 'timeout',
                       'ambiguous', 'failed', 'refused'));

-- The claim functions of V9 and V12, returning the two new columns with the row (a function's
-- result type cannot be changed in place: dropped and created again, the body as before).
drop function replyd_claim_many(uuid[], text, float8, text[], text[], text[], text[], jsonb[],
                                integer[], timestamptz[]);
drop function replyd_claim(uuid, text, float8, text, text, text, text, jsonb, integer,
                           timestamptz);

-- Claims `p_task` for `p_owner` with a lease of `p_lease_secs` seconds. With `p_request` set,
-- first inserts the task from the record's fields if it is absent (`created` says whether this
-- call did). `claim` is one of the labels of `ClaimOutcome`; the other columns are the row after
-- the claim (all null when there is no row), and `now` is the clock the decision read.
create function replyd_claim(
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
        return query select 'not_found'::text, v_created, clock_timestamp(),
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
               attempt_count = r.attempt_count + 1, updated_at = clock_timestamp()
         where r.task_id = p_task
        returning * into t;
        insert into reply_attempts (task_id, attempt_no, assignment_version, worker, lease_until)
        values (p_task, t.attempt_count, t.assignment_version, p_owner, t.lease_until);
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
                            null, null) c;
    end loop;
end
$$;
