-- A failed task is retried as a new task (`replyd tasks retry`): the failed one keeps its
-- history and its settled reservation; the new one names it here, once. The unique index is
-- what makes a second retry of the same failed task find the first instead of making another.
alter table reply_tasks add column retry_of uuid references reply_tasks;
create unique index reply_tasks_retry_of on reply_tasks (retry_of) where retry_of is not null;
