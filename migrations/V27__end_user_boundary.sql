-- The end-user boundary, closed where outside testers found it open. Expand only: every
-- column added has a default, and every table and function of the previous release stays, so a
-- process of that release still runs against this schema while a rolling update replaces it.
--
-- 1. A Stop is charged when its call may have run. Since live text, a user who stops a reply
--    has been shown what the provider wrote; a call that may have started is work the
--    provider bills. `replyd_cancel` now settles the reservation itself, before the status
--    changes: released only when no call can have started (the task was pending and no
--    earlier call may have run), else charged: one generation, and in tokens what the
--    provider reported, else the prompt's bound and the text the followers were shown (a
--    token is at least one byte), never past the ceiling.
-- 2. Idempotency keys are the caller's: an end user's key is scoped to them, so one user
--    learns nothing of another's requests from a key's verdict.
-- 3. An end user's share counts what was charged in its window whatever was erased since:
--    forgetting a task keeps its user's charge, without content.
-- 4. End-user tokens are signed with a workspace's signing key, kept sealed (AES-256-GCM under
--    `api.end_user_token_key`, which never enters the database), versioned so a rotation keeps
--    the old key valid for a stated overlap. The secrets V24 kept in the clear are deleted:
--    nothing of this release takes a token they signed.

-- 1. A Stop's charge. ---------------------------------------------------------------------

-- The tokens a Stop charges for a call that may have run (`quota::stop_tokens` is its twin):
-- the usage its attempts reported, or at least the prompt's bound (the ceiling less the output
-- bound: the request's `max_output_tokens`, else `workspace_policy::DEFAULT_OUTPUT_CEILING`)
-- and `shown` bytes of text, never past the ceiling for text alone.
create function replyd_stop_tokens(id uuid, ceiling bigint, shown bigint) returns bigint
language sql stable as $$
    select greatest(
        coalesce((select sum(a.prompt_tokens + a.completion_tokens) from reply_attempts a
                   where a.task_id = id and a.prompt_tokens is not null), 0),
        least(ceiling,
              greatest(0, ceiling - coalesce((t.request ->> 'max_output_tokens')::bigint, 4096))
              + greatest(0, shown)))::bigint
      from reply_tasks t where t.task_id = id
$$;

-- V17's settlement, with the tokens of a Stop's charge: `shown` (bytes of text its followers
-- were shown) set means a Stop settles; null, every other settler, as before.
create function replyd_settle_to(id uuid, target text, by_whom text, why text, shown bigint)
returns text language plpgsql as $$
declare
    ws text;
    settled text;
    ceiling bigint;
    charged bigint;
    at timestamptz := clock_timestamp();
begin
    update quota_reservations r
       set state = target, settled_at = at, settled_by = by_whom, settle_reason = why,
           tokens_charged = case when shown is null or target <> 'charged'
                                 then replyd_tokens_to_charge(id, target, r.token_ceiling)
                                 else replyd_stop_tokens(id, r.token_ceiling, shown) end
     where r.task_id = id and r.state = 'reserved'
    returning r.workspace_id, r.state, r.token_ceiling, r.tokens_charged
         into ws, settled, ceiling, charged;
    if found then
        update quota_counters
           set used = case when replyd_quota_window(window_start, period_seconds, at) = window_start
                           then used else 0 end
                      + case when settled = 'charged' then 1 else 0 end,
               tokens_used = case when replyd_quota_window(window_start, period_seconds, at) = window_start
                                  then tokens_used else 0 end
                             + charged,
               window_start = replyd_quota_window(window_start, period_seconds, at),
               reserved = reserved - 1,
               tokens_reserved = tokens_reserved - ceiling,
               updated_at = at
         where workspace_id = ws;
    end if;
    return settled;
end;
$$;

create or replace function replyd_settle_to(id uuid, target text, by_whom text, why text)
returns text language sql as $$
    select replyd_settle_to(id, target, by_whom, why, null::bigint)
$$;

-- V23's Stop, settling the reservation before the status changes: the text shown is read
-- while it is still there (the task's end deletes it, `replyd_live_text_ended`).
create or replace function replyd_cancel(p_task uuid)
returns table (outcome text, status text)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    v_status text;
    v_may_have_run boolean;
    v_shown bigint;
begin
    select r.status, r.provider_may_have_run or r.status = 'running'
      into v_status, v_may_have_run
      from reply_tasks r where r.task_id = p_task for update;
    if not found then
        return query select case when exists (select 1 from forgotten_tasks f
                                               where f.task_id = p_task)
                                 then 'forgotten' else 'not_found' end, null::text;
        return;
    end if;
    if v_status not in ('pending', 'running') then
        return query select 'already_' || v_status, v_status;
        return;
    end if;
    if v_may_have_run then
        select coalesce(sum(octet_length(l.text)), 0) into v_shown
          from reply_live_text l where l.task_id = p_task;
        perform replyd_settle_to(p_task, 'charged', 'replyd cancel',
                                 'task cancelled; its call may have run', v_shown);
    else
        perform replyd_settle_to(p_task, 'released', 'replyd cancel',
                                 'task cancelled before any call', null);
    end if;
    update reply_attempts a set outcome = 'cancelled', detail = 'task cancelled',
           finished_at = clock_timestamp()
     where a.task_id = p_task and a.outcome is null;
    -- A running task's call may be under way, live lease or not (the lapsed-call trigger
    -- notes only a lapsed one): remembered for `replyd inspect`, as a takeover would.
    update reply_tasks r
       set status = 'cancelled', assignment_version = r.assignment_version + 1,
           provider_may_have_run = v_may_have_run,
           lease_owner = null, lease_until = null, next_attempt_at = null,
           finished_at = clock_timestamp(), updated_at = clock_timestamp()
     where r.task_id = p_task;
    return query select 'cancelled'::text, 'cancelled'::text;
end
$$;

-- V23's settlement on a terminal status: a cancelled task's reservation was settled by its
-- Stop; should one be open still (a process of an earlier release cancelling), it is settled
-- by the same rule, without the text shown.
create or replace function replyd_settle_reservation() returns trigger language plpgsql as $$
declare
    settle_as text := nullif(current_setting('replyd.settle_as', true), '');
    by_whom text := coalesce(new.lease_owner, 'replyd');
    why text := case when new.status = 'completed' then 'task completed'
                     when new.status = 'cancelled' then 'task cancelled'
                     else 'task failed: ' || coalesce(new.failure, '') end;
begin
    if new.status is not distinct from old.status
       or new.status not in ('completed', 'failed', 'cancelled') then
        return new;
    end if;
    if new.status = 'cancelled' then
        perform replyd_settle_to(new.task_id,
                                 case when new.provider_may_have_run then 'charged'
                                      else 'released' end,
                                 'replyd cancel', why,
                                 case when new.provider_may_have_run then 0 end);
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

-- 2. Idempotency keys scoped to the caller. ------------------------------------------------

-- '' for the workspace's key; the end user's id for their token.
alter table idempotency_keys add column end_user_id text not null default '';
-- The keys end users used before: theirs, as their reservations say, so a retry of a press
-- made before this release is still its replay (I6). Keys live `api.idempotency_retention_ms`
-- (a day by default): this touches a day's presses at most.
update idempotency_keys k set end_user_id = r.end_user_id
  from quota_reservations r
 where r.task_id = k.task_id and r.end_user_id is not null;
alter table idempotency_keys drop constraint idempotency_keys_pkey;
alter table idempotency_keys
    add primary key (workspace_id, end_user_id, operation, idempotency_key);

-- 3. An end user's charges outlive their tasks. ---------------------------------------------

-- What a forgotten task's reservation charged its end user, without anything of the task: kept
-- while it can still be in its workspace's quota window.
create table end_user_charges_kept (
    workspace_id   text        not null,
    end_user_id    text        not null,
    created_at     timestamptz not null,
    tokens_charged bigint      not null check (tokens_charged >= 0)
);
create index end_user_charges_kept_by_user
    on end_user_charges_kept (workspace_id, end_user_id, created_at);

-- V24's count of a user's use of the window, with the charges of their forgotten tasks.
create or replace function replyd_end_user_usage(
    p_workspace text, p_user text, p_since timestamptz, p_pending boolean,
    out generations bigint, out tokens bigint)
language sql stable as $$
    select sum(n)::bigint, sum(t)::bigint from (
        select count(*) as n, coalesce(sum(coalesce(r.tokens_charged, r.token_ceiling)), 0) as t
          from quota_reservations r
         where r.workspace_id = p_workspace and r.end_user_id = p_user
           and r.created_at >= p_since
           and (r.state = 'charged' or (p_pending and r.state = 'reserved'))
        union all
        select count(*), coalesce(sum(k.tokens_charged), 0)
          from end_user_charges_kept k
         where k.workspace_id = p_workspace and k.end_user_id = p_user
           and k.created_at >= p_since) u
$$;

-- V23's forgetting, keeping the charges of end users' reservations that may still count, and
-- letting go of those no window holds any more.
create or replace function replyd_forget(p_tasks uuid[], p_reason text)
returns table (tasks bigint, attempts bigint, messages bigint, charged bigint, released bigint)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    t record;
    v_tasks bigint := 0;
    v_attempts bigint := 0;
    v_messages bigint := 0;
    v_charged bigint := 0;
    v_released bigint := 0;
    v_settled text;
begin
    for t in select r.task_id, r.status, r.provider_may_have_run from reply_tasks r
              where r.task_id = any(p_tasks) order by r.task_id for update loop
        -- Guarded on the reservation being open: a settled one (or none) is left as it is.
        v_settled := replyd_settle_to(
            t.task_id,
            case when t.status = 'running' or t.provider_may_have_run then 'charged'
                 else 'released' end,
            'replyd ' || p_reason, 'task ' || p_reason);
        if v_settled = 'charged' then v_charged := v_charged + 1;
        elsif v_settled = 'released' then v_released := v_released + 1;
        end if;
        update reply_attempts a set outcome = 'abandoned', detail = 'task ' || p_reason,
               finished_at = clock_timestamp()
         where a.task_id = t.task_id and a.outcome is null;
    end loop;
    insert into forgotten_tasks (task_id, workspace_id, reason)
    select r.task_id, r.workspace_id, p_reason from reply_tasks r where r.task_id = any(p_tasks)
    on conflict do nothing;
    delete from reply_attempts a where a.task_id = any(p_tasks);
    get diagnostics v_attempts = row_count;
    delete from quota_decisions d where d.task_id = any(p_tasks);
    insert into end_user_charges_kept (workspace_id, end_user_id, created_at, tokens_charged)
    select q.workspace_id, q.end_user_id, q.created_at, q.tokens_charged
      from quota_reservations q join quota_counters c using (workspace_id)
     where q.task_id = any(p_tasks) and q.end_user_id is not null and q.state = 'charged'
       and q.created_at >= clock_timestamp() - make_interval(secs => c.period_seconds);
    delete from end_user_charges_kept k using quota_counters c
     where k.workspace_id = c.workspace_id
       and k.workspace_id in (select q.workspace_id from quota_reservations q
                               where q.task_id = any(p_tasks))
       and k.created_at < clock_timestamp() - make_interval(secs => c.period_seconds);
    delete from quota_reservations q where q.task_id = any(p_tasks);
    delete from outbox o where o.task_id = any(p_tasks);
    delete from idempotency_keys k where k.task_id = any(p_tasks);
    with gone as (
        delete from reply_tasks r where r.task_id = any(p_tasks)
        returning r.workspace_id, r.conversation_id, r.message_id
    ), counted as (
        select count(*) as n from gone
    ), left_alone as (
        delete from messages m using gone g
         where m.workspace_id = g.workspace_id and m.conversation_id = g.conversation_id
           and m.message_id::text = g.message_id
           and not exists (select 1 from reply_tasks r
                            where r.status in ('completed', 'failed', 'cancelled')
                              and r.workspace_id = g.workspace_id
                              and r.conversation_id = g.conversation_id
                              and r.message_id = g.message_id
                              and not (r.task_id = any(p_tasks)))
           and not exists (select 1 from reply_tasks r
                            where r.status in ('pending', 'running')
                              and r.workspace_id = g.workspace_id
                              and r.conversation_id = g.conversation_id
                              and r.message_id = g.message_id
                              and not (r.task_id = any(p_tasks)))
        returning 1
    )
    select (select n from counted), (select count(*) from left_alone)
      into v_tasks, v_messages;
    return query select v_tasks, v_attempts, v_messages, v_charged, v_released;
end
$$;

-- 4. Sealed, versioned signing keys. --------------------------------------------------------

create table end_user_signing_keys (
    workspace_id text        not null references workspaces,
    -- The token's `kid`: a rotation makes the next version current.
    version      integer     not null check (version > 0),
    -- A 12-byte nonce, then the 32-byte secret sealed with AES-256-GCM under
    -- `api.end_user_token_key`, the workspace and the version bound in as associated data
    -- (a sealed secret moved to another row does not open).
    sealed       bytea       not null,
    created_at   timestamptz not null default clock_timestamp(),
    -- Set by a rotation: tokens it signed verify until then, and no new one is signed with it.
    retire_at    timestamptz,
    primary key (workspace_id, version)
);

delete from end_user_token_secrets;
