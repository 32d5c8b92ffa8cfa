-- Live text: the text of a running attempt, forwarded by its worker to the task's followers as
-- the provider writes it. A hint, never state: nothing here is read by a claim, a completion or
-- a check of the invariants, and the saved reply is the worker's whole text, saved as before.
--
-- - A worker writes its attempt's text in coalesced pieces (`worker.live_text_interval_ms`),
--   one statement a piece: the row, and a notification on `replyd_live` whose payload carries
--   the piece itself ('<task_id> <assignment_version> <seq> <text>', at most 7,000 bytes of
--   text, under NOTIFY's 8,000), so an API process forwards it without reading it back.
-- - The row is what a follower that (re)connects mid-answer reads: the pieces of the current
--   attempt after the one it last saw. Unlogged: no WAL is written for it, and a crash of the
--   database empties it, which costs followers only the text they would have re-read.
-- - Fenced like a completion: a piece is written only while its assignment is the task's
--   current one and running, so a zombie's text never reaches a follower as the current
--   attempt's, and the zombie learns it should stop forwarding.
-- - Gone with its task: a task's pieces are deleted when it ends (its followers get the saved
--   reply, or the end, instead), and by the cascade when it is erased or forgotten.

create unlogged table reply_live_text (
    task_id            uuid        not null references reply_tasks (task_id) on delete cascade,
    assignment_version bigint      not null,
    seq                integer     not null check (seq > 0),
    text               text        not null,
    written_at         timestamptz not null default clock_timestamp(),
    primary key (task_id, assignment_version, seq)
);

-- Writes piece `n` of the attempt `version` of task `id`, and announces it, if that attempt is
-- still the task's running one. False when it is not (fenced: stop forwarding).
create function replyd_live_append(id uuid, version bigint, n integer, piece text)
returns boolean language plpgsql as $$
begin
    insert into reply_live_text (task_id, assignment_version, seq, text)
    select id, version, n, piece
      from reply_tasks
     where task_id = id and assignment_version = version and status = 'running'
    -- A piece written again (its first answer lost) is the same piece.
    on conflict do nothing;
    if not found then
        return exists (select 1 from reply_live_text
                        where task_id = id and assignment_version = version and seq = n);
    end if;
    perform pg_notify('replyd_live', id::text || ' ' || version || ' ' || n || ' ' || piece);
    return true;
end
$$;

-- A task that ends takes its pieces with it, in the transaction that ends it.
create function replyd_live_text_ended() returns trigger language plpgsql as $$
begin
    delete from reply_live_text where task_id = new.task_id;
    return null;
end
$$;

create trigger reply_tasks_live_text_ended
    after update of status on reply_tasks
    for each row
    when (old.status is distinct from new.status
          and new.status in ('completed', 'failed', 'cancelled'))
    execute function replyd_live_text_ended();

-- How an attempt's streamed answer ended when it did not end in a reply: `cut` (the stream
-- ended or stalled without the provider's final event), `error` (an error event after the
-- first tokens), `cancelled` (the worker dropped it: a Stop, a revoked partition, a stopping
-- worker), `fenced` (its lease was lost meanwhile). With the characters of text it had
-- received; its usage is the last the provider reported (`prompt_tokens`,
-- `completion_tokens`), null when it reported none, never 0 for "unknown".
alter table reply_attempts
    add column stream_end text check (stream_end in ('cut', 'error', 'cancelled', 'fenced')),
    add column streamed_chars integer check (streamed_chars >= 0);
