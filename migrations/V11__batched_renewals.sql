-- Every lease a worker holds, renewed in one call per renewal interval (`replyd_renew_many`):
-- one transaction per worker per interval instead of one per task. That is what makes a short
-- lease cheap, and a short lease is what bounds how long a killed worker's tasks wait.
--
-- Like `replyd_complete_many`, the call never waits on a row lock: it locks the rows that are
-- free now (SKIP LOCKED, in task order) and answers `busy` for a row another session holds, so
-- it cannot deadlock with a batch or hold up a completion. Each locked row is guarded exactly
-- as a lone renewal is (`replyd_lease_holds`), with the clock read after all of the call's
-- locks are held. A `busy` or `refused` row is then renewed alone by the caller, through the
-- path that waits on the lock and reads why a refused lease is gone.

create function replyd_renew_many(p_tasks uuid[], p_versions bigint[], p_secs double precision)
returns table (task_id uuid, outcome text)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    v_locked uuid[];
    v_renewed uuid[];
begin
    select coalesce(array_agg(l.task_id), '{}') into v_locked from (
        select r.task_id from reply_tasks r where r.task_id = any(p_tasks)
         order by r.task_id for update skip locked) l;
    with input as (
        select * from unnest(p_tasks, p_versions) as i(task_id, version)
         where i.task_id = any(v_locked)),
    renewed as (
        update reply_tasks r
           set lease_until = clock_timestamp() + make_interval(secs => p_secs),
               updated_at = clock_timestamp()
          from input i
         where r.task_id = i.task_id and replyd_lease_holds(r, i.version)
        returning r.task_id)
    select coalesce(array_agg(n.task_id), '{}') into v_renewed from renewed n;
    return query select i.task_id,
        case when i.task_id = any(v_renewed) then 'renewed'
             when i.task_id = any(v_locked) then 'refused'
             when exists (select 1 from reply_tasks r where r.task_id = i.task_id) then 'busy'
             else 'refused' end
      from unnest(p_tasks) as i(task_id);
end
$$;
