-- A key's expiry and its last use (`replyd api-key create --expires-in-days`, `replyd api-key
-- list`). A key past its expiry authenticates no more, as a revoked one, and the end-user
-- tokens it asked for die with it; its last use is written by the API at most once a minute
-- per key and process, off the request's path.
--
-- Expand only: a process of the release before neither sets nor checks either column (a key
-- with an expiry keeps working on it until the rollout is done).

alter table api_keys
    add column expires_at   timestamptz,
    add column last_used_at timestamptz;
