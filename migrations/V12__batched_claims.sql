-- Claims gathered into one call (`database.batch_claims`): one transaction and one round trip
-- for many records, each claimed exactly as `replyd_claim` claims it (the same function runs
-- for each row, so the decision is written once).
--
-- The rows are taken in task order, and each row's lock is tried without waiting (SKIP
-- LOCKED): a row another session holds is answered `busy`, and its claim is then sent alone,
-- through `replyd_claim`, which waits on the lock. The only wait left inside the call is the
-- insert of a task another transaction is inserting at the same moment; as every batch takes
-- its rows in task order, two batches cannot wait on each other in a cycle.

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
    next_attempt_at timestamptz, last_error_class text, last_error text)
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
                null::timestamptz, null::text, null::text;
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
