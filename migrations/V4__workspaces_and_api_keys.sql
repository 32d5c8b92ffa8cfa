-- Workspaces (tenants) and their API keys. A key is stored only as the SHA-256 of the whole
-- key (it is random and high-entropy, so no salt or slow hash is needed); the key itself is
-- shown once, when it is made. A request's workspace comes from its key, never from its body.
create table workspaces (
    -- Chosen by the operator; the same namespace as reply_tasks.workspace_id.
    workspace_id text        primary key
                 check (workspace_id ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
    created_at   timestamptz not null default clock_timestamp()
);

create table api_keys (
    -- The public half of the key (`rpd_<key_id>_<secret>`): finds the row.
    key_id       text        primary key,
    workspace_id text        not null references workspaces,
    -- SHA-256 of the whole key, hex.
    key_hash     text        not null,
    created_at   timestamptz not null default clock_timestamp(),
    -- Set once; a revoked key never authenticates again.
    revoked_at   timestamptz
);

create index api_keys_by_workspace on api_keys (workspace_id);
