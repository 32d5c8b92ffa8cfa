-- A workspace's own retention of its finished tasks (their attempts, reservations, outbox
-- rows, idempotency records and messages), in place of `retention.tasks_ms` for it; null
-- keeps the deployment's. Retention still waits for a task's live idempotency record, open
-- reservation and current quota window.
alter table workspaces
    add column task_retention_seconds bigint check (task_retention_seconds > 0);
