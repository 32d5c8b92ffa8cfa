-- The learned rate (where no limit is configured) is cut to what got through, and climbs back.
-- A refusal with no reported limit cut the rate to 70 % of itself, or, the first time, of what
-- had been granted; calls a worker let go freely before any limit was known were never counted,
-- so the first cut was measured from nothing, and every later overload cut 30 % more, while the
-- regrowth (10 % a second, counted from the last change) was itself what held the next cut
-- off. Against a provider that reports no limit (Azure deployments, gateways: a 429 and its
-- `retry-after` are all it says), a burst worked at about 60 % of the limit with a third of its
-- calls refused. Now (`pacing::Learned`, the twin of these functions):
--   * every call that went counts: granted ones, and those a worker let go freely, which it
--     tells with its next grant or refusal (`p_sent_freely`);
--   * refusals count too, in the same one-second windows;
--   * a refusal with no reported limit cuts the rate to 95 % of what got through in the last
--     second (the calls that went less those refused: the provider's limit as it stands), at
--     most once a second after the previous cut (`cut_at`, which regrowth does not move);
--   * each second with no refusal (`refused_at`) doubles the rate back towards what got through
--     before the cut (`good_rps`), then probes up by 10 % a second (at least one request);
--   * a reported limit is still the rate and the ceiling, and a refusal cuts it by 10 %.
--
-- Expand only: the columns are added with defaults, and the functions a previous release calls
-- keep their signatures (its grants and refusals are counted, with no calls sent freely); this
-- release calls the new overloads with `p_sent_freely`.

alter table capacity_buckets
    -- When a cut (or a report) last set the learned rate, and the last refusal.
    add column cut_at                float8 not null default 0,
    add column refused_at            float8 not null default 0,
    -- What got through in the second before the last cut: regrowth doubles back to it.
    add column good_rps              float8 not null default 0,
    -- Refusals in the current one-second window and the rate of the one before (the calls that
    -- went are `window_granted` and `previous_rate`).
    add column window_refused        bigint not null default 0 check (window_refused >= 0),
    add column previous_refused_rate float8 not null default 0;

-- `pacing::Window::rolled` and `Learned::sent`: at `p_now`, a window a second old or more
-- becomes the previous one, as rates (none, when it was left two seconds ago or more); then
-- `p_calls` that went are counted in it.
create function replyd_capacity_learned_sent(b capacity_buckets, p_now float8, p_calls bigint)
returns capacity_buckets language plpgsql immutable as $$
declare
    v_elapsed float8;
begin
    if p_now >= b.window_start + 1.0 then
        v_elapsed := p_now - b.window_start;
        b.previous_rate := case when v_elapsed < 2.0 then b.window_granted / v_elapsed
                                else 0 end;
        b.previous_refused_rate := case when v_elapsed < 2.0 then b.window_refused / v_elapsed
                                        else 0 end;
        b.window_start := p_now;
        b.window_granted := 0;
        b.window_refused := 0;
    end if;
    b.window_granted := b.window_granted + p_calls;
    return b;
end;
$$;

-- `pacing::Learned::granted`: `p_granted` calls counted, and, a second after the rate last
-- moved and a second after the last refusal, the learned rate regrown: doubled up to what got
-- through before the last cut, past it by 10 % (at least one request a second); never past
-- the reported limit.
create function replyd_capacity_learned_granted(b capacity_buckets, p_now float8, p_granted bigint)
returns capacity_buckets language plpgsql immutable as $$
declare
    v_rate float8 := b.learned_rps;
    v_ceiling float8 := coalesce(b.reported_rps, 'infinity'::float8);
    v_back_to float8;
begin
    b := replyd_capacity_learned_sent(b, p_now, p_granted);
    if v_rate is null or p_now < b.learned_changed_at + 1.0 or p_now < b.refused_at + 1.0 then
        return b;
    end if;
    v_back_to := least(b.good_rps, v_ceiling);
    b.learned_rps := case when v_rate < v_back_to then least(v_rate * 2.0, v_back_to)
                          else least(v_rate + greatest(v_rate * 0.1, 1.0), v_ceiling) end;
    b.learned_changed_at := p_now;
    return b;
end;
$$;

-- `pacing::Learned::refused`: the refusal counted, and the learned rate cut, at most once a
-- second after the last cut (one overload answers many calls in flight at once): with a
-- reported limit to 90 % of it; without one to 95 % of what got through in the last second
-- (this window's calls, and the previous one's at its rate over the part of the second before
-- this one began; those that went less those refused), never above the rate it had, and what
-- got through is what regrowth doubles back to. Never below 0.5 a second.
create function replyd_capacity_learned_refused(b capacity_buckets, p_now float8)
returns capacity_buckets language plpgsql immutable as $$
declare
    v_rate float8 := b.learned_rps;
    v_before float8;
    v_through float8;
begin
    b := replyd_capacity_learned_sent(b, p_now, 0);
    b.window_refused := b.window_refused + 1;
    b.refused_at := p_now;
    if v_rate is not null and p_now < b.cut_at + 1.0 then
        return b;
    end if;
    v_before := least(greatest(1.0 - (p_now - b.window_start), 0.0), 1.0);
    v_through := greatest((b.window_granted + b.previous_rate * v_before)
                          - (b.window_refused + b.previous_refused_rate * v_before), 0.0);
    v_rate := coalesce(v_rate, 'infinity'::float8);
    b.learned_rps := greatest(
        case when b.reported_rps is not null and b.learned_rps is not null then v_rate * 0.9
             else least(v_through * 0.95, v_rate) end,
        0.5);
    b.learned_changed_at := p_now;
    b.cut_at := p_now;
    b.good_rps := least(v_through, v_rate);
    return b;
end;
$$;

-- One grant, as in V18, and the calls this worker let go freely since its last grant or
-- refusal (`p_sent_freely`) counted as calls that went, even while a pause grants nothing.
create function replyd_capacity_grant(
    p_bucket text, p_holder text, p_waiters bigint[], p_want_slots integer, p_in_use integer,
    p_requests_per_second float8, p_tokens_per_second float8, p_slot_limit integer,
    p_slot_ttl_secs float8, p_adaptive boolean, p_horizon float8, p_sent_freely bigint)
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

    select * into p from replyd_pace(b.requests_tat, b.tokens_tat, v_rate, p_tokens_per_second,
                                     v_now, p_horizon,
                                     (coalesce(p_waiters, '{}'::bigint[]))[1:v_schedulable]);

    if v_learning then
        b := replyd_capacity_learned_granted(b, v_now, cardinality(p.delays));
    end if;

    update capacity_buckets c
       set requests_tat = p.new_requests_tat, tokens_tat = p.new_tokens_tat,
           learned_rps = b.learned_rps, learned_changed_at = b.learned_changed_at,
           window_start = b.window_start, window_granted = b.window_granted,
           window_refused = b.window_refused, previous_rate = b.previous_rate,
           previous_refused_rate = b.previous_refused_rate, updated_at = clock_timestamp()
     where c.bucket = p_bucket;
    return query select p.delays, v_slots, p.wait, v_rate, 0::float8;
end;
$$;

-- A previous release's grant: as above, with no calls sent freely.
create or replace function replyd_capacity_grant(
    p_bucket text, p_holder text, p_waiters bigint[], p_want_slots integer, p_in_use integer,
    p_requests_per_second float8, p_tokens_per_second float8, p_slot_limit integer,
    p_slot_ttl_secs float8, p_adaptive boolean, p_horizon float8)
returns table (delays float8[], slots integer, wait float8, requests_per_second float8,
               blocked_for float8)
language sql volatile as $$
    select * from replyd_capacity_grant(p_bucket, p_holder, p_waiters, p_want_slots, p_in_use,
                                        p_requests_per_second, p_tokens_per_second,
                                        p_slot_limit, p_slot_ttl_secs, p_adaptive, p_horizon,
                                        0::bigint)
$$;

-- The provider refused a call for capacity, as in V18 (the pause unchanged), with the calls
-- this worker let go freely since its last grant or refusal (`p_sent_freely`) counted first,
-- so that a first refusal cuts from what was sent; with `p_adaptive`, the learned rate moves
-- as `replyd_capacity_learned_refused` says.
create function replyd_capacity_refused(p_bucket text, p_pause_secs float8,
                                        p_adaptive boolean, p_sent_freely bigint)
returns table (requests_per_second float8, blocked_for float8)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    b capacity_buckets;
    v_now float8;
begin
    insert into capacity_buckets (bucket) values (p_bucket) on conflict do nothing;
    select * into b from capacity_buckets c where c.bucket = p_bucket for update;
    v_now := replyd_capacity_now();
    -- Pacing at a limit the provider reported, a refusal is a call that arrived a moment
    -- early: no pause, a gentle cut. Without one, the provider's word is all there is.
    if b.reported_rps is null and p_pause_secs is not null and p_pause_secs > 0 then
        b.blocked_until := greatest(coalesce(b.blocked_until, 0), v_now + p_pause_secs);
    end if;
    if p_adaptive then
        b := replyd_capacity_learned_sent(b, v_now, greatest(coalesce(p_sent_freely, 0), 0));
        b := replyd_capacity_learned_refused(b, v_now);
    end if;
    update capacity_buckets c
       set blocked_until = b.blocked_until, learned_rps = b.learned_rps,
           learned_changed_at = b.learned_changed_at, cut_at = b.cut_at,
           refused_at = b.refused_at, good_rps = b.good_rps, window_start = b.window_start,
           window_granted = b.window_granted, window_refused = b.window_refused,
           previous_rate = b.previous_rate, previous_refused_rate = b.previous_refused_rate,
           refusals = c.refusals + 1, updated_at = clock_timestamp()
     where c.bucket = p_bucket;
    return query select b.learned_rps, greatest(coalesce(b.blocked_until, 0) - v_now, 0);
end;
$$;

-- A previous release's refusal: as above, with no calls sent freely.
create or replace function replyd_capacity_refused(p_bucket text, p_pause_secs float8,
                                                   p_adaptive boolean)
returns table (requests_per_second float8, blocked_for float8)
language sql volatile as $$
    select * from replyd_capacity_refused(p_bucket, p_pause_secs, p_adaptive, 0::bigint)
$$;

-- The provider reported its request limit (`pacing::Learned::reported`), as in V18: the
-- learned rate is that, unless a refusal has cut below an earlier report since; a report that
-- sets the rate also holds the next cut off for a second, as a cut does (the calls in flight
-- were sent before it).
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
           cut_at = case when c.reported_rps is not null and c.learned_rps < v_rate
                         then c.cut_at else v_now end,
           updated_at = clock_timestamp()
     where c.bucket = p_bucket;
end;
$$;
