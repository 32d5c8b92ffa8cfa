-- Quota periods bounded, and counters put on the epoch-aligned window of their period.
--
-- The longest period is 3650 days (`quota::MAX_PERIOD_SECONDS` says why): a longer one
-- overflows PostgreSQL's timestamps in the window arithmetic, and every admission and read of
-- its workspace fails with "timestamp out of range". `replyd quota set` refuses it; this
-- CHECK holds every other writer to it. A counter set past it before the bound existed is
-- brought down to it, the nearest period that works.

-- The epoch-aligned window of `period_seconds` that holds `at` (a 1-day period starts at
-- 00:00 UTC): where a period change puts the counter.
create function replyd_quota_window_of(period_seconds bigint, at timestamptz)
returns timestamptz language sql stable as $$
    select to_timestamp(floor(extract(epoch from at) / period_seconds) * period_seconds)
$$;

-- A workspace's settled reservations by settlement time: its latest settle times (what a
-- refusal's Retry-After is estimated from) and its charges in a window (what a period change
-- recounts) are each one short scan. Expired reservations are left out: they only say the TTL.
-- Built in the migration's transaction (refinery runs each in one, so not CONCURRENTLY):
-- admissions and settlements wait for one pass over the table.
create index quota_reservations_settled on quota_reservations (workspace_id, settled_at)
    where state in ('charged', 'released');

-- A period change used to keep the old window: a counter may sit on a window of another
-- period (10s then 1d: a day starting at the change) or have lost the current window's
-- charges (1d then 1h: the hour read as empty). Every counter is put on its period's
-- epoch-aligned window that holds now, with `used` recounted from the ledger, as
-- `Store::set_quota` does on a period change (it says why the recount is exact). The table
-- lock keeps admissions and settlements out until this migration commits; the recount, a
-- later statement, reads everything committed before the lock was granted.
lock table quota_counters in share row exclusive mode;

update quota_counters q
   set period_seconds = w.period_seconds,
       window_start = w.start,
       used = (select count(*) from quota_reservations r
                where r.workspace_id = q.workspace_id and r.state = 'charged'
                  and r.settled_at >= w.start),
       updated_at = clock_timestamp()
  from (select workspace_id, least(period_seconds, 315360000) as period_seconds,
               replyd_quota_window_of(least(period_seconds, 315360000), clock_timestamp()) as start
          from quota_counters) w
 where w.workspace_id = q.workspace_id;

alter table quota_counters add constraint quota_counters_period_bound
    check (period_seconds <= 315360000);
