-- Completions gathered into one call (`database.batch_completions`): one transaction and one
-- round trip for many tasks, each row guarded exactly as `replyd_complete` guards it.
--
-- The batch never waits on a row lock. It locks the rows that are free now (SKIP LOCKED, so no
-- two batches can deadlock either) and answers `busy` for a row someone else holds; that row's
-- completion is then sent alone, through `replyd_complete`, which waits on the lock and reads
-- the clock after it (the seed's order). Every locked row's guard reads the clock after all of
-- the batch's locks are held.

create function replyd_complete_many(
    p_tasks uuid[], p_versions bigint[], p_responses text[], p_metas jsonb[])
returns table (
    task_id uuid, accepted boolean, busy boolean, status text, assignment_version bigint,
    lease_owner text, lease_until timestamptz, attempt_count integer, max_attempts integer,
    deadline timestamptz, next_attempt_at timestamptz, has_response boolean, now timestamptz)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    v_locked uuid[];
    v_done uuid[];
begin
    select coalesce(array_agg(l.task_id), '{}') into v_locked from (
        select r.task_id from reply_tasks r where r.task_id = any(p_tasks)
         order by r.task_id for update skip locked) l;
    with input as (
        select * from unnest(p_tasks, p_versions, p_responses, p_metas)
            as i(task_id, version, response, meta)
         where i.task_id = any(v_locked)),
    done as (
        update reply_tasks r set saved_response = i.response, response_meta = i.meta,
               status = 'completed', finished_at = clock_timestamp(),
               updated_at = clock_timestamp()
          from input i
         where r.task_id = i.task_id and replyd_lease_holds(r, i.version)
        returning r.task_id, i.version),
    recorded as (
        update reply_attempts a set outcome = 'accepted', detail = null,
               finished_at = clock_timestamp()
          from done d
         where a.task_id = d.task_id and a.assignment_version = d.version
           and (a.outcome is null or a.outcome = 'abandoned'))
    select coalesce(array_agg(d.task_id), '{}') into v_done from done d;
    -- One answer per task asked about; no row: no such task. A refused row is read under the
    -- batch's lock, for the caller to say why.
    return query select i.task_id, i.task_id = any(v_done),
        r.task_id is not null and not (i.task_id = any(v_locked)),
        r.status, r.assignment_version, r.lease_owner, r.lease_until, r.attempt_count,
        r.max_attempts, r.deadline, r.next_attempt_at, r.saved_response is not null,
        clock_timestamp()
      from unnest(p_tasks) as i(task_id)
      left join reply_tasks r on r.task_id = i.task_id;
end
$$;
