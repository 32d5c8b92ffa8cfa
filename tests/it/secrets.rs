//! No secret in any output: `replyd serve` runs the whole chain with a database password, a
//! provider key, a provider extra header (Azure's `api-key`) and a Kafka SASL password it was
//! given (as a Deployment gives them: environment variables and the URL), an API key a caller
//! presses with, and an end user's token made with it (and its workspace's signing secret).
//! Then every
//! output of the run is searched for each of them: the process's log, `/metrics`, `/readyz`,
//! `/healthz`, `replyd config show` and `config check`, `--help`, an error that names the
//! database it cannot reach, and `replyd check`.

use std::time::Duration;

use crate::helpers::app::{Routes, TestApp, WorkerConfig};
use crate::helpers::infra_opt;
use replyd_core::api_key::issue;
use replyd_lab::mock_provider::MockSettings;

const LIMIT: Duration = Duration::from_secs(120);

/// A value no other text of the run contains.
fn secret(kind: &str) -> String {
    format!("{kind}{}", uuid::Uuid::new_v4().simple())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_shows_in_any_output_of_a_run() {
    let (Some(secure), Some(ca), Some(user), Some(sasl_password)) = (
        infra_opt("KAFKA_SECURE_BOOTSTRAP"),
        infra_opt("KAFKA_SECURE_CA"),
        infra_opt("KAFKA_SCRAM_USER"),
        infra_opt("KAFKA_SCRAM_PASSWORD"),
    ) else {
        eprintln!("skipped: no local SASL_SSL listener (external KAFKA_BOOTSTRAP)");
        return;
    };
    let app = TestApp::start(1, MockSettings::default(), WorkerConfig::default()).await;
    // A role of this test's own, so its password is a value nothing else prints.
    let role = crate::helpers::unique("secret_role");
    let db_password = secret("dbpw");
    let client = app.db.raw_client().await;
    client
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN SUPERUSER PASSWORD '{db_password}'"
        ))
        .await
        .unwrap();
    let base = replyd::store::target_of(&app.db.settings);
    let database_url = format!(
        "postgres://{role}:{db_password}@{base}?options=-c%20search_path%3D{}",
        app.db.schema
    );
    let provider_key = secret("sk-");
    let extra_header = secret("azure-");
    app.db.store.create_workspace("acme").await.unwrap();
    let api_key = issue(&mut rand::rng());
    app.db.store.create_api_key("acme", &api_key).await.unwrap();
    let secrets = [
        ("database password", db_password.clone()),
        ("provider key", provider_key.clone()),
        ("provider extra header", extra_header.clone()),
        ("SASL password", sasl_password.clone()),
        ("API key", api_key.token.clone()),
    ];
    let env = vec![
        ("REPLYD_PROVIDER__API_KEY".to_owned(), provider_key.clone()),
        (
            "REPLYD_PROVIDER__EXTRA_HEADERS__API-KEY".to_owned(),
            extra_header.clone(),
        ),
        (
            "REPLYD_KAFKA__SECURITY__SASL_PASSWORD".to_owned(),
            sasl_password.clone(),
        ),
    ];
    app.route(Routes {
        database_url: Some(database_url.clone()),
        kafka: Some(secure),
        kafka_toml: Some(format!(
            "[kafka.security]\nprotocol = \"sasl_ssl\"\nca_file = \"{ca}\"\n\
             sasl_mechanism = \"SCRAM-SHA-256\"\nsasl_username = \"{user}\"\n"
        )),
        env: env.clone(),
        ..Routes::default()
    });

    app.spawn_process("serve", "serve");
    let addr = app.wait_for_api_addr("serve", LIMIT).await;
    let http = reqwest::Client::new();
    // A press, a wrong key (a 401 that must not echo it), and the press's completion.
    let refused = http
        .get(format!("http://{addr}/v1/quota"))
        .bearer_auth(format!("{}x", api_key.token))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    crate::helpers::press_until_completed(&http, &addr, &api_key.token, "press-1").await;
    // An end user's token: made, pressed with, and a tampered one refused without echoing it.
    let minted: serde_json::Value = http
        .post(format!("http://{addr}/v1/end-user-tokens"))
        .bearer_auth(&api_key.token)
        .json(&serde_json::json!({"user_id": "user-a"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let token = minted["token"].as_str().unwrap().to_owned();
    crate::helpers::press_until_completed(&http, &addr, &token, "press-2").await;
    let tampered = http
        .get(format!("http://{addr}/v1/conversations/conv-1/messages"))
        .bearer_auth(format!("{token}x"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // The signing secret, as only the API can open it, in the forms a leak would take.
    let sealed: Vec<u8> = client
        .query_one(
            "SELECT sealed FROM end_user_signing_keys WHERE workspace_id = 'acme'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let signing_secret = replyd_core::sealed::SealingKey::parse(crate::helpers::api::TOKEN_KEY)
        .unwrap()
        .open(&sealed, &replyd_core::sealed::signing_key_row("acme", 1))
        .unwrap();
    use base64::Engine as _;
    let secrets = [
        secrets.as_slice(),
        &[
            ("end user's token", token.clone()),
            (
                "token signing secret",
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&signing_secret),
            ),
            (
                "token signing secret",
                base64::engine::general_purpose::STANDARD.encode(&signing_secret),
            ),
            (
                "token sealing key (api.end_user_token_key)",
                crate::helpers::api::TOKEN_KEY.to_owned(),
            ),
        ],
    ]
    .concat();

    let mut outputs: Vec<(String, String)> = vec![
        ("API 401".into(), refused),
        ("API 401 of a token".into(), tampered),
    ];
    let observability = app.observability_addr("serve").unwrap();
    for path in ["/metrics", "/readyz", "/healthz"] {
        let page = reqwest::get(format!("http://{observability}{path}"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        outputs.push((path.into(), page));
    }
    let settings = app.settings_file_as_routed();
    let run = |args: &[&str], extra: &[(&str, &str)]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
            .args(args)
            .arg("--config")
            .arg(&settings)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .envs(extra.iter().copied())
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    outputs.push(("config show".into(), run(&["config", "show"], &[])));
    outputs.push(("config check".into(), run(&["config", "check"], &[])));
    outputs.push(("--help".into(), run(&["--help"], &[])));
    outputs.push(("serve --help".into(), run(&["serve", "--help"], &[])));
    outputs.push(("check".into(), run(&["check"], &[])));
    // A database it cannot reach: the error names the address and the setting, not the URL.
    let unreachable = database_url.replace(&base, "127.0.0.1:1/replyd");
    outputs.push((
        "migrate, unreachable".into(),
        run(
            &["migrate"],
            &[
                ("REPLYD_DATABASE__URL", unreachable.as_str()),
                ("REPLYD_DATABASE__STARTUP_RETRY_MS", "0"),
            ],
        ),
    ));
    app.terminate("serve").await;
    outputs.push(("serve log".into(), app.log_of("serve")));

    assert!(
        outputs
            .iter()
            .any(|(what, text)| what == "config show" && text.contains("***")),
        "config show redacts: {outputs:?}"
    );
    assert!(
        outputs
            .iter()
            .any(|(what, text)| what == "config show" && text.contains("api-key = \"***\"")),
        "config show names the extra header and redacts its value: {outputs:?}"
    );
    assert!(
        outputs
            .iter()
            .any(|(what, text)| what == "migrate, unreachable"
                && text.contains("127.0.0.1:1/replyd (database.url)")),
        "{outputs:?}"
    );
    for (what, text) in &outputs {
        assert!(!text.is_empty(), "{what} printed something");
        for (name, value) in &secrets {
            assert!(
                !text.contains(value.as_str()),
                "the {name} is in {what}:\n{text}"
            );
        }
    }
}
