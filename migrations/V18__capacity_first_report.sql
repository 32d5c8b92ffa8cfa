-- A provider's first report of its request limit replaces a rate guessed before it. A refusal
-- that reaches the budget before any report (a worker's concurrent calls: one reporting, one
-- refused, each in its own round trip) cuts a rate measured from nothing to the floor
-- (0.5 a second), and the report that followed kept it there as if the provider had cut it:
-- a burst then regrew from one request a second for half a minute. A cut made while a report
-- was known still stands against a later report (`pacing::Learned::reported` is the twin).
--
-- The budget's clock, read through one function: `extract(epoch from clock_timestamp())`, or,
-- when the session sets `replyd.capacity_now` (seconds since the epoch), that instant. Nothing in
-- replyd sets it; `tests/store_functions.rs` does, to hold the learned rate's SQL to its Rust
-- twin (`pacing::Learned`) step by step at chosen instants, which the wall clock cannot give.
create function replyd_capacity_now() returns float8 language sql volatile as $$
    select coalesce(nullif(current_setting('replyd.capacity_now', true), '')::float8,
                    extract(epoch from clock_timestamp()))
$$;

-- The provider reported its request limit: see above.
create or replace function replyd_capacity_reported(p_bucket text, p_requests_per_second float8)
returns void language plpgsql volatile as $$
declare
    v_now float8 := replyd_capacity_now();
    v_rate float8 := greatest(p_requests_per_second, 0.5);
begin
    insert into capacity_buckets (bucket) values (p_bucket) on conflict do nothing;
    update capacity_buckets c
       set reported_rps = v_rate,
           learned_rps = case when c.reported_rps is not null and c.learned_rps < v_rate
                              then c.learned_rps else v_rate end,
           learned_changed_at = case when c.reported_rps is not null and c.learned_rps < v_rate
                                     then c.learned_changed_at else v_now end,
           updated_at = clock_timestamp()
     where c.bucket = p_bucket;
end;
$$;

-- As in V16, with the clock read through `replyd_capacity_now`.
create or replace function replyd_capacity_grant(
    p_bucket text, p_holder text, p_waiters bigint[], p_want_slots integer, p_in_use integer,
    p_requests_per_second float8, p_tokens_per_second float8, p_slot_limit integer,
    p_slot_ttl_secs float8, p_adaptive boolean, p_horizon float8)
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
    v_elapsed float8;
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

    v_rate := coalesce(p_requests_per_second,
                       case when p_adaptive then b.learned_rps end);
    if b.blocked_until is not null and b.blocked_until > v_now then
        return query select '{}'::float8[], v_slots, b.blocked_until - v_now, v_rate,
                            b.blocked_until - v_now;
        return;
    end if;

    select * into p from replyd_pace(b.requests_tat, b.tokens_tat, v_rate, p_tokens_per_second,
                                     v_now, p_horizon,
                                     (coalesce(p_waiters, '{}'::bigint[]))[1:v_schedulable]);

    -- `pacing::Learned::granted`: the one-second windows, and a learned limit regrown by 10 %
    -- (at least one request a second) for every second without a refusal, never past the
    -- reported one.
    if p_adaptive and p_requests_per_second is null then
        if v_now >= b.window_start + 1.0 then
            v_elapsed := v_now - b.window_start;
            b.previous_rate := case when v_elapsed < 2.0 then b.window_granted / v_elapsed
                                    else 0 end;
            b.window_start := v_now;
            b.window_granted := 0;
        end if;
        b.window_granted := b.window_granted + cardinality(p.delays);
        if b.learned_rps is not null and v_now >= b.learned_changed_at + 1.0 then
            b.learned_rps := least(b.learned_rps + greatest(b.learned_rps * 0.1, 1.0),
                                   coalesce(b.reported_rps, 'infinity'::float8));
            b.learned_changed_at := v_now;
        end if;
    end if;

    update capacity_buckets c
       set requests_tat = p.new_requests_tat, tokens_tat = p.new_tokens_tat,
           learned_rps = b.learned_rps, learned_changed_at = b.learned_changed_at,
           window_start = b.window_start, window_granted = b.window_granted,
           previous_rate = b.previous_rate, updated_at = clock_timestamp()
     where c.bucket = p_bucket;
    return query select p.delays, v_slots, p.wait, v_rate, 0::float8;
end;
$$;

-- As in V16, with the clock read through `replyd_capacity_now`.
create or replace function replyd_capacity_refused(p_bucket text, p_pause_secs float8,
                                        p_adaptive boolean)
returns table (requests_per_second float8, blocked_for float8)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    b capacity_buckets;
    v_now float8;
    v_sending float8;
begin
    insert into capacity_buckets (bucket) values (p_bucket) on conflict do nothing;
    select * into b from capacity_buckets c where c.bucket = p_bucket for update;
    v_now := replyd_capacity_now();
    -- Pacing at a limit the provider reported, a refusal is a call that arrived a moment
    -- early: no pause, a gentle cut. Without one, the provider's word is all there is.
    if b.reported_rps is null and p_pause_secs is not null and p_pause_secs > 0 then
        b.blocked_until := greatest(coalesce(b.blocked_until, 0), v_now + p_pause_secs);
    end if;
    if p_adaptive and not (b.learned_rps is not null and v_now < b.learned_changed_at + 1.0) then
        v_sending := coalesce(b.learned_rps,
                              greatest(b.previous_rate,
                                       b.window_granted / greatest(v_now - b.window_start, 1.0)));
        b.learned_rps := greatest(v_sending * case when b.reported_rps is null then 0.7
                                                   else 0.9 end, 0.5);
        b.learned_changed_at := v_now;
    end if;
    update capacity_buckets c
       set blocked_until = b.blocked_until, learned_rps = b.learned_rps,
           learned_changed_at = b.learned_changed_at, refusals = c.refusals + 1,
           updated_at = clock_timestamp()
     where c.bucket = p_bucket;
    return query select b.learned_rps, greatest(coalesce(b.blocked_until, 0) - v_now, 0);
end;
$$;
