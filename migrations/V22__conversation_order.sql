-- A conversation's messages in the order they were written, for listing them page by page.
--
-- Each message gets the next number of its conversation (`seq`), taken from the
-- conversation's row by the insert of the message (a trigger), whose transaction holds that
-- row's lock until it commits. So within a conversation numbers are given in commit order: a reader that has seen
-- number n has seen every number below it, and a cursor "after n" neither skips a message
-- that commits later nor shows one twice. A transaction that rolls back gives its number back.
-- Only messages written through the API are numbered; a Kafka producer's tasks carry their
-- own messages and have no row here.

create table conversations (
    workspace_id    text        not null references workspaces,
    conversation_id text        not null,
    -- The number of the conversation's newest message.
    last_seq        bigint      not null default 1 check (last_seq >= 1),
    created_at      timestamptz not null default clock_timestamp(),
    primary key (workspace_id, conversation_id)
);

alter table messages add column seq bigint;

-- The messages written before, numbered in the order of their creation.
insert into conversations (workspace_id, conversation_id, last_seq, created_at)
select workspace_id, conversation_id, count(*), min(created_at)
  from messages group by workspace_id, conversation_id;
update messages m set seq = n.seq
  from (select message_id,
               row_number() over (partition by workspace_id, conversation_id
                                  order by created_at, message_id) as seq
          from messages) n
 where n.message_id = m.message_id;

alter table messages alter column seq set not null;
create unique index messages_in_order on messages (workspace_id, conversation_id, seq);

-- The number is given by the insert itself, so every writer numbers its messages the same
-- way, a process of the previous release too while a rolling update replaces it: the
-- conversation's row is made or moved on by this statement, and stays locked until the
-- writer's transaction ends.
create function replyd_number_message() returns trigger language plpgsql as $$
begin
    insert into conversations (workspace_id, conversation_id)
    values (new.workspace_id, new.conversation_id)
    on conflict (workspace_id, conversation_id)
    do update set last_seq = conversations.last_seq + 1
    returning last_seq into new.seq;
    return new;
end;
$$;

create trigger messages_numbered before insert on messages
    for each row execute function replyd_number_message();
