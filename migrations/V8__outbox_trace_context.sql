-- The W3C trace context (`traceparent`) of the request that wrote an outbox row: the relay
-- sends it on as the Kafka record's header, so the worker's spans join the request's trace.
-- Null when traces were off in the API.
alter table outbox add column traceparent text;
