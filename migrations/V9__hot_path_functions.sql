-- The hot path's two fenced writes as server-side functions, so that a task costs two round
-- trips and two transactions when nothing goes wrong: `replyd_claim` (insert the record's task
-- if absent, lock it, decide, take the lease and open the attempt row, return the row) and
-- `replyd_complete` (lock, guarded save, close the attempt row). Each statement inside a
-- function runs after the one before it, so the seed's order holds exactly as in a client-side
-- transaction: the row lock is held before any check reads `clock_timestamp()`.
--
-- The claim's decision is written here, and `fencing::decide_claim` (Rust) is its
-- specification: `tests/store_functions.rs` checks that the two agree on generated rows.

-- The fence of I2, the one place it is written: the row is this assignment's, still running,
-- its lease live by the database clock (read when this is evaluated, so after the row lock is
-- held), and no reply saved yet. Every fenced UPDATE, here or sent by replyd, filters on it.
create function replyd_lease_holds(t reply_tasks, version bigint) returns boolean
language sql volatile as $$
    select t.assignment_version = version and t.status = 'running'
       and t.lease_until > clock_timestamp() and t.saved_response is null
$$;

-- Inserts a record's task unless it exists; true when this call inserted it. The one insert of
-- a task from a record: `replyd_claim` calls it, and so does `Store::ensure_task`.
create function replyd_insert_task(
    p_task uuid, p_workspace text, p_conversation text, p_message text,
    p_document_version text, p_request jsonb, p_max_attempts integer, p_deadline timestamptz)
returns boolean
language plpgsql volatile as $$
begin
    insert into reply_tasks (task_id, workspace_id, conversation_id, message_id,
                             document_version, request, max_attempts, deadline)
    values (p_task, p_workspace, p_conversation, p_message, p_document_version, p_request,
            p_max_attempts, p_deadline)
    on conflict (task_id) do nothing;
    return found;
end
$$;

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
    next_attempt_at timestamptz, last_error_class text, last_error text)
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
            null::text, null::text;
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
        r.last_error
      from reply_tasks r where r.task_id = p_task;
end
$$;

-- Saves `p_response` and completes the task if assignment `p_version` still holds its lease
-- (I1, I2, I4), and records `accepted` on its attempt row, in one transaction. No row: the task
-- does not exist. `accepted` false: the write was refused, and the other columns are the row as
-- read under the same lock, for the caller to say why (`fencing::classify_refusal`).
create function replyd_complete(p_task uuid, p_version bigint, p_response text, p_meta jsonb)
returns table (
    accepted boolean, status text, assignment_version bigint, lease_owner text,
    lease_until timestamptz, attempt_count integer, max_attempts integer,
    deadline timestamptz, next_attempt_at timestamptz, has_response boolean, now timestamptz)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    v_accepted boolean;
begin
    perform 1 from reply_tasks r where r.task_id = p_task for update;
    if not found then
        return;
    end if;
    update reply_tasks r set saved_response = p_response, response_meta = p_meta,
           status = 'completed', finished_at = clock_timestamp(), updated_at = clock_timestamp()
     where r.task_id = p_task and replyd_lease_holds(r, p_version);
    v_accepted := found;
    if v_accepted then
        update reply_attempts a set outcome = 'accepted', detail = null,
               finished_at = clock_timestamp()
         where a.task_id = p_task and a.assignment_version = p_version
           and (a.outcome is null or a.outcome = 'abandoned');
    end if;
    return query select v_accepted, r.status, r.assignment_version, r.lease_owner, r.lease_until,
        r.attempt_count, r.max_attempts, r.deadline, r.next_attempt_at,
        r.saved_response is not null, clock_timestamp()
      from reply_tasks r where r.task_id = p_task;
end
$$;
