-- The retry budget lives in the task row (I7), next to max_attempts and deadline, so a
-- redelivery, a restart or a takeover continues the same budget instead of resetting it:
--   next_attempt_at   no claim before this instant (backoff, or the provider's Retry-After)
--   last_error_class  what the last attempt's failure was (decides e.g. "malformed twice")
--   last_error        its message, for operators
alter table reply_tasks
    add column next_attempt_at  timestamptz,
    add column last_error_class text,
    add column last_error       text;
