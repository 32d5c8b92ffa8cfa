-- Which binaries can work with this schema (docs/OPERATIONS.md, "Upgrades" and "Rollback").
--
-- From here on a migration either expands the schema, so that the release before it still
-- works against it and a rollback is a change of image, or contracts it: drops or narrows what
-- no release it can be rolled back to uses. A contracting migration raises the floor:
-- `oldest_version` becomes the newest migration a binary must know to work with what is left,
-- `oldest_release` the first release that shipped that migration. A binary that knows
-- migrations up to the floor runs against a schema a later release migrated further and
-- applies none of the newer ones; one that does not refuses to start and names the release
-- it needs (`replyd_core::schema`).
--
-- Expand only.

create table schema_compatibility (
    only_row       boolean primary key default true check (only_row),
    oldest_version integer not null check (oldest_version > 0),
    oldest_release text    not null
);

-- Nothing contracted yet: a binary that knows V34 (the release before this one) works
-- against this schema.
insert into schema_compatibility (oldest_version, oldest_release) values (34, '0.1.0');
