-- The provider's capacity, one budget for every worker of a deployment (I9). A bucket per
-- model: its requests and tokens as GCRA schedules (`tat`: the theoretical arrival time of the
-- next unit, seconds since the epoch by the database clock), a pause the provider asked for
-- (`blocked_until`), and, where no request limit is configured, a rate learned from the
-- provider's refusals. Workers take grants ahead (a few requests and their tokens at a time,
-- for the records waiting in that worker), so a call costs no round trip of its own.
--
-- The arithmetic is `capacity::gcra`'s, written again here to run under the bucket's row lock;
-- `tests/store_functions.rs` holds the two together over generated inputs.

create table capacity_buckets (
    bucket             text        primary key,
    requests_tat       float8,
    tokens_tat         float8,
    -- The provider said to wait until then (a 429's Retry-After): no grant before it.
    blocked_until      float8,
    -- The learned rate (requests a second), when no limit is configured; null: none learned.
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

-- `capacity::gcra::grant` (`whole` false): up to `want` units of a bucket whose schedule is
-- at `tat`, at `now`; `capacity::gcra::grant_whole` (`whole` true): all of `want` once the
-- bucket is at rest, or none (one request whose tokens are more than the burst).
create function replyd_gcra(tat float8, now float8, want bigint, per_second float8,
                            burst float8, whole boolean, out granted bigint,
                            out new_tat float8, out wait float8)
language plpgsql immutable as $$
declare
    start float8 := greatest(coalesce(tat, now), now);
    spacing float8 := 1.0 / per_second;
    tolerance float8 := greatest(burst - 1.0, 0.0) * (1.0 / per_second);
    room float8;
    allowed bigint;
begin
    if whole then
        if start <= now then
            granted := want; new_tat := start + want * spacing; wait := 0;
        else
            granted := 0; new_tat := start; wait := start - now;
        end if;
        return;
    end if;
    if want = 0 then
        granted := 0; new_tat := start; wait := 0;
        return;
    end if;
    room := (now + tolerance - start) / spacing;
    if room < -1e-9 then
        allowed := 0;
    else
        allowed := floor(room + 1e-9)::bigint + 1;
    end if;
    granted := least(allowed, want);
    new_tat := start + granted * spacing;
    wait := case when granted = 0 then start - tolerance - now else 0 end;
end;
$$;

-- One grant for `p_holder`: requests and tokens (null rates: not limited; a learned rate
-- applies to requests when `p_adaptive` and none is configured; `p_tokens_whole`: the tokens
-- of one request larger than the burst, all or none), and its share of the
-- bucket's `p_slot_limit` (null: not limited): at most the free slots, and while others wait
-- for a share, no more than a fair one (but never fewer than the `p_in_use` it is using).
create function replyd_capacity_grant(
    p_bucket text, p_holder text, p_want_requests bigint, p_want_tokens bigint,
    p_tokens_whole boolean, p_want_slots integer, p_in_use integer,
    p_requests_per_second float8, p_tokens_per_second float8, p_slot_limit integer,
    p_slot_ttl_secs float8, p_adaptive boolean)
returns table (requests bigint, tokens bigint, slots integer, wait float8,
               requests_per_second float8, blocked_for float8)
language plpgsql volatile as $$
#variable_conflict use_column
declare
    b capacity_buckets;
    v_now float8;
    g record;
    v_rate float8;
    v_requests bigint;
    v_tokens bigint;
    v_wait float8 := 0;
    v_slots integer;
    v_others bigint;
    v_sharing bigint;
    v_starving boolean;
    v_elapsed float8;
begin
    insert into capacity_buckets (bucket) values (p_bucket) on conflict do nothing;
    select * into b from capacity_buckets c where c.bucket = p_bucket for update;
    -- Read with the lock held.
    v_now := extract(epoch from clock_timestamp());

    if p_slot_limit is null then
        v_slots := p_want_slots;
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
    end if;

    v_rate := coalesce(p_requests_per_second,
                       case when p_adaptive then b.learned_rps end);
    if b.blocked_until is not null and b.blocked_until > v_now then
        return query select 0::bigint, 0::bigint, v_slots, b.blocked_until - v_now, v_rate,
                            b.blocked_until - v_now;
        return;
    end if;

    if v_rate is null then
        v_requests := p_want_requests;
    else
        select * into g from replyd_gcra(b.requests_tat, v_now, p_want_requests, v_rate,
                                         greatest(v_rate, 1.0), false);
        v_requests := g.granted;
        b.requests_tat := g.new_tat;
        v_wait := greatest(v_wait, g.wait);
    end if;
    if p_tokens_per_second is null then
        v_tokens := p_want_tokens;
    else
        select * into g from replyd_gcra(b.tokens_tat, v_now, p_want_tokens,
                                         p_tokens_per_second, greatest(p_tokens_per_second, 1.0),
                                         p_tokens_whole);
        v_tokens := g.granted;
        b.tokens_tat := g.new_tat;
        v_wait := greatest(v_wait, g.wait);
    end if;

    -- `gcra::Learned::granted`: the one-second windows, and a learned limit regrown by 5 %
    -- (at least half a request a second) for every second without a refusal.
    if p_adaptive and p_requests_per_second is null then
        if v_now >= b.window_start + 1.0 then
            v_elapsed := v_now - b.window_start;
            b.previous_rate := case when v_elapsed < 2.0 then b.window_granted / v_elapsed
                                    else 0 end;
            b.window_start := v_now;
            b.window_granted := 0;
        end if;
        b.window_granted := b.window_granted + v_requests;
        if b.learned_rps is not null and v_now >= b.learned_changed_at + 1.0 then
            b.learned_rps := b.learned_rps + greatest(b.learned_rps * 0.05, 0.5);
            b.learned_changed_at := v_now;
        end if;
    end if;

    update capacity_buckets c
       set requests_tat = b.requests_tat, tokens_tat = b.tokens_tat,
           learned_rps = b.learned_rps, learned_changed_at = b.learned_changed_at,
           window_start = b.window_start, window_granted = b.window_granted,
           previous_rate = b.previous_rate, updated_at = clock_timestamp()
     where c.bucket = p_bucket;
    return query select v_requests, v_tokens, v_slots, v_wait, v_rate, 0::float8;
end;
$$;

-- The provider refused a call for capacity: every worker pauses until `p_pause_secs` from now
-- (its Retry-After, or when its limit resets), and, when `p_adaptive` and no request limit is
-- configured, the learned rate is cut (`gcra::Learned::refused`: to 70 % of it, or the first
-- time of the rate being sent, at most once a second).
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
    if p_pause_secs is not null and p_pause_secs > 0 then
        b.blocked_until := greatest(coalesce(b.blocked_until, 0), v_now + p_pause_secs);
    end if;
    if p_adaptive and not (b.learned_rps is not null and v_now < b.learned_changed_at + 1.0) then
        v_sending := coalesce(b.learned_rps,
                              greatest(b.previous_rate,
                                       b.window_granted / greatest(v_now - b.window_start, 1.0)));
        b.learned_rps := greatest(v_sending * 0.7, 0.5);
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
