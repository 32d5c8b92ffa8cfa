-- One status notification per statement, not one per task. V3's row trigger sent a
-- notification for every task whose status changed, so a batch of 64 completions (one
-- statement, `replyd_complete_many`) or of 64 claims put 64 entries in the notification queue,
-- and every listening session of the database (each API process with an open stream, each
-- worker with a call running, each relay) woke and read all 64. Now one statement's changes go
-- out together: one payload of '<task_id> <status>' lines, split where it would pass
-- NOTIFY's 8,000 bytes (150 lines of at most 47 bytes), in task order.
--
-- A transition table needs a trigger with no column list, so it fires on every update of the
-- table; a statement that changed no status (a lease renewal) notifies nothing, as before.
--
-- A listener of the previous release reads one '<task_id> <status>' per payload: a payload of
-- one task is unchanged for it, and one of several it logs as not understood and drops. A
-- notification is a hint (a parked record still wakes at its lease end, a stream re-reads on
-- its timer), so a rollback costs such a listener time during the rollout, never a reply.
-- V3's function stays, unused, for a schema the previous release can still read as its own.

create function replyd_notify_task_statuses() returns trigger
language plpgsql as $$
declare
    payload text;
begin
    for payload in
        select string_agg(c.task_id::text || ' ' || c.status, E'\n' order by c.task_id)
        from (select n.task_id, n.status,
                     (row_number() over (order by n.task_id) - 1) / 150 as part
              from changed_new n
              join changed_old o on o.task_id = n.task_id
              where o.status is distinct from n.status) c
        group by c.part
        order by c.part
    loop
        perform pg_notify('replyd_task_status', payload);
    end loop;
    return null;
end
$$;

drop trigger reply_tasks_status_notify on reply_tasks;

create trigger reply_tasks_status_notify
    after update on reply_tasks
    referencing old table as changed_old new table as changed_new
    for each statement
    execute function replyd_notify_task_statuses();
