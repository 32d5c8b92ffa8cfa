-- Generation quotas (I8). One counter row per workspace: its limit per period (NULL: no
-- limit; reservations are still kept, so every generation is charged once), the current
-- window, what was charged in it and how many reservations are open. Admission is one
-- conditional UPDATE of this row, so concurrent requests cannot both take the last unit.
create table quota_counters (
    workspace_id     text        primary key references workspaces,
    generation_limit bigint      check (generation_limit >= 0),
    period_seconds   bigint      not null default 86400 check (period_seconds > 0),
    -- Windows are aligned to the Unix epoch (a 1-day period starts at 00:00 UTC).
    window_start     timestamptz not null default 'epoch',
    -- Charged in the window that starts at window_start.
    used             bigint      not null default 0 check (used >= 0),
    -- Reservations in state 'reserved' (they hold capacity across windows until settled).
    reserved         bigint      not null default 0 check (reserved >= 0),
    updated_at       timestamptz not null default clock_timestamp()
);

insert into quota_counters (workspace_id) select workspace_id from workspaces;

create function replyd_quota_counter() returns trigger language plpgsql as $$
begin
    insert into quota_counters (workspace_id) values (new.workspace_id) on conflict do nothing;
    return new;
end;
$$;

create trigger workspaces_quota_counter after insert on workspaces
    for each row execute function replyd_quota_counter();

-- One reservation per API-created task, written in the intake transaction. Every state change
-- is one guarded statement (WHERE state = 'reserved'): whoever settles first wins, the others
-- change nothing.
create table quota_reservations (
    task_id         uuid        primary key references reply_tasks,
    workspace_id    text        not null references workspaces,
    operation       text        not null,
    idempotency_key text        not null,
    state           text        not null default 'reserved'
                    check (state in ('reserved', 'charged', 'released', 'expired')),
    created_at      timestamptz not null default clock_timestamp(),
    expires_at      timestamptz not null,
    settled_at      timestamptz,
    -- Who settled it (the worker's id, 'reconciler') and why.
    settled_by      text,
    settle_reason   text,
    -- The policy when it was admitted: whether a failed task is charged (quota.charge_failed).
    charge_on_failure boolean   not null,
    -- How often the reconciler found the task still alive and moved expires_at on.
    extensions      integer     not null default 0,
    check ((state = 'reserved') = (settled_at is null))
);

create index quota_reservations_open on quota_reservations (expires_at) where state = 'reserved';

-- The window that holds `at`, for a counter whose current window starts at `window_start`:
-- the same one while it lasts, else the epoch-aligned window of `at`.
create function replyd_quota_window(window_start timestamptz, period_seconds bigint, at timestamptz)
returns timestamptz language sql stable as $$
    select case when at < window_start + make_interval(secs => period_seconds) then window_start
                else to_timestamp(floor(extract(epoch from at) / period_seconds) * period_seconds)
           end
$$;

-- One settled reservation on its workspace's counter: no longer held, and `units` charged in
-- the window of now.
create function replyd_quota_settle_counter(ws text, units bigint) returns void
language sql as $$
    update quota_counters
       set used = case when replyd_quota_window(window_start, period_seconds, clock_timestamp()) = window_start
                       then used else 0 end + units,
           window_start = replyd_quota_window(window_start, period_seconds, clock_timestamp()),
           reserved = reserved - 1,
           updated_at = clock_timestamp()
     where workspace_id = ws
$$;

-- Every decision about a reservation other than the worker's own settlement: who, when, why.
create table quota_decisions (
    decision_id bigserial   primary key,
    task_id     uuid        not null references reply_tasks,
    decided_at  timestamptz not null default clock_timestamp(),
    decided_by  text        not null,
    decision    text        not null,
    reason      text        not null
);
create index quota_decisions_by_task on quota_decisions (task_id);

-- Settles task `id`'s open reservation, if any, from the task's status: completed is charged;
-- failed is charged or released by the policy it was admitted under; `expire` (the
-- reconciler ending a task nobody works) makes it expired, without a charge. Guarded on
-- state = 'reserved': whoever settles first wins, a second call changes nothing.
create function replyd_settle(id uuid, status text, by_whom text, why text, expire boolean)
returns text language plpgsql as $$
declare
    ws text;
    settled text;
begin
    update quota_reservations r
       set state = case when expire then 'expired'
                        when status = 'completed' or r.charge_on_failure then 'charged'
                        else 'released' end,
           settled_at = clock_timestamp(),
           settled_by = by_whom,
           settle_reason = why
     where r.task_id = id and r.state = 'reserved'
    returning r.workspace_id, r.state into ws, settled;
    if found then
        perform replyd_quota_settle_counter(ws, case when settled = 'charged' then 1 else 0 end);
    end if;
    return settled;
end;
$$;

-- A task's terminal status settles its reservation in the transaction that writes the status,
-- so a reply without its charge, or a charge without its reply, cannot be committed, whichever
-- path ends the task (completion, failure, a claim past the budget, the reconciler). The
-- reconciler marks its own ending of a task with `SET LOCAL replyd.settle_as = 'expired'`.
create function replyd_settle_reservation() returns trigger language plpgsql as $$
begin
    if new.status is not distinct from old.status or new.status not in ('completed', 'failed') then
        return new;
    end if;
    perform replyd_settle(
        new.task_id,
        new.status,
        coalesce(new.lease_owner, 'replyd'),
        case when new.status = 'completed' then 'task completed'
             else 'task failed: ' || coalesce(new.failure, '') end,
        coalesce(current_setting('replyd.settle_as', true), '') = 'expired');
    return new;
end;
$$;

create trigger reply_tasks_settle_reservation after update of status on reply_tasks
    for each row execute function replyd_settle_reservation();
