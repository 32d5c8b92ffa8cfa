-- Every change of a task's status is announced on the channel `replyd_task_status`, payload
-- '<task_id> <new status>', by the transaction that makes it (a trigger, so no path that
-- completes, fails or gives back a task can forget it). Listeners treat it as a hint to read
-- the row again: a worker wakes the records parked on that task, so a duplicate does not wait
-- out a lease whose work is already saved. NOTIFY is delivered only if the transaction commits.
create function replyd_notify_task_status() returns trigger
language plpgsql as $$
begin
    perform pg_notify('replyd_task_status', new.task_id::text || ' ' || new.status);
    return null;
end
$$;

create trigger reply_tasks_status_notify
    after update of status on reply_tasks
    for each row
    when (old.status is distinct from new.status)
    execute function replyd_notify_task_status();
