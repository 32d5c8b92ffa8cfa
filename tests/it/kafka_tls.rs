//! Kafka over SASL_SSL, against the local broker's `SECURE` listener (TLS with a certificate
//! for `localhost` signed by a CA of the test run, SCRAM-SHA-256 with a user made by
//! deploy/infra.sh): `replyd serve` (the group consumer, the dead-letter producer and the
//! relay's producer) reaches Kafka only through it, with the brokers' names verified; a wrong
//! password or an untrusted certificate is named, with the address and the setting, and no
//! secret shows in any output.

use std::time::Duration;

use crate::helpers::app::{Routes, TestApp, WorkerConfig};
use crate::helpers::infra_opt;
use replyd_core::api_key::issue;
use replyd_lab::mock_provider::MockSettings;

const LIMIT: Duration = Duration::from_secs(120);

struct Secure {
    bootstrap: String,
    ca: String,
    user: String,
    password: String,
}

/// The local broker's SASL_SSL listener, or None with an external `KAFKA_BOOTSTRAP`.
fn secure() -> Option<Secure> {
    let Some(bootstrap) = infra_opt("KAFKA_SECURE_BOOTSTRAP") else {
        eprintln!("skipped: no KAFKA_SECURE_BOOTSTRAP (KAFKA_BOOTSTRAP names an external broker)");
        return None;
    };
    Some(Secure {
        bootstrap,
        ca: infra_opt("KAFKA_SECURE_CA").expect("KAFKA_SECURE_CA"),
        user: infra_opt("KAFKA_SCRAM_USER").expect("KAFKA_SCRAM_USER"),
        password: infra_opt("KAFKA_SCRAM_PASSWORD").expect("KAFKA_SCRAM_PASSWORD"),
    })
}

/// The workers' route to the secure listener with `[kafka.security]` as given.
fn route(app: &TestApp, secure: &Secure, ca: &str, password: &str, startup_retry_ms: u64) {
    app.route(Routes {
        kafka: Some(secure.bootstrap.clone()),
        kafka_toml: Some(format!(
            "startup_retry_ms = {startup_retry_ms}\n\
             [kafka.security]\n\
             protocol = \"sasl_ssl\"\n\
             ca_file = \"{ca}\"\n\
             sasl_mechanism = \"SCRAM-SHA-256\"\n\
             sasl_username = \"{}\"\n\
             sasl_password = \"{password}\"\n",
            secure.user
        )),
        ..Routes::default()
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_chain_runs_over_sasl_ssl_with_the_brokers_names_verified() {
    let Some(secure) = secure() else { return };
    let app = TestApp::start(2, MockSettings::default(), WorkerConfig::default()).await;
    app.db.store.create_workspace("acme").await.unwrap();
    let key = issue(&mut rand::rng());
    app.db.store.create_api_key("acme", &key).await.unwrap();
    route(&app, &secure, &secure.ca, &secure.password, 60_000);
    app.spawn_process("serve", "serve");
    let addr = app.wait_for_api_addr("serve", LIMIT).await;
    crate::helpers::press_until_completed(&reqwest::Client::new(), &addr, &key.token, "press-1")
        .await;
    app.wait_until_committed_to_end(LIMIT).await;
    app.terminate("serve").await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (1, 1), "{report:#?}");
    assert_eq!(report.outbox_unpublished, 0, "{report:#?}");
    let log = app.log_of("serve");
    assert!(
        !log.contains(&secure.password),
        "the SCRAM password is in the log"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_or_an_untrusted_broker_is_named_and_no_secret_is_shown() {
    let Some(secure) = secure() else { return };
    let other_ca = infra_opt("KAFKA_SECURE_OTHER_CA").expect("KAFKA_SECURE_OTHER_CA");
    let app = TestApp::start(1, MockSettings::default(), WorkerConfig::default()).await;
    let wrong = "not-the-scram-password";
    for (name, ca, password, expected) in [
        (
            "wrong-password",
            secure.ca.as_str(),
            wrong,
            "Authentication failed",
        ),
        (
            "untrusted",
            other_ca.as_str(),
            secure.password.as_str(),
            "certificate verify failed",
        ),
    ] {
        route(&app, &secure, ca, password, 3_000);
        app.spawn_worker(name);
        // It gives up after kafka.startup_retry_ms, with a failure.
        assert!(
            !app.wait_for_exit(name, LIMIT).await,
            "{name}: exits with a failure"
        );
        let log = app.log_of(name);
        // The final error carries the cause, not only librdkafka's "transport failure".
        let last = log.lines().last().unwrap_or_default();
        assert!(
            last.contains("the last broker error:") && last.contains(expected),
            "{name}: {last}"
        );
        assert!(
            log.contains(&secure.bootstrap) && log.contains("kafka.bootstrap_servers"),
            "{name}: the address and its setting are named: {log}"
        );
        assert!(
            !log.contains(password),
            "{name}: a password in the log: {log}"
        );
    }

    // The settings as shown hide the password; the pass-through maps refuse secrets.
    route(&app, &secure, &secure.ca, &secure.password, 3_000);
    let path = app.settings_file();
    let shown = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
        .args(["config", "show", "--config"])
        .arg(&path)
        .env("REPLYD_KAFKA__SECURITY__SASL_PASSWORD", &secure.password)
        .env("REPLYD_KAFKA__SECURITY__PROTOCOL", "sasl_ssl")
        .env("REPLYD_KAFKA__SECURITY__SASL_USERNAME", &secure.user)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.status.success(),
        "{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    assert!(stdout.contains("sasl_password = \"***\""), "{stdout}");
    assert!(!stdout.contains(&secure.password), "{stdout}");
}

#[test]
fn contradictory_kafka_security_settings_are_refused_by_name() {
    for (toml, expected) in [
        (
            "[kafka.security]\nprotocol = \"sasl_ssl\"\n",
            "kafka.security.sasl_username: protocol = \"sasl_ssl\" needs sasl_username and sasl_password",
        ),
        (
            "[kafka.security]\nprotocol = \"plaintext\"\nca_file = \"/etc/ca.pem\"\n",
            "kafka.security.ca_file: protocol = \"plaintext\" does not use TLS",
        ),
        (
            "[kafka.security]\nprotocol = \"ssl\"\nca_file = \"/nonexistent/ca.pem\"\n",
            "kafka.security.ca_file: /nonexistent/ca.pem: No such file",
        ),
        (
            "[kafka.librdkafka]\n\"sasl.password\" = \"hunter2\"\n",
            "kafka.librdkafka: `sasl.password` belongs in [kafka.security]",
        ),
        (
            "[kafka.producer_librdkafka]\n\"ssl.key.password\" = \"hunter2\"\n",
            "kafka.producer_librdkafka: `ssl.key.password` is a secret",
        ),
        (
            "[kafka.security]\nprotocol = \"tls\"\n",
            "kafka.security.protocol",
        ),
    ] {
        crate::helpers::assert_config_refused(toml, expected);
    }
}
