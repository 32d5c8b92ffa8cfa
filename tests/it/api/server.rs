//! `replyd api` as a process: it serves from its settings and drains on SIGTERM, and a request
//! open when shutdown begins is still answered while new connections are refused.

use std::time::Duration;

use super::{body, key_for};
use crate::helpers::TestDb;
use replyd::api::settings::ApiSettings;
use replyd::api::{ApiState, IntakeLimits, serve};
use reqwest::StatusCode;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replyd_api_serves_from_its_settings_and_drains_on_sigterm() {
    let db = TestDb::new().await;
    let key = key_for(&db, "acme").await;
    let dir = std::env::temp_dir().join(crate::helpers::unique("api"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("replyd.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{}\"\n[api]\nlisten = \"127.0.0.1:0\"\n[observability]\nlisten = \"127.0.0.1:0\"\n",
            db.settings.url.expose()
        ),
    )
    .unwrap();
    let log = dir.join("api.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
        .args(["api", "--config"])
        .arg(&config)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut addr = String::new();
    crate::helpers::wait_until("the API logs its address", Duration::from_secs(60), || {
        let found = std::fs::read_to_string(&log).ok().and_then(|text| {
            let (_, rest) = text.split_once("API listening addr=")?;
            Some(rest.split_whitespace().next()?.to_owned())
        });
        if let Some(found) = found {
            addr = found;
        }
        let ready = !addr.is_empty();
        async move { ready }
    })
    .await;
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/v1/replies"))
        .bearer_auth(&key)
        .header("Idempotency-Key", "from-the-binary")
        .json(&body("q"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::ACCEPTED);

    // Its own /healthz, /readyz (the API's part: the database answers) and /metrics.
    let text = std::fs::read_to_string(&log).unwrap();
    let observability = text
        .lines()
        .find(|line| line.contains("serving /metrics"))
        .and_then(|line| line.split_once("addr=")?.1.split_whitespace().next())
        .expect("the observability address is logged")
        .to_owned();
    let get = |path: &str| reqwest::get(format!("http://{observability}{path}"));
    assert_eq!(get("/healthz").await.unwrap().text().await.unwrap(), "ok");
    let ready = get("/readyz").await.unwrap();
    assert_eq!(ready.status(), StatusCode::OK);
    assert_eq!(ready.text().await.unwrap(), "api: ready: database answers");
    let metrics = get("/metrics").await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains("replyd_api_submissions_total"),
        "the API's counters are exported:\n{metrics}"
    );

    std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(
        status.success(),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
}

/// Shutdown stops taking connections at once, and a request already being read is still
/// answered: its handler was waiting for its body when shutdown began.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_open_when_shutdown_begins_is_answered_and_new_connections_are_refused() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let db = TestDb::new().await;
    let key = key_for(&db, "acme").await;
    let stop = CancellationToken::new();
    let state = ApiState::new(
        db.store.clone(),
        ApiSettings::default(),
        IntakeLimits::default(),
    );
    let (addr, served) = serve("127.0.0.1:0".parse().unwrap(), state, stop.clone())
        .await
        .unwrap();
    let payload = serde_json::to_vec(&body("q")).unwrap();
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!(
                "POST /v1/replies HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n\
                 Idempotency-Key: open-at-shutdown\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nExpect: 100-continue\r\n\r\n",
                payload.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    // `100 Continue` is sent when the handler starts reading the body.
    let mut interim = [0u8; 25];
    stream.read_exact(&mut interim).await.unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");

    stop.cancel();
    crate::helpers::wait_until(
        "the API refuses new connections",
        Duration::from_secs(10),
        || async move { tokio::net::TcpStream::connect(addr).await.is_err() },
    )
    .await;
    stream.write_all(&payload).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer))
        .await
        .expect("the connection closes after its answer")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 202 "), "{answer}");
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("the server's task ends once its last request is answered")
        .unwrap();
}
