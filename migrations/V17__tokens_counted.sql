-- Tokens counted (I8 unchanged: a reservation is still settled exactly once).
--
-- - Every attempt keeps the usage its provider reported (`prompt_tokens`, `completion_tokens`;
--   both null when none was reported, which is never the same as 0).
-- - A reservation also holds the request's token ceiling (its prompt's bytes, which no
--   tokenizer's tokens outnumber, plus its output ceiling) and, once settled, the tokens it
--   charged: a charged reservation the usage its saved reply reported, or the ceiling when the
--   reply reported none or no reply was saved; a released or expired one none. The counter
--   keeps tokens used in the window and tokens held by open reservations, and a workspace may
--   have a limit in tokens next to its limit in generations.
-- - A workspace may list the models it may ask for and cap `max_output_tokens`.

alter table reply_attempts
    add column prompt_tokens     bigint check (prompt_tokens >= 0),
    add column completion_tokens bigint check (completion_tokens >= 0),
    add constraint reply_attempts_usage_whole
        check ((prompt_tokens is null) = (completion_tokens is null));

alter table workspaces
    -- Null: any model. Otherwise the models a request may name (or the default resolve to).
    add column allowed_models    text[] check (cardinality(allowed_models) > 0),
    -- Null: no cap beyond the API's own bound.
    add column max_output_tokens integer check (max_output_tokens > 0);

alter table quota_counters
    add column token_limit     bigint check (token_limit >= 0),
    add column tokens_used     bigint not null default 0 check (tokens_used >= 0),
    add column tokens_reserved bigint not null default 0 check (tokens_reserved >= 0);

alter table quota_reservations
    add column token_ceiling  bigint not null default 0 check (token_ceiling >= 0),
    add column tokens_charged bigint check (tokens_charged >= 0);

-- Reservations settled before tokens were counted charged none.
update quota_reservations set tokens_charged = 0 where state <> 'reserved';

alter table quota_reservations add constraint quota_reservations_tokens_once
    check ((state = 'reserved') = (tokens_charged is null));

-- The usage a generation's meta reports (`Generation` as JSON: `usage` is null or
-- `{prompt_tokens, completion_tokens}`), null when it reports none.
create function replyd_reported_tokens(meta jsonb, part text) returns bigint
language sql immutable as $$
    select case when jsonb_typeof(meta -> 'usage' -> part) = 'number'
                then (meta -> 'usage' ->> part)::bigint end
$$;

-- A completion's usage goes on its attempt, in the transaction that saves the reply, whichever
-- path saved it (`replyd_complete`, `replyd_complete_many`). Named to fire before
-- `reply_tasks_settle_reservation` (triggers of one event fire in name order), which reads it.
create function replyd_record_usage() returns trigger language plpgsql as $$
begin
    if new.status = 'completed' and old.status is distinct from 'completed' then
        update reply_attempts a
           set prompt_tokens = replyd_reported_tokens(new.response_meta, 'prompt_tokens'),
               completion_tokens = replyd_reported_tokens(new.response_meta, 'completion_tokens')
         where a.task_id = new.task_id and a.assignment_version = new.assignment_version
           and replyd_reported_tokens(new.response_meta, 'prompt_tokens') is not null
           and replyd_reported_tokens(new.response_meta, 'completion_tokens') is not null;
    end if;
    return new;
end;
$$;

create trigger reply_tasks_record_usage after update of status on reply_tasks
    for each row execute function replyd_record_usage();

-- What a settlement to `target` charges in tokens (`quota::tokens_to_charge` is its twin):
-- charged, the saved reply's reported usage, else the ceiling; otherwise none.
create function replyd_tokens_to_charge(id uuid, target text, ceiling bigint) returns bigint
language sql stable as $$
    select case when target <> 'charged' then 0
                else coalesce(
                    (select a.prompt_tokens + a.completion_tokens
                       from reply_tasks t
                       join reply_attempts a on a.task_id = t.task_id
                                            and a.assignment_version = t.assignment_version
                      -- The completed task's current assignment is the attempt that saved the
                      -- reply (its outcome may be written later in the same transaction).
                      where t.task_id = id and t.status = 'completed'
                        and a.prompt_tokens is not null),
                    ceiling) end
$$;

-- As in V13, with tokens: the guarded update still decides whether this call settles, and the
-- counter moves by the generation and the tokens of that one settlement.
create or replace function replyd_settle_to(id uuid, target text, by_whom text, why text)
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
           tokens_charged = replyd_tokens_to_charge(id, target, r.token_ceiling)
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
