//! What arrives during a scenario: tasks at a steady rate, half published to Kafka (some
//! malformed) and half pressed through the API as a careful browser presses, each press's
//! stream followed and checked event by event.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::API;
use crate::helpers::app::TestApp;
use crate::helpers::unique;
use prost::Message as _;
use replyd::api::reply_view::Accepted;
use replyd_lab::produce::{demo_task, malformed_record, producer, publish};
use serde_json::{Value, json};

/// What arrived during a scenario.
pub(super) struct Produced {
    /// Tasks published to Kafka directly.
    pub(super) published: usize,
    pub(super) malformed: usize,
    /// Presses of Send, each answered with its task.
    pub(super) presses: usize,
    /// Presses sent again after their answer, with the same key.
    pub(super) double_clicks: usize,
    /// Requests that got no answer (API down, PostgreSQL down) and were asked again.
    pub(super) unanswered: usize,
    /// Presses stopped: the task ended cancelled (the cancel was answered `200`).
    pub(super) stopped: Vec<replyd_core::domain::TaskId>,
    /// Stops that came too late: the reply was saved, or the task failed, first (`409`).
    pub(super) stopped_too_late: Vec<replyd_core::domain::TaskId>,
    /// Presses whose task's event stream was followed to its end, and what their followers
    /// were shown of the live text.
    pub(super) followed: usize,
    pub(super) live: LiveCheck,
}

/// Tasks at a steady rate until `until`: half published to Kafka (a share `poison` of the
/// records malformed), half pressed through the API.
pub(super) async fn produce_steadily(
    app: &Arc<TestApp>,
    token: &str,
    until: Instant,
    per_second: u32,
    poison: f64,
    seed: u64,
) -> Produced {
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
    let workspace = unique("ws");
    let (mut good, mut bad) = (0usize, 0usize);
    let mut presses = Vec::new();
    let tick = Duration::from_millis(100);
    let per_tick = (per_second / 10).max(1) as usize;
    let producer = producer(&app.bootstrap).expect("producer");
    let client = reqwest::Client::new();
    let mut next = Instant::now();
    while Instant::now() < until {
        let mut records = Vec::with_capacity(per_tick);
        for _ in 0..per_tick {
            if rng.f64() < poison {
                records.push((format!("bad-{bad}"), malformed_record(bad).1));
                bad += 1;
            } else if rng.bool() {
                let press = Press {
                    app: Arc::clone(app),
                    client: client.clone(),
                    token: token.to_owned(),
                    key: format!("press-{}", presses.len()),
                    double_click: rng.f64() < 0.1,
                    // A user who presses Stop, at once or while the reply is written.
                    stop_after: (rng.f64() < 0.1)
                        .then(|| Duration::from_millis(rng.u64(0..=2_000))),
                    follow: rng.f64() < 0.25,
                };
                presses.push(tokio::spawn(press.run()));
            } else {
                let task = demo_task(&workspace, good, 60, 0);
                records.push((
                    task.conversation_id.clone(),
                    task.to_proto().encode_to_vec(),
                ));
                good += 1;
            }
        }
        match &app.sqs {
            None => publish(&producer, &app.topic, &records)
                .await
                .expect("published"),
            Some(sqs) => {
                let bodies: Vec<String> = records
                    .iter()
                    .map(|(_, value)| replyd_lab::sqs::body_of(value))
                    .collect();
                replyd_lab::sqs::send_bodies(&sqs.client(), &sqs.queues.url, &bodies)
                    .await
                    .expect("sent");
            }
        }
        // A steady rate: the next batch is due one tick after the last was due.
        next += tick;
        tokio::time::sleep_until(next.into()).await;
    }
    let mut produced = Produced {
        published: good,
        malformed: bad,
        presses: presses.len(),
        double_clicks: 0,
        unanswered: 0,
        stopped: Vec::new(),
        stopped_too_late: Vec::new(),
        followed: 0,
        live: LiveCheck::default(),
    };
    let mut tasks = HashSet::new();
    for press in presses {
        let pressed = press.await.unwrap();
        tasks.insert(pressed.task);
        if let Some(live) = pressed.followed {
            produced.followed += 1;
            produced.live.add(live);
        }
        produced.double_clicks += usize::from(pressed.double_clicked);
        produced.unanswered += pressed.unanswered;
        match pressed.stopped {
            Some(true) => produced.stopped.push(pressed.task),
            Some(false) => produced.stopped_too_late.push(pressed.task),
            None => {}
        }
    }
    // One task per key, whatever was asked again.
    assert_eq!(tasks.len(), produced.presses, "a task per press");
    // Whatever died, stalled or restarted, no follower was shown a piece twice, out of order,
    // or after its attempt's text was withdrawn, and every stream reached its task's end.
    assert_eq!(
        produced.live.violations,
        Vec::<String>::new(),
        "live text of {} followed presses",
        produced.followed
    );
    produced
}

/// What the followers of presses were shown of the live text, checked event by event.
#[derive(Debug, Default)]
pub(super) struct LiveCheck {
    pub(super) pieces: usize,
    pub(super) withdrawals: usize,
    /// Connections that ended or broke before the task's end and were opened again with
    /// `Last-Event-ID`.
    pub(super) reconnects: usize,
    violations: Vec<String>,
    /// Per attempt of the followed task: the next piece's number, and whether its text was
    /// withdrawn.
    next: std::collections::HashMap<i64, i64>,
    withdrawn: HashSet<i64>,
}

impl LiveCheck {
    /// One event; true at the task's end.
    fn event(&mut self, task: replyd_core::domain::TaskId, kind: &str, data: &Value) -> bool {
        let version = data["assignment_version"].as_i64().unwrap_or(-1);
        match kind {
            "delta" => {
                self.pieces += 1;
                let seq = data["seq"].as_i64().unwrap_or(-1);
                if self.withdrawn.contains(&version) {
                    self.violations.push(format!(
                        "{task}: piece {seq} of attempt {version} after its withdrawal"
                    ));
                }
                let expected = self.next.entry(version).or_insert(1);
                if seq != *expected {
                    self.violations.push(format!(
                        "{task}: piece {seq} of attempt {version} where {expected} was next"
                    ));
                }
                *expected = seq + 1;
                false
            }
            "withdrawn" => {
                self.withdrawals += 1;
                self.withdrawn.insert(version);
                false
            }
            "status" => matches!(
                data["status"].as_str(),
                Some("completed" | "failed" | "cancelled")
            ),
            _ => false,
        }
    }

    /// Adds one follower's counts to the scenario's.
    fn add(&mut self, one: LiveCheck) {
        self.pieces += one.pieces;
        self.withdrawals += one.withdrawals;
        self.reconnects += one.reconnects;
        self.violations.extend(one.violations);
    }
}

/// One press of Send, as a careful browser makes it.
struct Press {
    app: Arc<TestApp>,
    client: reqwest::Client,
    token: String,
    key: String,
    double_click: bool,
    /// Press Stop this long after the press was answered.
    stop_after: Option<Duration>,
    /// Follow the task's event stream to its end, as the page does.
    follow: bool,
}

struct Pressed {
    task: replyd_core::domain::TaskId,
    double_clicked: bool,
    unanswered: usize,
    /// Whether Stop was pressed and cancelled the task (`Some(true)`), or came too late.
    stopped: Option<bool>,
    /// What its follower was shown, when it was followed.
    followed: Option<LiveCheck>,
}

impl Press {
    /// Asks until answered: a connection refused (the API restarting), a lost answer or a 503
    /// (PostgreSQL down) is asked again with the same key. A refusal (4xx) fails the scenario:
    /// the quota is generous and every request is well formed.
    async fn run(self) -> Pressed {
        let limit = Instant::now() + Duration::from_secs(180);
        let mut unanswered = 0;
        let first = loop {
            match self.send().await {
                Ok(accepted) => break accepted,
                Err(why) => {
                    assert!(
                        Instant::now() < limit,
                        "press {} never answered: {why}",
                        self.key
                    );
                    unanswered += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        if self.double_click {
            // The second click may meet a fault too; when it is answered, it is the same task.
            if let Ok(again) = self.send().await {
                assert_eq!(again.task_id, first.task_id, "press {} again", self.key);
                assert!(again.replayed, "press {} again is a replay", self.key);
            }
        }
        let stopping = async {
            match self.stop_after {
                Some(after) => {
                    tokio::time::sleep(after).await;
                    Some(self.stop(first.task_id, limit).await)
                }
                None => None,
            }
        };
        let following = async {
            if self.follow {
                Some(self.follow(first.task_id, limit).await)
            } else {
                None
            }
        };
        let (stopped, followed) = tokio::join!(stopping, following);
        Pressed {
            task: first.task_id,
            double_clicked: self.double_click,
            unanswered,
            stopped,
            followed,
        }
    }

    /// Follows the task's event stream to its end, through the API's restarts and
    /// PostgreSQL's outages: a stream that ends or breaks first is opened again with the id
    /// of the last event seen.
    async fn follow(&self, task: replyd_core::domain::TaskId, limit: Instant) -> LiveCheck {
        let mut check = LiveCheck::default();
        let mut last_id: Option<String> = None;
        while Instant::now() < limit {
            if let Some(addr) = self.app.api_addr(API) {
                let mut request = self
                    .client
                    .get(format!("http://{addr}/v1/replies/{task}/events"))
                    .bearer_auth(&self.token);
                if let Some(id) = &last_id {
                    request = request.header("Last-Event-ID", id);
                }
                if let Ok(mut response) = request.send().await
                    && response.status().is_success()
                {
                    let mut buffer = String::new();
                    // A stream says something (a keep-alive at least) every 15 s.
                    while let Ok(Ok(Some(bytes))) =
                        tokio::time::timeout(Duration::from_secs(20), response.chunk()).await
                    {
                        buffer.push_str(&String::from_utf8_lossy(&bytes));
                        while let Some(end) = buffer.find("\n\n") {
                            let block: String = buffer.drain(..end + 2).collect();
                            let field =
                                |name: &str| block.lines().find_map(|l| l.strip_prefix(name));
                            let (Some(kind), Some(data)) = (field("event: "), field("data: "))
                            else {
                                continue; // a keep-alive
                            };
                            if let Some(id) = field("id: ") {
                                last_id = Some(id.to_owned());
                            }
                            let data: Value = serde_json::from_str(data).unwrap_or_default();
                            if check.event(task, kind, &data) {
                                return check;
                            }
                        }
                    }
                }
            }
            check.reconnects += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        check
            .violations
            .push(format!("{task}: the stream never reached the task's end"));
        check
    }

    /// Presses Stop until answered (a cancel is safe to send again): true when the task is
    /// cancelled, false when it had ended first (`409`). Anything else fails the scenario.
    async fn stop(&self, task: replyd_core::domain::TaskId, limit: Instant) -> bool {
        loop {
            let answered = async {
                let addr = self.app.api_addr(API).ok_or("the API has not started")?;
                let response = self
                    .client
                    .post(format!("http://{addr}/v1/replies/{task}/cancel"))
                    .bearer_auth(&self.token)
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                match response.status().as_u16() {
                    200 => Ok(true),
                    409 => Ok(false),
                    status if status >= 500 => Err(format!("{status}")),
                    status => panic!(
                        "stop of press {}: {status} {}",
                        self.key,
                        response.text().await.unwrap_or_default()
                    ),
                }
            };
            match answered.await {
                Ok(cancelled) => return cancelled,
                Err(why) => {
                    assert!(
                        Instant::now() < limit,
                        "stop of press {} never answered: {why}",
                        self.key
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    async fn send(&self) -> Result<Accepted, String> {
        let addr = self.app.api_addr(API).ok_or("the API has not started")?;
        let response = self
            .client
            .post(format!("http://{addr}/v1/replies"))
            .bearer_auth(&self.token)
            .header("Idempotency-Key", &self.key)
            .timeout(Duration::from_secs(10))
            // Long enough to be streamed in pieces, over about half a second.
            .json(&json!({"conversation_id": self.key, "message": "What changed? [mock:reply_chars=300]"}))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        if status.is_server_error() {
            return Err(format!("{status}"));
        }
        assert!(
            status.is_success(),
            "press {}: {status} {}",
            self.key,
            response.text().await.unwrap_or_default()
        );
        response.json().await.map_err(|e| e.to_string())
    }
}
