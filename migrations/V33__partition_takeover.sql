-- Recovery after a kill: a claim made for a Kafka record takes over at once a live lease that
-- was taken for a record of the same partition by another holder, instead of waiting it out
-- (`lease::Claimer::may_take_over`, the rule these functions are held to by the store's tests;
-- the lease model checks it).
--
-- Why it is safe: the group gives a partition to one member at a time, and a member that loses
-- one cancels its work for it before the partition is handed on. A live lease from the same
-- partition held by someone else therefore belongs to a dead holder (a killed worker, whether
-- its partitions went to a survivor or came back to it restarted under the same id with static
-- membership) or to a zombie (stalled past its session). The takeover adds one to the
-- assignment version, so that holder's late writes are refused by the fence (I2), as after
-- any takeover. The lease owner carries the process's incarnation (`<worker_id>#<token>`), so
-- a restarted worker is another holder than the one it replaces, while a duplicate record of
-- the task in the same process (the same owner) still parks until its own lease ends.
--
-- `lease_partition` is the partition of the record the current lease was claimed for, written
-- only when the claimer holds that partition alone: not `source_partition`, which an SQS
-- message also writes (its queue's one "partition", 0, read by every worker at once) and which
-- a claim for no record leaves as it was. The holder's call may have run: a takeover of a live
-- lease notes `provider_may_have_run` itself (V13's trigger notes only a lapsed one), so its
-- reservation is never released as if nothing ran (I8).
--
-- Expand only: the column is added without a default; the signatures the previous release
-- calls (V21's twelve-argument claim and claim_many) become wrappers of the new ones with no
-- partition held, so a process of the previous release keeps today's rule (and writes no
-- `lease_partition`, so its leases are never taken over early) while a rolling update
-- replaces it. It never sees the new label. (A plpgsql function replaced here cannot call its
-- old body, so the old signatures call the new bodies.)

alter table reply_tasks add column lease_partition integer;

-- V23's claim, with the takeover rule (`p_partition_held`: the claimer holds `p_partition`
-- alone in its consumer group).
create function replyd_claim(
    p_task uuid, p_owner text, p_lease_secs float8,
    p_workspace text, p_conversation text, p_message text, p_document_version text,
    p_request jsonb, p_max_attempts integer, p_deadline timestamptz,
    p_partition integer, p_offset bigint, p_partition_held boolean)
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
    v_live boolean;
    v_take_over boolean;
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
    v_live := t.status = 'running' and t.lease_until > v_now;
    -- `Claimer::may_take_over`: the live lease was taken for a record of the partition this
    -- claimer holds alone, by another holder (another process, or an earlier incarnation of
    -- this worker id), who has lost the partition since.
    v_take_over := coalesce(v_live and p_partition_held and t.lease_partition = p_partition
                            and t.lease_owner is distinct from p_owner, false);
    v_claim := case
        when t.status = 'completed' then 'already_completed'
        when t.status = 'failed' then 'already_failed'
        when t.status = 'cancelled' then 'already_cancelled'
        when v_live and not v_take_over then 'leased_by_other'
        -- Before the backoff: a task whose deadline passed while it waited fails now.
        when t.deadline <= v_now then 'deadline_passed'
        when t.next_attempt_at > v_now then 'backing_off'
        when t.attempt_count >= t.max_attempts then 'budget_exhausted'
        when v_take_over then 'took_over_from_previous_holder'
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
        -- A live lease's holder may have sent its call: `replyd_note_lapsed_call` (V13) notes
        -- only a lapsed one, so a takeover notes it here (I8: never released as if nothing ran).
        update reply_tasks r set status = 'failed', failure = v_reason,
               finished_at = clock_timestamp(), updated_at = clock_timestamp(),
               provider_may_have_run = r.provider_may_have_run or v_take_over
         where r.task_id = p_task;
        update reply_attempts a set outcome = 'abandoned', detail = v_reason,
               finished_at = clock_timestamp()
         where a.task_id = p_task and a.outcome is null;
    elsif v_claim in ('claimed', 'took_over_from_previous_holder') then
        if t.status = 'running' then
            -- The previous assignment's lease ran out without an outcome, or its holder lost
            -- the partition. If it comes back, its write is refused and this row is rewritten
            -- as `fenced`.
            update reply_attempts a set outcome = 'abandoned',
                   detail = case when v_take_over
                                 then 'partition moved; taken over from ' || t.lease_owner
                                 else 'lease expired; taken over' end,
                   finished_at = clock_timestamp()
             where a.task_id = p_task and a.outcome is null;
        end if;
        update reply_tasks r set status = 'running',
               assignment_version = r.assignment_version + 1, lease_owner = p_owner,
               lease_until = clock_timestamp() + make_interval(secs => p_lease_secs),
               attempt_count = r.attempt_count + 1, updated_at = clock_timestamp(),
               source_partition = coalesce(p_partition, r.source_partition),
               source_offset = case when p_partition is null then r.source_offset
                                    else p_offset end,
               -- Only a claim whose claimer holds the partition alone marks the lease as
               -- takeable by the partition's next holder.
               lease_partition = case when p_partition_held then p_partition end,
               provider_may_have_run = r.provider_may_have_run or v_take_over
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


-- V21's batch, naming per row whether its partition is held alone.
create function replyd_claim_many(
    p_tasks uuid[], p_owner text, p_lease_secs float8,
    p_workspaces text[], p_conversations text[], p_messages text[],
    p_document_versions text[], p_requests jsonb[], p_max_attempts integer[],
    p_deadlines timestamptz[], p_partitions integer[], p_offsets bigint[],
    p_partitions_held boolean[])
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
                            null, null, p_partitions[i], p_offsets[i],
                            coalesce(p_partitions_held[i], false)) c;
    end loop;
end
$$;


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
language sql volatile as $$
    select * from replyd_claim(p_task, p_owner, p_lease_secs, p_workspace, p_conversation,
                               p_message, p_document_version, p_request, p_max_attempts,
                               p_deadline, p_partition, p_offset, false)
$$;

create or replace function replyd_claim_many(
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
language sql volatile as $$
    select * from replyd_claim_many(p_tasks, p_owner, p_lease_secs, p_workspaces,
                                    p_conversations, p_messages, p_document_versions,
                                    p_requests, p_max_attempts, p_deadlines, p_partitions,
                                    p_offsets,
                                    array_fill(false, array[cardinality(p_tasks)]))
$$;
