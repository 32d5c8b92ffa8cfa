-- Live text written by a worker once per round for all of its streaming attempts, instead of
-- once per piece per attempt: one statement, one transaction and one notifying commit a round
-- (V26's cost was about two notifying commits a reply, and PostgreSQL serializes notifying
-- commits and signals every listening session for each).
--
-- - `replyd_live_append_batch` takes a round's pieces as arrays, writes each whose attempt is
--   still the task's running one (fenced as V26's `replyd_live_append`: a zombie's pieces are
--   never written), and answers, in the order given, whether each is written: true if written
--   now or before (a round sent again after its answer was lost), false if fenced.
-- - The pieces written now are announced on `replyd_live_pieces`, packed into as few
--   notifications as fit under NOTIFY's 8,000 bytes: each piece is a header line
--   '<task_id> <assignment_version> <seq> <bytes>' and then exactly <bytes> bytes of text, so
--   the text may hold anything.
-- - V26's function and channel stay for workers of the previous release during an upgrade;
--   the API listens on both.

create function replyd_live_append_batch(ids uuid[], versions bigint[], seqs integer[],
                                         pieces text[])
returns boolean[] language plpgsql as $$
declare
    written boolean[];
    fresh_ids uuid[];
    fresh_versions bigint[];
    fresh_seqs integer[];
    fresh_pieces text[];
    payload text := '';
    entry text;
begin
    with input as (
        select u.id, u.version, u.n, u.piece, u.i
          from unnest(ids, versions, seqs, pieces) with ordinality as u(id, version, n, piece, i)
    ), inserted as (
        insert into reply_live_text (task_id, assignment_version, seq, text)
        select u.id, u.version, u.n, u.piece
          from input u
          join reply_tasks t
            on t.task_id = u.id and t.assignment_version = u.version and t.status = 'running'
        -- A piece written again (its round's first answer lost) is the same piece.
        on conflict do nothing
        returning task_id, assignment_version, seq
    ), marked as (
        select u.*, (i.task_id is not null) as fresh,
               -- This statement's snapshot does not see its own inserts: a row found here was
               -- written by an earlier round.
               (i.task_id is not null or exists (
                   select 1 from reply_live_text l
                    where l.task_id = u.id and l.assignment_version = u.version
                      and l.seq = u.n)) as ok
          from input u
          left join inserted i
            on i.task_id = u.id and i.assignment_version = u.version and i.seq = u.n
    )
    select array_agg(ok order by i),
           array_agg(id order by i) filter (where fresh),
           array_agg(version order by i) filter (where fresh),
           array_agg(n order by i) filter (where fresh),
           array_agg(piece order by i) filter (where fresh)
      into written, fresh_ids, fresh_versions, fresh_seqs, fresh_pieces
      from marked;
    for k in 1 .. coalesce(array_length(fresh_ids, 1), 0) loop
        entry := fresh_ids[k]::text || ' ' || fresh_versions[k] || ' ' || fresh_seqs[k] || ' '
                 || octet_length(fresh_pieces[k]) || E'\n' || fresh_pieces[k];
        if payload <> '' and octet_length(payload) + octet_length(entry) > 7900 then
            perform pg_notify('replyd_live_pieces', payload);
            payload := '';
        end if;
        payload := payload || entry;
    end loop;
    if payload <> '' then
        perform pg_notify('replyd_live_pieces', payload);
    end if;
    return coalesce(written, '{}');
end
$$;
