-- End users: the product's users, who call the API from their browsers with short-lived
-- tokens instead of the workspace's key (`replyd_core::end_user`).
--
-- Each workspace signs its users' tokens with its own secret, made when its first token is
-- asked for; it is needed in the clear to sign, and it leaves the database only to sign and
-- verify. A user's `generation` is written into each token; a revocation moves it on, and
-- every token issued before no longer verifies.

create table end_user_token_secrets (
    workspace_id text        primary key references workspaces,
    -- base64url of 32 random bytes.
    secret       text        not null,
    created_at   timestamptz not null default clock_timestamp()
);

create table end_users (
    workspace_id text        not null references workspaces,
    user_id      text        not null,
    generation   bigint      not null default 0 check (generation >= 0),
    revoked_at   timestamptz,
    primary key (workspace_id, user_id)
);

-- The end user a conversation belongs to: the user whose token wrote its first message. A
-- conversation begun with the workspace's key belongs to no end user, and no token sees it.
alter table conversations add column end_user_id text;

-- An end user's conversation is claimed (its row made, with no message yet, number 0) in the
-- transaction of its first message, before the message's insert numbers it 1.
alter table conversations drop constraint conversations_last_seq_check;
alter table conversations add constraint conversations_last_seq_check check (last_seq >= 0);

-- A share of the workspace's quota no one end user may pass (percent of each limit, none when
-- null): a user's generations admitted in the current window and not released, and their
-- tokens (charged, or the ceiling while reserved), counted from the reservations, which now
-- name their end user. Admissions of one user are serialized by an advisory lock taken before
-- the admission statement, whose snapshot then holds the user's every earlier reservation.
alter table quota_counters
    add column end_user_share_percent smallint
        check (end_user_share_percent between 1 and 100);
alter table quota_reservations add column end_user_id text;
create index quota_reservations_of_end_user
    on quota_reservations (workspace_id, end_user_id, created_at) where end_user_id is not null;

-- What an end user has of the workspace's quota since `since` (the window's start): their
-- reservations not released, charged ones at the tokens charged, open ones (when open
-- reservations count) at their ceiling. The one definition the admission statement and the
-- refusal's report both read.
create function replyd_end_user_usage(
    p_workspace text, p_user text, p_since timestamptz, p_pending boolean,
    out generations bigint, out tokens bigint)
language sql stable as $$
    select count(*), coalesce(sum(coalesce(r.tokens_charged, r.token_ceiling)), 0)::bigint
      from quota_reservations r
     where r.workspace_id = p_workspace and r.end_user_id = p_user
       and r.created_at >= p_since
       and (r.state = 'charged' or (p_pending and r.state = 'reserved'))
$$;
