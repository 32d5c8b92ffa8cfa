//! The rules a migration added from now on keeps, so that it runs in seconds on a large
//! database under the service's `statement_timeout` (30 s) and `lock_timeout` (5 s), and never
//! holds a lock that stops writers for longer (docs/OPERATIONS.md, "Long migrations"):
//!
//! - no `CREATE INDEX` on a table the file did not create: that holds a SHARE lock, which stops
//!   every writer of the table, for the whole build. An index on an existing table goes in
//!   [`super::CONCURRENT_INDEXES`] and is built `CONCURRENTLY` after refinery's run;
//!   The same holds for a `UNIQUE` or `PRIMARY KEY` constraint added to an existing table,
//!   unless it adopts an index built so (`USING INDEX`);
//! - no `CREATE INDEX CONCURRENTLY` in a file either: refinery runs each migration in a
//!   transaction, where PostgreSQL refuses it;
//! - no `UPDATE` or `DELETE` of a table the file did not create unless it is bounded by a
//!   `LIMIT` (a batch, `WHERE ctid IN (SELECT ... LIMIT n)`), or follows a comment
//!   `-- replyd:small-table <why>` saying why the table stays small. A backfill of a large table
//!   is done by the service in batches after the deploy.
//!
//! Statements inside a function's body (dollar-quoted) are the function's, run later by the
//! service, not by the migration: they are not checked.

/// One statement of a migration a rule refuses, with why.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The statement's first line, trimmed.
    pub statement: String,
    pub why: &'static str,
}

const INDEX_ON_EXISTING: &str = "CREATE INDEX on a table this migration did not create holds a \
     SHARE lock (no writes) for the whole build: list it in CONCURRENT_INDEXES \
     (src/store/migrate.rs), which builds it CONCURRENTLY after the migrations";
const CONSTRAINT_ON_EXISTING: &str = "a UNIQUE or PRIMARY KEY constraint added to a table this \
     migration did not create builds its index under an ACCESS EXCLUSIVE lock: build the index \
     from CONCURRENT_INDEXES (src/store/migrate.rs), then add the constraint USING INDEX";
const CONCURRENTLY_IN_FILE: &str = "CREATE INDEX CONCURRENTLY cannot run in a migration \
     (refinery runs each in a transaction): list it in CONCURRENT_INDEXES \
     (src/store/migrate.rs) instead";
const UNBOUNDED_WRITE: &str = "UPDATE or DELETE of a table this migration did not create, \
     without a LIMIT: backfill in batches from the service after the deploy, or say why the \
     table is small with a `-- replyd:small-table <why>` comment before the statement";

/// The statements of `sql` (one migration file) the rules refuse.
pub fn check(sql: &str) -> Vec<Refusal> {
    let mut created: Vec<String> = Vec::new();
    let mut refused = Vec::new();
    for statement in statements(sql) {
        let words = words(&statement.code);
        let w: Vec<&str> = words.iter().map(String::as_str).collect();
        let refuse = |why| Refusal {
            statement: statement
                .code
                .trim()
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned(),
            why,
        };
        match w.as_slice() {
            ["create", "table", rest @ ..] => {
                let rest = skip(rest, &["if", "not", "exists"]);
                if let Some(table) = rest.first() {
                    created.push(bare(table));
                }
            }
            ["create", "index" | "unique", ..] => {
                let rest = skip(&w[1..], &["unique", "index"]);
                if rest.first() == Some(&"concurrently") {
                    refused.push(refuse(CONCURRENTLY_IN_FILE));
                    continue;
                }
                let on = rest.iter().position(|w| *w == "on");
                let table = on
                    .map(|at| skip(&rest[at + 1..], &["only"]))
                    .and_then(|r| r.first().map(|t| bare(t)));
                if !table.is_some_and(|t| created.contains(&t)) {
                    refused.push(refuse(INDEX_ON_EXISTING));
                }
            }
            ["alter", "table", rest @ ..] => {
                // A unique or primary key constraint builds its index under the ALTER's
                // ACCESS EXCLUSIVE lock, unless it adopts one built before (`USING INDEX`).
                let rest = skip(rest, &["if", "exists", "only"]);
                let table = rest.first().map(|t| bare(t)).unwrap_or_default();
                let builds = w.contains(&"unique") || w.windows(2).any(|p| p == ["primary", "key"]);
                if builds && !w.contains(&"using") && !created.contains(&table) {
                    refused.push(refuse(CONSTRAINT_ON_EXISTING));
                }
            }
            ["update", rest @ ..] | ["delete", "from", rest @ ..] => {
                let rest = skip(rest, &["only"]);
                let table = rest.first().map(|t| bare(t)).unwrap_or_default();
                let bounded = w.contains(&"limit");
                if !created.contains(&table) && !bounded && !statement.small_table {
                    refused.push(refuse(UNBOUNDED_WRITE));
                }
            }
            _ => {}
        }
    }
    refused
}

/// `words` past any leading ones in `these`.
fn skip<'a, 'b>(words: &'a [&'b str], these: &[&str]) -> &'a [&'b str] {
    let start = words
        .iter()
        .position(|w| !these.contains(w))
        .unwrap_or(words.len());
    &words[start..]
}

/// A table's name without its schema or quotes, and without what follows it (`messages(`).
fn bare(name: &str) -> String {
    let name = name.split('(').next().unwrap_or_default();
    let name = name.rsplit('.').next().unwrap_or_default();
    name.trim_matches('"').to_owned()
}

/// A statement at the top level of a file: its code (comments, strings and dollar-quoted
/// bodies blanked), and whether a `-- replyd:small-table <why>` comment comes before it.
struct Statement {
    code: String,
    small_table: bool,
}

/// The code of `sql` split at its top-level semicolons.
fn statements(sql: &str) -> Vec<Statement> {
    let mut out = Vec::new();
    let mut code = String::new();
    let mut small_table = false;
    let mut rest = sql;
    while let Some(c) = rest.chars().next() {
        if rest.starts_with("--") {
            let end = rest.find('\n').unwrap_or(rest.len());
            let comment = rest[2..end].trim();
            if let Some(why) = comment.strip_prefix("replyd:small-table") {
                // The marker counts only with a reason.
                small_table |= !why.trim().is_empty();
            }
            code.push(' ');
            rest = &rest[end..];
        } else if rest.starts_with("/*") {
            let end = rest.find("*/").map_or(rest.len(), |e| e + 2);
            code.push(' ');
            rest = &rest[end..];
        } else if c == '\'' || c == '"' {
            // A string or a quoted name: its text is not code.
            let end = rest[1..].find(c).map_or(rest.len(), |e| e + 2);
            code.push_str(if c == '"' { &rest[..end] } else { "''" });
            rest = &rest[end..];
        } else if let Some(tag) = dollar_tag(rest) {
            let body = &rest[tag.len()..];
            let end = body
                .find(tag)
                .map_or(rest.len(), |e| tag.len() + e + tag.len());
            code.push_str(" $$ ");
            rest = &rest[end..];
        } else if c == ';' {
            out.push(Statement {
                code: std::mem::take(&mut code),
                small_table: std::mem::take(&mut small_table),
            });
            rest = &rest[1..];
        } else {
            code.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    if !code.trim().is_empty() {
        out.push(Statement { code, small_table });
    }
    out
}

/// `$$` or `$tag$` at the start of `text`: a dollar-quoted string opens.
fn dollar_tag(text: &str) -> Option<&str> {
    let inner = text.strip_prefix('$')?;
    let end = inner.find('$')?;
    inner[..end]
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
        .then(|| &text[..end + 2])
        .filter(|tag| !tag[1..2].chars().all(|c| c.is_ascii_digit()))
}

/// The statement's words, lower case, split at white space and at commas and parentheses
/// (kept apart from a name: `messages(` is `messages`).
fn words(code: &str) -> Vec<String> {
    code.split(|c: char| c.is_whitespace() || c == ',' || c == '(' || c == ')')
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whys(sql: &str) -> Vec<&'static str> {
        check(sql).into_iter().map(|r| r.why).collect()
    }

    #[test]
    fn an_index_on_an_existing_table_is_refused() {
        assert_eq!(
            whys("create index reply_tasks_by_owner on reply_tasks (lease_owner);"),
            [INDEX_ON_EXISTING]
        );
        assert_eq!(
            whys(
                "CREATE UNIQUE INDEX IF NOT EXISTS x ON ONLY public.reply_tasks(retry_of)\n\
                  WHERE retry_of IS NOT NULL;"
            ),
            [INDEX_ON_EXISTING]
        );
        assert_eq!(
            whys("alter table reply_tasks add constraint one_retry unique (retry_of);"),
            [CONSTRAINT_ON_EXISTING]
        );
        assert_eq!(
            whys(
                "alter table reply_tasks add constraint one_retry unique \
                  using index reply_tasks_retry_of;"
            ),
            Vec::<&str>::new()
        );
        // V20 as it was written.
        assert_eq!(
            whys(
                "alter table reply_tasks add column retry_of uuid references reply_tasks;\n\
                  create unique index reply_tasks_retry_of on reply_tasks (retry_of) \
                  where retry_of is not null;"
            ),
            [INDEX_ON_EXISTING]
        );
    }

    #[test]
    fn an_index_built_concurrently_in_a_migration_is_refused() {
        // It would fail in refinery's transaction.
        assert_eq!(
            whys("create index concurrently if not exists x on reply_tasks (lease_owner);"),
            [CONCURRENTLY_IN_FILE]
        );
    }

    #[test]
    fn an_index_on_a_table_the_migration_creates_is_allowed() {
        assert_eq!(
            whys(
                "create table if not exists capacity_demand (bucket text not null, \
                  holder text not null);\n\
                  create index capacity_demand_by_holder on capacity_demand (holder);\n\
                  create unique index on public.\"capacity_demand\"(bucket, holder);"
            ),
            Vec::<&str>::new()
        );
    }

    #[test]
    fn a_whole_table_update_or_delete_is_refused() {
        assert_eq!(
            whys(
                "update messages m set seq = n.seq\n  from (select message_id from messages) n\n \
                  where n.message_id = m.message_id;"
            ),
            [UNBOUNDED_WRITE]
        );
        assert_eq!(
            whys("delete from only reply_attempts where outcome = 'fenced';"),
            [UNBOUNDED_WRITE]
        );
        let refused = check("-- Done.\nUPDATE reply_tasks SET lease_partition = 0;");
        assert_eq!(refused.len(), 1);
        assert_eq!(
            refused[0].statement,
            "UPDATE reply_tasks SET lease_partition = 0"
        );
    }

    #[test]
    fn a_batch_or_a_table_said_to_be_small_may_be_written() {
        assert_eq!(
            whys(
                "update messages set seq = 0 where ctid in \
                  (select ctid from messages where seq is null limit 10000);"
            ),
            Vec::<&str>::new()
        );
        assert_eq!(
            whys(
                "-- replyd:small-table one row per workspace, a few hundred at most\n\
                  update workspaces set weight = 1;"
            ),
            Vec::<&str>::new()
        );
        // The marker names why, and is for the statement after it only.
        assert_eq!(
            whys("-- replyd:small-table\nupdate workspaces set weight = 1;"),
            [UNBOUNDED_WRITE]
        );
        assert_eq!(
            whys(
                "-- replyd:small-table one row per workspace\nupdate workspaces set weight = 1;\n\
                  delete from reply_attempts;"
            ),
            [UNBOUNDED_WRITE]
        );
    }

    #[test]
    fn writes_in_a_table_the_migration_creates_are_allowed() {
        assert_eq!(
            whys(
                "create table schema_compatibility (only_row boolean primary key);\n\
                  update schema_compatibility set only_row = true;"
            ),
            Vec::<&str>::new()
        );
    }

    #[test]
    fn function_bodies_strings_and_comments_are_not_statements() {
        let sql = "create function f() returns void language plpgsql as $$\n\
                   begin\n  update reply_tasks set status = 'failed';\n  \
                   delete from reply_attempts;\nend;\n$$;\n\
                   create function g() returns void language sql as $body$ \
                   update messages set seq = 1 $body$;\n\
                   -- update messages set seq = 1;\n\
                   /* create index x on reply_tasks (status); */\n\
                   insert into t values ('update reply_tasks set x = 1; create index y on z (a)');";
        assert_eq!(whys(sql), Vec::<&str>::new());
    }

    #[test]
    fn the_migrations_that_prompted_the_rules_are_refused_by_them() {
        // V20's index and V22's backfill, as shipped: what the rules are for.
        let v20 = include_str!("../../../migrations/V20__task_retries.sql");
        let v22 = include_str!("../../../migrations/V22__conversation_order.sql");
        assert_eq!(whys(v20), [INDEX_ON_EXISTING]);
        assert_eq!(whys(v22), [UNBOUNDED_WRITE, INDEX_ON_EXISTING]);
    }
}
