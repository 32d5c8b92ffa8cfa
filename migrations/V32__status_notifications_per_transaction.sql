-- One status notification per transaction, not one per task. V3's row trigger sent a
-- notification for every task whose status changed, so a batch of 64 claims
-- (`replyd_claim_many`, one claim statement per task) or 64 completions (`replyd_complete_many`)
-- put 64 entries in the notification queue, and every listening session of the database (each
-- API process with an open stream, each worker with a call running, each relay) woke and read
-- all 64. Now a transaction's changes go out together at its commit: payloads of
-- '<task_id> <status>' lines, each under NOTIFY's 8,000 bytes (a line is at most 46 bytes; a
-- payload is sent once it passes 7,050, so a few hundred tasks changed at once cost one
-- entry per 150 or so, and the gathered text never grows past one payload).
--
-- How: a row trigger gathers each change's line into a setting local to the transaction
-- (`replyd.task_statuses`, undone with a subtransaction that rolls back, as its row change
-- is), and a deferred constraint trigger, which runs at commit, sends what is gathered. A
-- NOTIFY is delivered only at commit anyway, so nobody hears a change sooner or later than
-- before; a listener hears the transaction's changes in one payload instead of one each.
--
-- A listener of the previous release reads one '<task_id> <status>' per payload: a payload of
-- one task is unchanged for it, and one of several it logs as not understood and drops. A
-- notification is a hint (a parked record still wakes at its lease end, a stream re-reads on
-- its timer), so a rollback costs such a listener time during the rollout, never a reply.
-- V3's function stays, unused, for a schema the previous release can still read as its own.

create function replyd_gather_task_status() returns trigger
language plpgsql as $$
declare
    gathered text := coalesce(current_setting('replyd.task_statuses', true), '');
begin
    gathered := gathered || case when gathered = '' then '' else E'\n' end
                         || new.task_id::text || ' ' || new.status;
    if length(gathered) >= 7050 then
        perform pg_notify('replyd_task_status', gathered);
        gathered := '';
    end if;
    perform set_config('replyd.task_statuses', gathered, true);
    return null;
end
$$;

-- Runs at commit once per changed row: the first sends what was gathered, the rest find it
-- empty.
create function replyd_send_task_statuses() returns trigger
language plpgsql as $$
declare
    gathered text := coalesce(current_setting('replyd.task_statuses', true), '');
begin
    if gathered <> '' then
        perform set_config('replyd.task_statuses', '', true);
        perform pg_notify('replyd_task_status', gathered);
    end if;
    return null;
end
$$;

drop trigger reply_tasks_status_notify on reply_tasks;

create trigger reply_tasks_status_gather
    after update of status on reply_tasks
    for each row
    when (old.status is distinct from new.status)
    execute function replyd_gather_task_status();

create constraint trigger reply_tasks_status_notify
    after update of status on reply_tasks
    deferrable initially deferred
    for each row
    when (old.status is distinct from new.status)
    execute function replyd_send_task_statuses();
