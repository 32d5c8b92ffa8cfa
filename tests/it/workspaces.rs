//! Workspaces and API keys through the operator commands of the real binary, against the real
//! PostgreSQL: a key is shown once, only its hash is stored, it authenticates its workspace
//! until revoked, a workspace's prompt policy is set, shown and removed, and every refusal
//! names its reason.

use std::process::{Command, Output};

use crate::helpers::{TestDb, unique};
use replyd::store::workspaces::KeyCheck;
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

/// A key's secret half: `rpd_<key id>_<secret>`, where the secret (base64url) may itself hold
/// `_`, so it is what follows the second `_`, not the last.
fn secret_of(token: &str) -> &str {
    token.splitn(3, '_').nth(2).expect("rpd_<key id>_<secret>")
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
    let secret = secret_of(&token).to_owned();
    let client = db.raw_client().await;
    let dump: String = client
        .query_one("SELECT string_agg(t::text, ' ') FROM api_keys t", &[])
        .await
        .unwrap()
        .get(0);
    assert!(!dump.contains(&secret), "{dump}");

    let presented = parse_bearer(Some(format!("Bearer {token}").as_bytes())).unwrap();
    assert_eq!(
        db.store.authenticate(&presented).await.unwrap(),
        KeyCheck::Live("acme".into())
    );
    // The same id with another secret is not the key.
    let forged = parse_bearer(Some(
        format!("Bearer rpd_{}_{}", presented.key_id, "A".repeat(43)).as_bytes(),
    ))
    .unwrap();
    assert_eq!(
        db.store.authenticate(&forged).await.unwrap(),
        KeyCheck::Unknown
    );

    let revoked = replyd(&db, &["api-key", "revoke", &presented.key_id]);
    assert!(revoked.status.success(), "{}", text(&revoked.stderr));
    assert!(text(&revoked.stdout).contains("of workspace acme revoked"));
    assert_eq!(
        db.store.authenticate(&presented).await.unwrap(),
        KeyCheck::Unknown
    );
    let twice = replyd(&db, &["api-key", "revoke", &presented.key_id]);
    assert!(twice.status.success());
    assert!(text(&twice.stdout).contains("revoked already"));
}

/// A key made to expire authenticates until then; past it, its holder hears it expired (and
/// anyone else, that it is unknown), as do the end-user tokens it asked for. `replyd api-key
/// list` shows every key's standing and its last use, never a key or its hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_expires_when_it_was_made_to_and_the_list_shows_each_key_s_standing_and_last_use() {
    let db = TestDb::new().await;
    assert!(
        replyd(&db, &["workspace", "create", "acme"])
            .status
            .success()
    );
    let make = |args: &[&str]| {
        let made = replyd(&db, args);
        assert!(made.status.success(), "{}", text(&made.stderr));
        (text(&made.stdout).trim().to_owned(), text(&made.stderr))
    };
    let (lasting, _) = make(&["api-key", "create", "--workspace", "acme"]);
    let (expiring, said) = make(&[
        "api-key",
        "create",
        "--workspace",
        "acme",
        "--expires-in-days",
        "30",
    ]);
    assert!(said.contains(", until 20"), "{said}");
    let too_long = replyd(
        &db,
        &[
            "api-key",
            "create",
            "--workspace",
            "acme",
            "--expires-in-days",
            "0",
        ],
    );
    assert!(!too_long.status.success());
    let key = |token: &str| parse_bearer(Some(format!("Bearer {token}").as_bytes())).unwrap();
    let (lasting_token, expiring_token) = (lasting.clone(), expiring.clone());
    let (lasting, expiring) = (key(&lasting), key(&expiring));
    assert_eq!(
        db.store.authenticate(&expiring).await.unwrap(),
        KeyCheck::Live("acme".into())
    );

    // The API notes a key's use off the request's path.
    let api = crate::helpers::api::serve_on_loopback(
        replyd::api::ApiState::new(
            db.store.clone(),
            replyd::api::settings::ApiSettings::default(),
            crate::helpers::api::limits(100),
        ),
        tokio_util::sync::CancellationToken::new(),
    )
    .await;
    let quota = |token: String| {
        let base = api.0.clone();
        async move {
            reqwest::Client::new()
                .get(format!("{base}/v1/quota"))
                .bearer_auth(token)
                .send()
                .await
                .unwrap()
        }
    };
    assert_eq!(quota(expiring_token.clone()).await.status(), 200);
    crate::helpers::wait_until(
        "the key's use is written",
        std::time::Duration::from_secs(30),
        || async {
            db.store
                .list_api_keys(Some("acme"))
                .await
                .unwrap()
                .iter()
                .any(|k| k.key_id == expiring.key_id && k.last_used_at.is_some())
        },
    )
    .await;

    // Its expiry comes (moved to the past, as the clock would).
    db.raw_client()
        .await
        .execute(
            "UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE key_id = $1",
            &[&expiring.key_id],
        )
        .await
        .unwrap();
    assert!(matches!(
        db.store.authenticate(&expiring).await.unwrap(),
        KeyCheck::Expired(_)
    ));
    let refused = quota(expiring_token.clone()).await;
    assert_eq!(refused.status(), 401);
    let problem: serde_json::Value = refused.json().await.unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("the API key expired at 20"), "{detail}");
    // Another secret under the same id learns nothing of the expiry.
    let forged = format!("rpd_{}_{}", expiring.key_id, "A".repeat(43));
    let problem: serde_json::Value = quota(forged).await.json().await.unwrap();
    assert_eq!(problem["detail"], "the API key is unknown or revoked");
    // The lasting key is untouched.
    assert_eq!(quota(lasting_token.clone()).await.status(), 200);

    // The list: both keys, their standing, never a secret or a hash.
    let listed = replyd(&db, &["api-key", "list", "--workspace", "acme"]);
    assert!(listed.status.success(), "{}", text(&listed.stderr));
    let table = text(&listed.stdout);
    let line_of = |id: &str| {
        table
            .lines()
            .find(|l| l.starts_with(id))
            .unwrap_or_else(|| panic!("{id} not in {table}"))
            .to_owned()
    };
    assert!(line_of(&expiring.key_id).ends_with(" expired"), "{table}");
    assert!(line_of(&lasting.key_id).ends_with(" live"), "{table}");
    assert!(line_of(&lasting.key_id).contains(" never "), "{table}");
    let json = replyd(&db, &["api-key", "list", "--json"]);
    let rows: Vec<serde_json::Value> = text(&json.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    let hashes: Vec<String> = db
        .raw_client()
        .await
        .query("SELECT key_hash FROM api_keys", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for output in [&table, &text(&json.stdout)] {
        let secrets = [&lasting_token, &expiring_token].map(|token| secret_of(token));
        for secret in secrets.into_iter().chain(hashes.iter().map(String::as_str)) {
            assert!(!output.contains(secret), "{output}");
        }
    }
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
