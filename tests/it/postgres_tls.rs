//! PostgreSQL over TLS, against the local server (`ssl = on`, a certificate for `localhost`
//! signed by a CA of the test run; its role `replyd_tls` may connect only over TLS): libpq's
//! `sslmode` and `sslrootcert` in `database.url`, as replyd reads them. A worker runs with
//! `verify-full`; each mode's refusals name the target, the setting and the reason.

use std::time::Duration;

use crate::helpers::app::{Routes, TestApp, WorkerConfig};
use crate::helpers::{infra_opt, task_spec, wait_until};
use replyd::config::Secret;
use replyd::store::DatabaseSettings;
use replyd::store::migrate::run_migrations;
use replyd::store::{session_config, tls_connector};
use replyd_lab::mock_provider::MockSettings;

const LIMIT: Duration = Duration::from_secs(120);

/// The TLS role's URL with `params`, or None when the database is not the local one (an
/// external `DATABASE_URL` has no test certificates).
fn url(params: &str) -> Option<String> {
    let Some(base) = infra_opt("PG_TLS_URL") else {
        eprintln!("skipped: no PG_TLS_URL (DATABASE_URL names an external server)");
        return None;
    };
    Some(format!("{base}?{params}"))
}

fn ca() -> String {
    infra_opt("PG_TLS_CA").expect("PG_TLS_CA beside PG_TLS_URL")
}

fn settings(url: String) -> DatabaseSettings {
    DatabaseSettings {
        url: Secret::new(url),
        startup_retry_ms: 0,
        ..DatabaseSettings::default()
    }
}

/// Connects as `settings` says and reports whether this very session is encrypted.
async fn session_is_encrypted(settings: &DatabaseSettings) -> Result<bool, String> {
    let config = session_config(settings).map_err(|e| e.to_string())?;
    let tls = tls_connector(settings).map_err(|e| e.to_string())?;
    let (client, connection) = config
        .connect(tls)
        .await
        .map_err(|e| replyd::store::connect_error(settings, &e).to_string())?;
    tokio::spawn(connection);
    let row = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(row.get(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_verify_full_saves_its_replies_over_tls() {
    let Some(base) = url(&format!("sslmode=verify-full&sslrootcert={}", ca())) else {
        return;
    };
    let app = TestApp::start(1, MockSettings::default(), WorkerConfig::default()).await;
    app.route(Routes {
        database_url: Some(format!(
            "{base}&options=-c%20search_path%3D{}",
            app.db.schema
        )),
        ..Routes::default()
    });
    app.spawn_worker("w1");
    let tasks: Vec<_> = (0..5).map(|_| task_spec(3)).collect();
    app.produce_tasks(&tasks, 1).await;
    let ids: Vec<_> = tasks.iter().map(|t| t.task_id).collect();
    app.wait_until_terminal(&ids, LIMIT).await;
    // The worker's sessions (its pool and its listener) are the TLS role's, all encrypted.
    let client = app.db.raw_client().await;
    let sessions = "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl) \
                    FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
                    WHERE a.usename = 'replyd_tls'";
    let counts = || async {
        let row = client.query_one(sessions, &[]).await.unwrap();
        (row.get::<_, i64>(0), row.get::<_, i64>(1))
    };
    wait_until("the worker's sessions are seen", LIMIT, || async {
        counts().await.0 >= 2
    })
    .await;
    let counts = counts().await;
    assert_eq!(counts.1, 0, "no unencrypted session of the TLS role");
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (5, 5), "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sslmode_encrypts_and_verifies_as_libpq_does() {
    let Some(full) = url(&format!("sslmode=verify-full&sslrootcert={}", ca())) else {
        return;
    };
    let at_ip = |params: &str| url(params).unwrap().replace("@localhost:", "@127.0.0.1:");
    let port = full
        .split("@localhost:")
        .nth(1)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned();

    // verify-full at the certificate's own name.
    assert_eq!(session_is_encrypted(&settings(full)).await, Ok(true));
    // verify-ca checks the chain only, so the address the certificate does not name is fine.
    assert_eq!(
        session_is_encrypted(&settings(at_ip(&format!(
            "sslmode=verify-ca&sslrootcert={}",
            ca()
        ))))
        .await,
        Ok(true)
    );
    // require and prefer encrypt without verifying (libpq's meaning, with no sslrootcert).
    assert_eq!(
        session_is_encrypted(&settings(at_ip("sslmode=require"))).await,
        Ok(true)
    );
    assert_eq!(
        session_is_encrypted(&settings(at_ip("sslmode=prefer"))).await,
        Ok(true)
    );

    // verify-full at an address the certificate does not name.
    let error = run_migrations(&settings(at_ip(&format!(
        "sslmode=verify-full&sslrootcert={}",
        ca()
    ))))
    .await
    .unwrap_err()
    .to_string();
    assert!(
        error.contains(&format!("at 127.0.0.1:{port}/replyd (database.url)"))
            && error.contains("not valid for name"),
        "{error}"
    );
    // A CA that did not sign the server's certificate.
    let other = infra_opt("PG_TLS_OTHER_CA").unwrap();
    let error = run_migrations(&settings(
        url(&format!("sslmode=verify-full&sslrootcert={other}")).unwrap(),
    ))
    .await
    .unwrap_err()
    .to_string();
    assert!(
        error.contains(&format!("at localhost:{port}/replyd (database.url)"))
            && error.contains("UnknownIssuer"),
        "{error}"
    );
    // require with sslrootcert verifies the chain, as libpq does.
    let error = run_migrations(&settings(
        url(&format!("sslmode=require&sslrootcert={other}")).unwrap(),
    ))
    .await
    .unwrap_err()
    .to_string();
    assert!(error.contains("UnknownIssuer"), "{error}");
    // The server itself refuses the role without TLS: the sessions above really were TLS.
    let error = run_migrations(&settings(url("sslmode=disable").unwrap()))
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("no encryption"), "{error}");
    assert!(
        !error.contains("replyd_tls:replyd_tls"),
        "no password in {error}"
    );
}

#[test]
fn a_bad_sslmode_or_root_file_is_refused_at_start_naming_the_setting() {
    for (url, expected) in [
        (
            "postgres://u:hunter2@db/app?sslmode=verify",
            "database.url: sslmode=verify is not one of",
        ),
        (
            "postgres://u:hunter2@db/app?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
            "database.url: sslrootcert /nonexistent/ca.pem",
        ),
    ] {
        crate::helpers::assert_config_refused(&format!("[database]\nurl = \"{url}\"\n"), expected);
    }
}
