-- Two ends that must not be taken for something else.
--
-- 1. Work whose outcome nobody knows (I8). A provider call whose answer was lost after the
--    request was sent, an operation the provider accepted, an attempt cut short by a crash: the
--    provider may have done (and billed) the work. `provider_may_have_run` remembers that, for
--    good, on the task. When such a task fails and failures are not charged, its reservation is
--    not released as if nothing ran: it stays `reserved` (unresolved, still holding capacity)
--    until the reconciler asks the provider where it can (a stored operation id) or, past the
--    reservation's TTL, settles it as `quota.charge_unresolved` says.
--
-- 2. Records the broker refuses for good (a record over the topic's `max.message.bytes`, an
--    invalid record). Such an outbox row can never be published; the relay marks it refused and
--    fails its task with the broker's reason in the same transaction, its reservation released
--    (no work was ever done), instead of trying it again forever and holding readiness down.

alter table reply_tasks
    add column provider_may_have_run boolean not null default false;

-- A running task whose lease ran out and that someone else now takes over or ends (a claim
-- that takes it over, or fails it on its budget or deadline) lost its assignment mid-call: the
-- vanished worker may have sent its call. Noted here, whichever path does it (the lone claim,
-- the batched one, the reconciler), so no path can forget it. The holder's own writes (fenced
-- on a live lease) say themselves whether their call may have run.
create function replyd_note_lapsed_call() returns trigger language plpgsql as $$
begin
    if old.status = 'running' and old.lease_until <= clock_timestamp()
       and (new.assignment_version > old.assignment_version or new.status <> 'running') then
        new.provider_may_have_run := true;
    end if;
    return new;
end;
$$;

create trigger reply_tasks_note_lapsed_call
    before update of assignment_version, status on reply_tasks
    for each row execute function replyd_note_lapsed_call();

alter table outbox
    add column refused_at timestamptz,
    add column refusal    text,
    add constraint refused_has_reason check ((refused_at is null) = (refusal is null)),
    add constraint published_or_refused check (published_at is null or refused_at is null);

drop index outbox_unpublished;
create index outbox_unpublished on outbox (outbox_id)
    where published_at is null and refused_at is null;

-- Settles task `id`'s open reservation to `target` ('charged', 'released' or 'expired'),
-- guarded on state = 'reserved': whoever settles first wins, a second call changes nothing.
-- Returns the state it went to, or null when it was settled already (or there is none). The
-- counter is moved by the same instant as `settled_at`, so a charge lands in the window its
-- ledger row says, even on a window's boundary (a period change recounts from the ledger).
create function replyd_settle_to(id uuid, target text, by_whom text, why text)
returns text language plpgsql as $$
declare
    ws text;
    settled text;
    at timestamptz := clock_timestamp();
begin
    update quota_reservations r
       set state = target, settled_at = at, settled_by = by_whom, settle_reason = why
     where r.task_id = id and r.state = 'reserved'
    returning r.workspace_id, r.state into ws, settled;
    if found then
        update quota_counters
           set used = case when replyd_quota_window(window_start, period_seconds, at) = window_start
                           then used else 0 end
                      + case when settled = 'charged' then 1 else 0 end,
               window_start = replyd_quota_window(window_start, period_seconds, at),
               reserved = reserved - 1,
               updated_at = at
         where workspace_id = ws;
    end if;
    return settled;
end;
$$;

-- As before (V7): completed is charged; failed is charged or released by the policy it was
-- admitted under; `expire` makes it expired. Now written through `replyd_settle_to`.
create or replace function replyd_settle(id uuid, status text, by_whom text, why text, expire boolean)
returns text language plpgsql as $$
begin
    return replyd_settle_to(
        id,
        case when expire then 'expired'
             when status = 'completed' then 'charged'
             when (select r.charge_on_failure from quota_reservations r where r.task_id = id)
                  then 'charged'
             else 'released' end,
        by_whom, why);
end;
$$;

-- A task's terminal status settles its reservation in the transaction that writes the status
-- (V7), with two changes:
-- - `SET LOCAL replyd.settle_as = '<state>'` names the state outright: the reconciler ending a
--   task nobody works ('expired', or 'charged' when the provider may have run it), the relay
--   failing a task whose record the broker refused ('released': nothing ever ran);
-- - a failed task whose provider may have done the work keeps its reservation open when
--   failures are not charged: unresolved, for the reconciler to settle (I8).
create or replace function replyd_settle_reservation() returns trigger language plpgsql as $$
declare
    settle_as text := nullif(current_setting('replyd.settle_as', true), '');
    by_whom text := coalesce(new.lease_owner, 'replyd');
    why text := case when new.status = 'completed' then 'task completed'
                     else 'task failed: ' || coalesce(new.failure, '') end;
begin
    if new.status is not distinct from old.status or new.status not in ('completed', 'failed') then
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

-- Its work is now `replyd_settle_to`'s, at the instant of the settlement.
drop function replyd_quota_settle_counter(text, bigint);
