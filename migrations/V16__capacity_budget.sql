-- The provider's capacity, one budget for every worker of a deployment (I9). A bucket per
-- model: its requests and tokens as paced schedules (`tat`: the theoretical arrival time of
-- the next unit, seconds since the epoch by the database clock), a pause the provider asked
-- for (`blocked_until`), and, where no request limit is configured, a rate learned from the
-- provider's refusals. Workers take their schedule ahead (the send times of the calls waiting
-- in that worker, a quarter of a second at most), so a call costs no round trip of its own.
--
-- The arithmetic is `capacity::pacing`'s, written again here to run under the bucket's row
-- lock; `tests/store_functions.rs` holds the two together over generated inputs.

create table capacity_buckets (
    bucket             text        primary key,
    requests_tat       float8,
    tokens_tat         float8,
    -- The provider said to wait until then (a 429's Retry-After): no grant before it.
    blocked_until      float8,
    -- The provider's reported limit (its rate-limit headers), as requests a second, and the
    -- rate learned from it and from refusals, when no limit is configured; null: none.
    reported_rps       float8,
    learned_rps        float8,
    learned_changed_at float8      not null default 0,
    -- Requests granted in the current one-second window and the rate of the one before.
    window_start       float8      not null default 0,
    window_granted     bigint      not null default 0 check (window_granted >= 0),
    previous_rate      float8      not null default 0,
    -- Refusals for capacity the provider answered, for the operator.
    refusals           bigint      not null default 0,
    updated_at         timestamptz not null default clock_timestamp()
);

-- Each worker's share of a bucket's `max_concurrent`: the slots it holds (in use or about to
-- be) and wants, renewed while it works; a worker that vanished gives them back at
-- `expires_at`.
create table capacity_holders (
    bucket     text        not null,
    holder     text        not null,
    slots      integer     not null check (slots >= 0),
    wanted     integer     not null check (wanted >= 0),
    expires_at timestamptz not null,
    primary key (bucket, holder)
);

-- `capacity::pacing::schedule`: when each of `waiters` (a call's tokens each, in arrival
-- order) may go, from the bucket's schedules at `now`: when both its request and its tokens
-- are due, none past `now + horizon`; each schedule moves on from when its call goes. Null
-- rates are no limit. Returns the delays of the granted calls and the schedules after them.
create function replyd_pace(requests_tat float8, tokens_tat float8, requests_per_second float8,
                            tokens_per_second float8, now float8, horizon float8,
                            waiters bigint[], out delays float8[], out new_requests_tat float8,
                            out new_tokens_tat float8, out wait float8)
language plpgsql immutable as $$
declare
    tokens bigint;
    at float8;
begin
    delays := '{}';
    new_requests_tat := requests_tat;
    new_tokens_tat := tokens_tat;
    wait := 0;
    foreach tokens in array coalesce(waiters, '{}'::bigint[]) loop
        at := greatest(
            case when requests_per_second is null then now
                 else greatest(coalesce(new_requests_tat, now), now) end,
            case when tokens_per_second is null then now
                 else greatest(coalesce(new_tokens_tat, now), now) end);
        if at > now + horizon then
            if cardinality(delays) = 0 then
                wait := at - horizon - now;
            end if;
            exit;
        end if;
        if requests_per_second is not null then
            new_requests_tat := at + 1.0 / requests_per_second;
        end if;
        if tokens_per_second is not null then
            new_tokens_tat := at + tokens / tokens_per_second;
        end if;
        delays := delays || (at - now);
    end loop;
end;
$$;

-- One grant for `p_holder`: its share of the bucket's `p_slot_limit` (null: not limited): at
-- most the free slots, and while others wait for a share, no more than a fair one (but never
-- fewer than the `p_in_use` it is using); then the send times of as many of its `p_waiters`
-- (their tokens, in order) as its free slots allow (`replyd_pace`). Null rates: not limited;
-- a learned rate applies to requests when `p_adaptive` and none is configured. A pause the
-- provider asked for grants nothing until it ends.
create function replyd_capacity_grant(
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
    v_now := extract(epoch from clock_timestamp());

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

-- The provider refused a call for capacity, where no limit is configured: unless the provider
-- reported its limit (the deployment paces at it, and a refusal is a call a moment early), every
-- worker pauses until `p_pause_secs` from now (its Retry-After, or when its limit resets); and
-- with `p_adaptive` the learned rate is cut (`pacing::Learned::refused`: to 90 % of it with a
-- reported limit, else to 70 % of it or, the first time, of the rate being sent; at most once a
-- second).
create function replyd_capacity_refused(p_bucket text, p_pause_secs float8,
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
    v_now := extract(epoch from clock_timestamp());
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

-- The provider reported its request limit (`pacing::Learned::reported`): the learned rate is
-- that, unless a refusal has cut below it since (then the regrowth stops there).
create function replyd_capacity_reported(p_bucket text, p_requests_per_second float8)
returns void language plpgsql volatile as $$
declare
    v_now float8 := extract(epoch from clock_timestamp());
    v_rate float8 := greatest(p_requests_per_second, 0.5);
begin
    insert into capacity_buckets (bucket) values (p_bucket) on conflict do nothing;
    update capacity_buckets c
       set reported_rps = v_rate,
           learned_rps = case when c.learned_rps < v_rate then c.learned_rps else v_rate end,
           learned_changed_at = case when c.learned_rps < v_rate then c.learned_changed_at
                                     else v_now end,
           updated_at = clock_timestamp()
     where c.bucket = p_bucket;
end;
$$;
