-- `reply_attempts.outcome` takes the outcomes `AttemptOutcome` has, and no other. V1 listed
-- `failed` ("the task failed for good in this attempt"), which no version of replyd wrote: an
-- attempt that fails its task records why (`provider_error`, `timeout`, `ambiguous`,
-- `refused`). A row with it could not be read (`replyd inspect` would fail on "unknown attempt
-- outcome"). `tests/store_functions.rs` holds each `CHECK` list to its Rust enum.
alter table reply_attempts drop constraint reply_attempts_outcome_check;
alter table reply_attempts add constraint reply_attempts_outcome_check
    check (outcome in ('accepted', 'fenced', 'abandoned', 'provider_error', 'timeout',
                       'ambiguous', 'refused'));
