-- A provider's first report of its request limit replaces a rate guessed before it. A refusal
-- that reaches the budget before any report (a worker's concurrent calls: one reporting, one
-- refused, each in its own round trip) cuts a rate measured from nothing to the floor
-- (0.5 a second), and the report that followed kept it there as if the provider had cut it:
-- a burst then regrew from one request a second for half a minute. A cut made while a report
-- was known still stands against a later report (`pacing::Learned::reported` is the twin).
create or replace function replyd_capacity_reported(p_bucket text, p_requests_per_second float8)
returns void language plpgsql volatile as $$
declare
    v_now float8 := extract(epoch from clock_timestamp());
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
