-- Fair shares between workspaces (I10).
--
-- A workspace's weight: its share of the provider's capacity and of each worker's windows
-- while other workspaces wait too (a workspace of weight 2 gets twice the calls of one of
-- weight 1). Default 1: every workspace alike. Set with `replyd workspace share`.
--
-- The budget's grants across workers by workspace: each worker tells a grant how many calls
-- of each workspace wait in it (`capacity_demand`, renewed with its grants, lapsing with its
-- share of the slots). Where a rate applies and other workers' calls wait too, a worker may
-- take no more of the rate than its fair part: the sum, over the workspaces waiting in it, of
-- each workspace's weighted share of the rate times the part of that workspace's waiting calls
-- that wait in this worker. The part is a credit (`capacity_credits`) that fills at that rate
-- and holds at most a horizon of it: a worker that asks often gets no more than one that asks
-- seldom, and the parts of all workers add up to the rate, so no capacity stays idle while
-- calls wait. Alone (every waiting call is in this worker), a worker's part is the whole rate.
--
-- Expand only: a previous release's grants (without the demand) keep their signatures, are not
-- held to a part, and count in nobody's.

alter table workspaces
    add column weight integer not null default 1 check (weight between 1 and 1000);

-- Why an attempt's call waited (`replyd inspect`): how long it waited for the provider's
-- capacity, and what waited in its worker when it joined the queue. Written only for waits of
-- a second or more, by one statement of their own: a call that does not wait costs none.
alter table reply_attempts
    add column capacity_wait_ms     integer check (capacity_wait_ms >= 0),
    add column capacity_calls_ahead integer check (capacity_calls_ahead >= 0),
    add column capacity_own_ahead   integer check (capacity_own_ahead >= 0),
    add column capacity_workspaces  integer check (capacity_workspaces >= 0);

create table capacity_demand (
    bucket       text        not null,
    holder       text        not null,
    workspace_id text        not null,
    waiting      integer     not null check (waiting > 0),
    expires_at   timestamptz not null,
    primary key (bucket, holder, workspace_id)
);

create table capacity_credits (
    bucket     text        not null,
    holder     text        not null,
    credit     float8      not null,
    at         float8      not null,
    expires_at timestamptz not null,
    primary key (bucket, holder)
);

-- `p_holder`'s demand recorded, and its part of the rate (0 to 1) among every worker's. Called
-- with the bucket's row locked, so the demand it reads is every worker's latest.
create function replyd_capacity_part(
    p_bucket text, p_holder text, p_workspaces text[], p_waiting integer[], p_ttl_secs float8)
returns float8 language plpgsql volatile as $$
declare
    v_part float8;
begin
    delete from capacity_demand d
     where d.bucket = p_bucket and (d.holder = p_holder or d.expires_at <= clock_timestamp());
    insert into capacity_demand (bucket, holder, workspace_id, waiting, expires_at)
    select p_bucket, p_holder, w.workspace_id, w.waiting,
           clock_timestamp() + make_interval(secs => p_ttl_secs)
      from unnest(p_workspaces, p_waiting) as w (workspace_id, waiting)
     where w.waiting > 0 and w.workspace_id is not null
    on conflict (bucket, holder, workspace_id)
       do update set waiting = capacity_demand.waiting + excluded.waiting;
    with by_workspace as (
        select d.workspace_id, sum(d.waiting)::float8 as total,
               sum(d.waiting) filter (where d.holder = p_holder)::float8 as mine,
               coalesce(max(ws.weight), 1)::float8 as weight
          from capacity_demand d
          left join workspaces ws on ws.workspace_id = d.workspace_id
         where d.bucket = p_bucket
         group by d.workspace_id)
    select sum(weight * coalesce(mine, 0) / total) / nullif(sum(weight), 0)
      into v_part
      from by_workspace;
    return coalesce(v_part, 1.0);
end;
$$;

-- One grant, as in V31, with the worker's waiting calls by workspace (`p_demand_workspaces`,
-- `p_demand_waiting`): where a rate applies, it schedules no more of them than the worker's
-- credit holds (see above); when the credit holds none, `wait` is until it holds one.
create function replyd_capacity_grant(
    p_bucket text, p_holder text, p_waiters bigint[], p_want_slots integer, p_in_use integer,
    p_requests_per_second float8, p_tokens_per_second float8, p_slot_limit integer,
    p_slot_ttl_secs float8, p_adaptive boolean, p_horizon float8, p_sent_freely bigint,
    p_demand_workspaces text[], p_demand_waiting integer[])
returns table (delays float8[], slots integer, wait float8, requests_per_second float8,
               blocked_for float8)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    b capacity_buckets;
    v_now float8;
    p record;
    v_rate float8;
    v_slots integer;
    v_others bigint;
    v_sharing bigint;
    v_starving boolean;
    v_schedulable integer;
    v_learning boolean := p_adaptive and p_requests_per_second is null;
    v_part float8 := 1.0;
    v_credit float8;
    v_credit_at float8;
    v_credit_wait float8 := 0;
begin
    insert into capacity_buckets (bucket) values (p_bucket) on conflict do nothing;
    select * into b from capacity_buckets c where c.bucket = p_bucket for update;
    -- Read with the lock held.
    v_now := replyd_capacity_now();

    if p_slot_limit is null then
        v_slots := p_want_slots;
        v_schedulable := cardinality(coalesce(p_waiters, '{}'::bigint[]));
    else
        delete from capacity_holders h
         where h.bucket = p_bucket and h.expires_at <= clock_timestamp();
        select coalesce(sum(h.slots), 0), count(*) filter (where h.wanted > 0),
               coalesce(bool_or(h.wanted > h.slots), false)
          into v_others, v_sharing, v_starving
          from capacity_holders h where h.bucket = p_bucket and h.holder <> p_holder;
        v_sharing := v_sharing + case when p_want_slots > 0 then 1 else 0 end;
        v_slots := least(p_want_slots, greatest(p_slot_limit - v_others, 0));
        if v_starving then
            v_slots := least(v_slots,
                             greatest(p_in_use, p_slot_limit / greatest(v_sharing, 1)));
        end if;
        if v_slots = 0 and p_want_slots = 0 then
            delete from capacity_holders h where h.bucket = p_bucket and h.holder = p_holder;
        else
            insert into capacity_holders (bucket, holder, slots, wanted, expires_at)
            values (p_bucket, p_holder, v_slots, p_want_slots,
                    clock_timestamp() + make_interval(secs => p_slot_ttl_secs))
            on conflict (bucket, holder) do update
               set slots = excluded.slots, wanted = excluded.wanted,
                   expires_at = excluded.expires_at;
        end if;
        v_schedulable := greatest(v_slots - p_in_use, 0);
    end if;

    -- The calls let go freely went whatever the budget says now: counted before the pause.
    if v_learning then
        b := replyd_capacity_learned_sent(b, v_now, greatest(coalesce(p_sent_freely, 0), 0));
    end if;

    v_rate := coalesce(p_requests_per_second,
                       case when p_adaptive then b.learned_rps end);
    if b.blocked_until is not null and b.blocked_until > v_now then
        update capacity_buckets c
           set window_start = b.window_start, window_granted = b.window_granted,
               window_refused = b.window_refused, previous_rate = b.previous_rate,
               previous_refused_rate = b.previous_refused_rate, updated_at = clock_timestamp()
         where c.bucket = p_bucket;
        return query select '{}'::float8[], v_slots, b.blocked_until - v_now, v_rate,
                            b.blocked_until - v_now;
        return;
    end if;

    -- The worker's part of the rate, and the credit it has of it.
    if v_rate is not null and p_demand_workspaces is not null then
        v_part := replyd_capacity_part(p_bucket, p_holder, p_demand_workspaces,
                                       p_demand_waiting, p_slot_ttl_secs);
        delete from capacity_credits c
         where c.bucket = p_bucket and c.expires_at <= clock_timestamp();
        if v_part < 1.0 then
            select c.credit, c.at into v_credit, v_credit_at
              from capacity_credits c where c.bucket = p_bucket and c.holder = p_holder;
            v_credit := least(coalesce(v_credit + (v_now - v_credit_at) * v_part * v_rate,
                                       'infinity'::float8),
                              greatest(v_part * v_rate * p_horizon, 1.0));
            v_schedulable := least(v_schedulable, greatest(floor(v_credit)::integer, 0));
            if v_schedulable = 0 and v_part > 0 then
                v_credit_wait := (1.0 - v_credit) / (v_part * v_rate);
            end if;
        end if;
    end if;

    select * into p from replyd_pace(b.requests_tat, b.tokens_tat, v_rate, p_tokens_per_second,
                                     v_now, p_horizon,
                                     (coalesce(p_waiters, '{}'::bigint[]))[1:v_schedulable]);

    if v_learning then
        b := replyd_capacity_learned_granted(b, v_now, cardinality(p.delays));
    end if;

    if v_credit is not null then
        insert into capacity_credits (bucket, holder, credit, at, expires_at)
        values (p_bucket, p_holder, v_credit - cardinality(p.delays), v_now,
                clock_timestamp() + make_interval(secs => p_slot_ttl_secs))
        on conflict (bucket, holder) do update
           set credit = excluded.credit, at = excluded.at, expires_at = excluded.expires_at;
    elsif p_demand_workspaces is not null then
        -- Alone, or unlimited: whatever credit it had is no longer owed.
        delete from capacity_credits c where c.bucket = p_bucket and c.holder = p_holder;
    end if;

    update capacity_buckets c
       set requests_tat = p.new_requests_tat, tokens_tat = p.new_tokens_tat,
           learned_rps = b.learned_rps, learned_changed_at = b.learned_changed_at,
           window_start = b.window_start, window_granted = b.window_granted,
           window_refused = b.window_refused, previous_rate = b.previous_rate,
           previous_refused_rate = b.previous_refused_rate, updated_at = clock_timestamp()
     where c.bucket = p_bucket;
    return query select p.delays, v_slots, greatest(p.wait, v_credit_wait), v_rate, 0::float8;
end;
$$;

-- V31's grant (a previous release's): as above, with no demand told.
create or replace function replyd_capacity_grant(
    p_bucket text, p_holder text, p_waiters bigint[], p_want_slots integer, p_in_use integer,
    p_requests_per_second float8, p_tokens_per_second float8, p_slot_limit integer,
    p_slot_ttl_secs float8, p_adaptive boolean, p_horizon float8, p_sent_freely bigint)
returns table (delays float8[], slots integer, wait float8, requests_per_second float8,
               blocked_for float8)
language sql volatile as $$
    select * from replyd_capacity_grant(p_bucket, p_holder, p_waiters, p_want_slots, p_in_use,
                                        p_requests_per_second, p_tokens_per_second,
                                        p_slot_limit, p_slot_ttl_secs, p_adaptive, p_horizon,
                                        p_sent_freely, null::text[], null::integer[])
$$;
