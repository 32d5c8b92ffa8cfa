-- The intake of the HTTP API (I6): one transaction writes the user's message, its reply task
-- (in reply_tasks), the idempotency record of the submission and the outbox row that hands
-- the task to Kafka.

create table messages (
    message_id      uuid        primary key,
    workspace_id    text        not null references workspaces,
    conversation_id text        not null,
    content         text        not null,
    created_at      timestamptz not null default clock_timestamp()
);

-- One row per (workspace, operation, key) while the key is remembered: the unique key decides
-- between concurrent first requests, the hash and the inputs answer a replay or name a
-- mismatch, expires_at ends the retention (an expired row is replaced by the next use).
create table idempotency_keys (
    workspace_id    text        not null references workspaces,
    operation       text        not null,
    idempotency_key text        not null,
    request_hash    text        not null,
    request         jsonb       not null,
    task_id         uuid        not null references reply_tasks,
    created_at      timestamptz not null default clock_timestamp(),
    expires_at      timestamptz not null,
    primary key (workspace_id, operation, idempotency_key)
);
create index idempotency_keys_expiry on idempotency_keys (expires_at);

-- Tasks waiting to be published to the reply-task topic, and published ones until their
-- retention ends. The payload is the encoded replyd.v1.ReplyTask record.
create table outbox (
    outbox_id    bigserial   primary key,
    task_id      uuid        not null references reply_tasks,
    record_key   text        not null,
    payload      bytea       not null,
    created_at   timestamptz not null default clock_timestamp(),
    published_at timestamptz
);
create index outbox_unpublished on outbox (outbox_id) where published_at is null;
