-- A workspace's rules for the system turn (`replyd workspace policy --system-prompt …
-- --end-user-context allow|deny`; `replyd_core::prompt_policy`). Additive: a release before
-- this one reads and writes workspaces as it did, and its requests are judged as before.
--
-- - `system_prompt`: the system turn every task of the workspace is asked with, written into
--   the task's request when it is created (so a retry or replay asks with the prompt it was
--   made with); null: none. Bounded as the operator's command bounds it (32 KiB).
-- - `end_user_context_allowed`: whether an end user's token may send `context`; false (the
--   default, also for every workspace made before) refuses it with a 422. The workspace's key
--   may always send it.
alter table workspaces
    add column system_prompt text
        check (btrim(system_prompt) <> '' and octet_length(system_prompt) <= 32768),
    add column end_user_context_allowed boolean not null default false;
