//! Workspaces and API keys through the operator commands of the real binary, against the real
//! PostgreSQL: a key is shown once, only its hash is stored, it authenticates its workspace
//! until revoked, a workspace's prompt policy is set, shown and removed, and every refusal
//! names its reason.

use std::process::{Command, Output};

use crate::helpers::{TestDb, unique};
use replyd_core::api_key::parse_bearer;

fn replyd(db: &TestDb, args: &[&str]) -> Output {
    let dir = std::env::temp_dir().join(unique("operator"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("replyd.toml");
    std::fs::write(
        &config,
        format!("[database]\nurl = \"{}\"\n", db.settings.url.expose()),
    )
    .unwrap();
    Command::new(env!("CARGO_BIN_EXE_replyd"))
        .args(args)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_shown_once_stored_as_a_hash_and_authenticates_until_revoked() {
    let db = TestDb::new().await;
    let made = replyd(&db, &["workspace", "create", "acme"]);
    assert!(made.status.success(), "{}", text(&made.stderr));
    let again = replyd(&db, &["workspace", "create", "acme"]);
    assert!(again.status.success());
    assert!(text(&again.stdout).contains("exists already"));

    let created = replyd(&db, &["api-key", "create", "--workspace", "acme"]);
    assert!(created.status.success(), "{}", text(&created.stderr));
    let token = text(&created.stdout).trim().to_owned();
    assert!(token.starts_with("rpd_"), "{token}");
    assert!(text(&created.stderr).contains("shown only this once"));

    // Nothing in the database holds the key itself, nor its secret half.
    let secret = token.rsplit('_').next().unwrap().to_owned();
    let client = db.raw_client().await;
    let dump: String = client
        .query_one("SELECT string_agg(t::text, ' ') FROM api_keys t", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!dump.contains(&secret), "{dump}");

    let presented = parse_bearer(Some(format!("Bearer {token}").as_bytes())).unwrap();
    assert_eq!(
        db.store.authenticate(&presented).await.unwrap().as_deref(),
        Some("acme")
    );
    // The same id with another secret is not the key.
    let forged = parse_bearer(Some(
        format!("Bearer rpd_{}_{}", presented.key_id, "A".repeat(43)).as_bytes(),
    ))
    .unwrap();
    assert_eq!(db.store.authenticate(&forged).await.unwrap(), None);

    let revoked = replyd(&db, &["api-key", "revoke", &presented.key_id]);
    assert!(revoked.status.success(), "{}", text(&revoked.stderr));
    assert!(text(&revoked.stdout).contains("of workspace acme revoked"));
    assert_eq!(db.store.authenticate(&presented).await.unwrap(), None);
    let twice = replyd(&db, &["api-key", "revoke", &presented.key_id]);
    assert!(twice.status.success());
    assert!(text(&twice.stdout).contains("revoked already"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_mistakes_are_refused_with_their_reason_and_change_nothing() {
    let db = TestDb::new().await;
    let bad = replyd(&db, &["workspace", "create", "Acme Corp"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        text(&bad.stderr).contains("is not valid"),
        "{}",
        text(&bad.stderr)
    );

    let orphan = replyd(&db, &["api-key", "create", "--workspace", "nobody"]);
    assert_eq!(orphan.status.code(), Some(4));
    assert!(text(&orphan.stderr).contains("no workspace \"nobody\""));
    assert!(
        orphan.stdout.is_empty(),
        "no key is shown for a key not stored"
    );

    let unknown = replyd(&db, &["api-key", "revoke", "0123456789abcdef"]);
    assert_eq!(unknown.status.code(), Some(4));

    let client = db.raw_client().await;
    let rows: i64 = client
        .query_one(
            "SELECT (SELECT count(*) FROM workspaces) + (SELECT count(*) FROM api_keys)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_sets_shows_and_removes_a_workspaces_prompt_policy() {
    let db = TestDb::new().await;
    assert!(
        replyd(&db, &["workspace", "create", "acme"])
            .status
            .success()
    );
    let shown = replyd(&db, &["workspace", "policy", "acme"]);
    assert_eq!(
        text(&shown.stdout).trim(),
        "workspace acme: models any, max_output_tokens none, end_user_context deny, system_prompt none",
        "the defaults: end users may not send context"
    );

    let set = replyd(
        &db,
        &[
            "workspace",
            "policy",
            "acme",
            "--system-prompt",
            "You are Acme's help desk.",
            "--end-user-context",
            "allow",
        ],
    );
    assert_eq!(
        text(&set.stdout).trim(),
        "workspace acme: models any, max_output_tokens none, end_user_context allow, system_prompt \"You are Acme's help desk.\"",
        "{}",
        text(&set.stderr)
    );
    // From a file; a long one shown by its start and length. What is not given stays.
    let file = std::env::temp_dir().join(unique("prompt"));
    let long = format!(
        "{}\nAnswer from the document only.",
        "Be precise. ".repeat(20)
    );
    std::fs::write(&file, &long).unwrap();
    let from_file = replyd(
        &db,
        &[
            "workspace",
            "policy",
            "acme",
            "--system-prompt-file",
            file.to_str().unwrap(),
        ],
    );
    let line = text(&from_file.stdout);
    assert!(
        line.contains("end_user_context allow")
            && line.contains("system_prompt \"Be precise. Be precise. ")
            && line.contains(&format!("…\" ({} bytes)", long.len())),
        "{line}"
    );
    let client = db.raw_client().await;
    let stored: Option<String> = client
        .query_one(
            "SELECT system_prompt FROM workspaces WHERE workspace_id = 'acme'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored.as_deref(), Some(long.as_str()));

    // Refused with the reason, changing nothing.
    let over = std::env::temp_dir().join(unique("prompt"));
    std::fs::write(&over, "x".repeat(32 * 1024 + 1)).unwrap();
    for (args, reason) in [
        (
            vec!["--end-user-context", "sometimes"],
            "is not `allow` or `deny`",
        ),
        (vec!["--system-prompt", "  "], "blank"),
        (
            vec!["--system-prompt-file", over.to_str().unwrap()],
            "over the limit of 32768 bytes",
        ),
        (
            vec!["--system-prompt-file", "/nonexistent/prompt.txt"],
            "cannot read /nonexistent/prompt.txt",
        ),
    ] {
        let refused = replyd(&db, &[&["workspace", "policy", "acme"][..], &args].concat());
        assert_eq!(refused.status.code(), Some(2), "{args:?}");
        assert!(
            text(&refused.stderr).contains(reason),
            "{args:?}: {}",
            text(&refused.stderr)
        );
    }
    let nobody = replyd(
        &db,
        &[
            "workspace",
            "policy",
            "nobody",
            "--end-user-context",
            "deny",
        ],
    );
    assert_eq!(nobody.status.code(), Some(4));

    // `quota show --json` shows it whole; `none` removes it.
    let json = replyd(&db, &["quota", "show", "acme", "--json"]);
    let view: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(
        (
            &view["workspace_policy"]["system_prompt"],
            &view["workspace_policy"]["end_user_context"]
        ),
        (&serde_json::json!(long), &serde_json::json!("allow"))
    );
    let removed = replyd(
        &db,
        &[
            "workspace",
            "policy",
            "acme",
            "--system-prompt",
            "none",
            "--end-user-context",
            "deny",
        ],
    );
    assert!(
        text(&removed.stdout).ends_with("end_user_context deny, system_prompt none\n"),
        "{}",
        text(&removed.stdout)
    );
}

/// `replyd workspace share`: a weight is shown (1 unless set), set within 1..=1,000, and a
/// weight outside them or a workspace that does not exist is refused by its own exit code,
/// changing nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_sets_and_shows_a_workspaces_weight() {
    let db = TestDb::new().await;
    assert!(
        replyd(&db, &["workspace", "create", "acme"])
            .status
            .success()
    );
    let shown = replyd(&db, &["workspace", "share", "acme"]);
    assert_eq!(text(&shown.stdout).trim(), "workspace acme has weight 1");
    let set = replyd(&db, &["workspace", "share", "acme", "--weight", "5"]);
    assert!(set.status.success(), "{}", text(&set.stderr));
    assert_eq!(text(&set.stdout).trim(), "workspace acme has weight 5");
    for bad in ["0", "1001", "two"] {
        let refused = replyd(&db, &["workspace", "share", "acme", "--weight", bad]);
        assert_eq!(refused.status.code(), Some(2), "{bad}");
        assert!(
            text(&refused.stderr).contains("--weight"),
            "{}",
            text(&refused.stderr)
        );
    }
    let nobody = replyd(&db, &["workspace", "share", "nobody", "--weight", "2"]);
    assert_eq!(nobody.status.code(), Some(4));
    assert!(text(&nobody.stderr).contains("no workspace \"nobody\""));
    assert_eq!(
        db.store.workspace_weights().await.unwrap(),
        vec![("acme".to_owned(), 5)]
    );
}
