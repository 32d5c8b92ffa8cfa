-- New outbox rows wake the relays (channel `replyd_outbox`, once per inserting statement).
-- A hint only: relays also poll, so a lost notification delays a row, never loses it.
create function replyd_notify_outbox() returns trigger
language plpgsql as $$
begin
    perform pg_notify('replyd_outbox', '');
    return null;
end
$$;

create trigger outbox_notify
    after insert on outbox
    for each statement
    execute function replyd_notify_outbox();
