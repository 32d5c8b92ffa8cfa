//! `replyd-lab browsers`: simulated browsers pressing Send against a live API, for the demo and the
//! benchmarks. Each press is what a careful client does (seed 000): one `Idempotency-Key` per
//! press, reused for every retry; on purpose, some presses lose their first answer (a client
//! timeout too short for the server) and retry with the same key; every press follows its
//! task over Server-Sent Events to a terminal state, reconnecting with `Last-Event-ID` when
//! the stream breaks; some then press Regenerate (a new press, its own key). The live text
//! on the way (`delta` events) is timed from the press and checked: each attempt's pieces in
//! order, and their text the start of the saved reply.
//!
//! The report counts what the browsers did and saw. Some presses are double clicks (the same
//! key twice at once); two answers naming two tasks are counted in `answers_disagreeing` (I6
//! says 0). Whether a lost answer's request made a second task is for the durable state to
//! say: `replyd check` counts `duplicate_tasks`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use futures_util::stream::{self, StreamExt};
use serde::{Deserialize, Serialize};

use replyd::api::reply_view::{Accepted, ReplyStatus, ReplyView};
use replyd_core::domain::TaskId;

#[derive(Debug, Clone, Args)]
pub struct BrowsersArgs {
    /// The API's base URL, e.g. http://127.0.0.1:8080; several, separated by commas, spread
    /// the presses over them (press n goes to the n-th modulo their count, and is followed
    /// there, as a user behind a load balancer is).
    #[arg(long, value_delimiter = ',', required = true)]
    pub api: Vec<String>,
    /// The workspace's API key.
    #[arg(long, env = "REPLYD_API_KEY", hide_env_values = true)]
    pub key: String,
    /// Presses of Send, each a new message.
    #[arg(long, default_value_t = 200)]
    pub presses: usize,
    /// Browsers at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Share of presses whose first answer is lost (client timeout, then a retry, same key).
    #[arg(long, default_value_t = 0.2)]
    pub lose_share: f64,
    /// The client timeout that loses an answer, in ms: short enough that the server may or
    /// may not have saved the request when the client gives up.
    #[arg(long, default_value_t = 5)]
    pub lose_timeout_ms: u64,
    /// Share of presses sent twice at once with the same key (a double click); both answers
    /// must name one task.
    #[arg(long, default_value_t = 0.1)]
    pub double_click_share: f64,
    /// Share of presses followed by a Regenerate once their reply is shown.
    #[arg(long, default_value_t = 0.1)]
    pub regenerate_share: f64,
    /// Give up on a press after this long (it is then counted as unfinished).
    #[arg(long, default_value_t = 300)]
    pub press_limit_s: u64,
    /// Print one `name=value` summary line instead of the JSON report.
    #[arg(long)]
    pub summary: bool,
    /// Seed of the choices (which presses lose answers or regenerate).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also write each terminal press's time (ms, press to terminal event), one per line,
    /// ascending, to this file: the distribution behind the percentiles.
    #[arg(long)]
    pub latencies: Option<std::path::PathBuf>,
    /// Ask the mock provider for replies of this many characters (`[mock:reply_chars=N]`
    /// appended to each message), long enough to stream in many pieces.
    #[arg(long)]
    pub reply_chars: Option<usize>,
}

/// What the browsers did and saw, printed as one JSON line.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct BrowsersReport {
    pub presses: usize,
    /// Every POST sent, retries and regenerates included.
    pub requests: usize,
    /// POSTs sent again with a key already used (after a lost answer, a 5xx or a 429).
    pub retries: usize,
    /// Answers the client gave up waiting for.
    pub lost_answers: usize,
    pub regenerates: usize,
    /// Double clicks whose two answers named two tasks (must be 0).
    pub answers_disagreeing: usize,
    /// Answers marked `Idempotent-Replayed: true`.
    pub replayed_answers: usize,
    pub completed: usize,
    pub failed: usize,
    /// Tasks stopped (by a cancel from elsewhere: these browsers never press Stop).
    pub cancelled: usize,
    /// Presses (or regenerates) not terminal within `--press-limit-s`, or refused.
    pub unfinished: usize,
    /// Presses answered `429` with a `Retry-After` beyond `--press-limit-s` (not unfinished:
    /// the user is told when to come back).
    pub quota_refused: usize,
    /// Event streams opened again after a break.
    pub stream_reconnects: usize,
    /// From a press's first POST to the terminal event on its stream.
    pub e2e_ms_p50: i64,
    pub e2e_ms_p99: i64,
    pub e2e_ms_max: i64,
    /// Every terminal press's time, ascending (written by `--latencies`, not printed).
    #[serde(skip)]
    pub e2e_ms: Vec<i64>,
    /// Followed tasks whose stream carried any live text (`delta` events).
    pub streamed: usize,
    /// `delta` events received.
    pub deltas: usize,
    /// Deltas that were not the next piece of their attempt's text (must be 0).
    pub deltas_out_of_order: usize,
    /// Completed tasks whose streamed text is not the start of their saved reply (must be 0).
    pub streamed_text_mismatches: usize,
    /// From a press's first POST to the first `delta` on its stream, over the streamed ones.
    pub first_text_ms_p50: i64,
    pub first_text_ms_p99: i64,
}

impl BrowsersReport {
    /// The report's figures as `name=value` pairs for a summary line.
    pub fn summary_line(&self) -> String {
        format!(
            "presses={} requests={} retries={} lost_answers={} regenerates={} answers_disagreeing={} unfinished={} quota_refused={} e2e_ms_p50={} e2e_ms_p99={} streamed={} deltas={} deltas_out_of_order={} streamed_text_mismatches={} first_text_ms_p50={} first_text_ms_p99={}",
            self.presses,
            self.requests,
            self.retries,
            self.lost_answers,
            self.regenerates,
            self.answers_disagreeing,
            self.unfinished,
            self.quota_refused,
            self.e2e_ms_p50,
            self.e2e_ms_p99,
            self.streamed,
            self.deltas,
            self.deltas_out_of_order,
            self.streamed_text_mismatches,
            self.first_text_ms_p50,
            self.first_text_ms_p99
        )
    }
}

/// One press as the browser saw it.
#[derive(Debug, Default)]
struct PressOutcome {
    requests: usize,
    retries: usize,
    lost_answers: usize,
    regenerated: bool,
    answers_disagreeing: usize,
    replayed_answers: usize,
    stream_reconnects: usize,
    /// Presses the quota refused for longer than the press may wait.
    quota_refused: usize,
    /// Terminal state and the time to it, per task followed (the press, then its regenerate).
    ends: Vec<Option<(ReplyStatus, Duration)>>,
    /// The time to the first `delta`, per task followed whose stream carried one.
    first_text: Vec<Duration>,
    deltas: usize,
    deltas_out_of_order: usize,
    streamed_text_mismatches: usize,
}

/// How a POST ended for the browser.
enum Posted {
    Accepted(Accepted),
    /// A refusal that a retry cannot mend (4xx other than 429).
    Refused(u16, String),
    /// No answer in time.
    TimedOut,
    /// `429`: the quota does not admit the press now; capacity returns after this.
    OverQuota(Option<Duration>),
}

struct Browser {
    client: reqwest::Client,
    api: String,
    key: String,
    lose_timeout: Duration,
    deadline: Instant,
    /// Appended to each message: `[mock:reply_chars=N]`, or nothing.
    directive: String,
}

impl Browser {
    async fn post_once(
        &self,
        path: &str,
        key: &str,
        body: Option<&serde_json::Value>,
        timeout: Option<Duration>,
    ) -> Result<Posted, String> {
        let mut request = self
            .client
            .post(format!("{}{path}", self.api))
            .bearer_auth(&self.key)
            .header("Idempotency-Key", key);
        if let Some(body) = body {
            request = request.json(body);
        }
        if let Some(timeout) = timeout {
            request = request.timeout(timeout);
        }
        match request.send().await {
            Ok(response) => {
                let status = response.status();
                if status.is_success() {
                    let accepted: Accepted = response.json().await.map_err(|e| e.to_string())?;
                    Ok(Posted::Accepted(accepted))
                } else if status.as_u16() == 429 {
                    let retry_after = response
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok())
                        .map(Duration::from_secs);
                    Ok(Posted::OverQuota(retry_after))
                } else if status.is_server_error() {
                    Err(format!("{status}"))
                } else {
                    Ok(Posted::Refused(
                        status.as_u16(),
                        response.text().await.unwrap_or_default(),
                    ))
                }
            }
            Err(e) if e.is_timeout() => Ok(Posted::TimedOut),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Sends one press until it is answered: a lost answer, a 5xx, a 429 or a network error is
    /// retried with the same key, with backoff and jitter; the first answer's task is the
    /// press's.
    async fn press(
        &self,
        path: &str,
        key: &str,
        body: Option<&serde_json::Value>,
        lose_first: bool,
        outcome: &mut PressOutcome,
    ) -> Option<TaskId> {
        let mut attempt = 0u32;
        loop {
            if Instant::now() >= self.deadline {
                return None;
            }
            let lose = lose_first && attempt == 0;
            outcome.requests += 1;
            if attempt > 0 {
                outcome.retries += 1;
            }
            attempt += 1;
            let timeout = lose.then_some(self.lose_timeout);
            match self.post_once(path, key, body, timeout).await {
                Ok(Posted::Accepted(accepted)) if !lose => {
                    if accepted.replayed {
                        outcome.replayed_answers += 1;
                    }
                    return Some(accepted.task_id);
                }
                // An answer that came in under the short timeout is still "lost" by choice:
                // the browser never read it, so it retries like one that did not come.
                Ok(Posted::Accepted(_)) | Ok(Posted::TimedOut) => outcome.lost_answers += 1,
                Ok(Posted::OverQuota(retry_after)) => {
                    // Honour Retry-After when it fits the press's time; otherwise the browser
                    // tells its user when to come back and the press ends.
                    match retry_after {
                        Some(wait) if Instant::now() + wait < self.deadline => {
                            tokio::time::sleep(wait).await;
                            continue;
                        }
                        _ => {
                            outcome.quota_refused += 1;
                            return None;
                        }
                    }
                }
                Ok(Posted::Refused(status, body)) => {
                    tracing::warn!(status, body, "a press was refused");
                    return None;
                }
                Err(error) => tracing::debug!(error, "a press failed; retrying"),
            }
            // Full jitter over an exponential ceiling: 50 ms, 100 ms, ... up to 2 s.
            let ceiling = 50u64 << attempt.min(6);
            tokio::time::sleep(Duration::from_millis(fastrand::u64(0..=ceiling.min(2000)))).await;
        }
    }

    /// Follows `task` to a terminal state over SSE, reconnecting with `Last-Event-ID` (of the
    /// last event with an id, a piece of text included, as `EventSource` does); `started` is
    /// when its press was sent.
    async fn follow(
        &self,
        task: TaskId,
        started: Instant,
        outcome: &mut PressOutcome,
    ) -> Option<(ReplyStatus, ReplyView)> {
        let mut last_id: Option<String> = None;
        let mut opened = 0usize;
        let mut text = LiveTextSeen::default();
        while Instant::now() < self.deadline {
            if opened > 0 {
                outcome.stream_reconnects += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            opened += 1;
            let mut request = self
                .client
                .get(format!("{}/v1/replies/{task}/events", self.api))
                .bearer_auth(&self.key);
            if let Some(id) = &last_id {
                request = request.header("Last-Event-ID", id);
            }
            let Ok(mut response) = request.send().await else {
                continue;
            };
            if !response.status().is_success() {
                continue;
            }
            let mut buffer = String::new();
            while let Ok(Some(chunk)) = response.chunk().await {
                buffer.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(end) = buffer.find("\n\n") {
                    let event: String = buffer.drain(..end + 2).collect();
                    let Some((id, event)) = parse_event(&event) else {
                        continue;
                    };
                    last_id = Some(id);
                    let view = match event {
                        StreamEvent::Status(view) => view,
                        StreamEvent::Delta(delta) => {
                            if !text.any {
                                outcome.first_text.push(started.elapsed());
                            }
                            outcome.deltas += 1;
                            if !text.append(delta) {
                                outcome.deltas_out_of_order += 1;
                            }
                            continue;
                        }
                        StreamEvent::Withdrawn => {
                            text.withdraw();
                            continue;
                        }
                    };
                    if matches!(
                        view.status,
                        ReplyStatus::Completed | ReplyStatus::Failed | ReplyStatus::Cancelled
                    ) {
                        if !text.fits(view.reply.as_deref()) {
                            outcome.streamed_text_mismatches += 1;
                        }
                        return Some((view.status, view));
                    }
                }
            }
        }
        None
    }
}

/// One event of a task's stream, as a browser uses it.
#[derive(Debug, PartialEq)]
enum StreamEvent {
    /// The task's state.
    Status(ReplyView),
    /// A piece of the running attempt's text.
    Delta(Delta),
    /// The text shown so far is void.
    Withdrawn,
}

/// The `data` of a `delta` event, as much of it as a browser reads.
#[derive(Debug, PartialEq, Deserialize)]
struct Delta {
    assignment_version: i64,
    seq: i32,
    text: String,
}

/// The id and the event of one block (None for keep-alives and events without an id).
fn parse_event(block: &str) -> Option<(String, StreamEvent)> {
    let mut id = None;
    let mut data = String::new();
    let mut kind = "";
    for line in block.lines() {
        if let Some(value) = line.strip_prefix("id:") {
            id = Some(value.trim().to_owned());
        } else if let Some(value) = line.strip_prefix("data:") {
            data.push_str(value.trim_start());
        } else if let Some(value) = line.strip_prefix("event:") {
            kind = value.trim();
        }
    }
    let event = match kind {
        "status" => StreamEvent::Status(serde_json::from_str(&data).ok()?),
        "delta" => StreamEvent::Delta(serde_json::from_str(&data).ok()?),
        "withdrawn" => StreamEvent::Withdrawn,
        _ => return None,
    };
    Some((id?, event))
}

/// The live text one stream has shown: the current attempt's, piece by piece.
#[derive(Debug, Default)]
struct LiveTextSeen {
    /// The attempt and the number of its next piece, once one was shown.
    next: Option<(i64, i32)>,
    text: String,
    /// Whether any piece was shown (the first is timed).
    any: bool,
}

impl LiveTextSeen {
    /// Shows `delta`; false when it is not the next piece of its attempt (a piece of another
    /// attempt starts a new text at piece 1).
    fn append(&mut self, delta: Delta) -> bool {
        let expected = match self.next {
            Some((version, seq)) if version == delta.assignment_version => seq,
            _ => {
                self.text.clear();
                1
            }
        };
        self.next = Some((delta.assignment_version, delta.seq + 1));
        self.any = true;
        self.text.push_str(&delta.text);
        delta.seq == expected
    }

    fn withdraw(&mut self) {
        self.next = None;
        self.text.clear();
    }

    /// Whether the text shown is the start of `reply` (the last piece may not have been
    /// written before the reply was saved); any text fits a task that saved none.
    fn fits(&self, reply: Option<&str>) -> bool {
        reply.is_none_or(|reply| reply.starts_with(&self.text))
    }
}

/// What one simulated press does.
#[derive(Debug, Clone, Copy)]
struct Choice {
    n: usize,
    lose: bool,
    double_click: bool,
    regenerate: bool,
}

/// Sends a press (twice at once for a double click, both answers compared) and returns its task.
async fn send(
    browser: &Browser,
    path: &str,
    body: Option<&serde_json::Value>,
    choice: Choice,
    outcome: &mut PressOutcome,
) -> Option<TaskId> {
    let key = uuid::Uuid::new_v4().to_string();
    if !choice.double_click {
        return browser.press(path, &key, body, choice.lose, outcome).await;
    }
    let mut other = PressOutcome::default();
    let (first, second) = tokio::join!(
        browser.press(path, &key, body, choice.lose, outcome),
        browser.press(path, &key, body, false, &mut other),
    );
    outcome.requests += other.requests;
    outcome.retries += other.retries + 1; // the second click reuses the key
    outcome.lost_answers += other.lost_answers;
    outcome.quota_refused = outcome.quota_refused.max(other.quota_refused);
    outcome.replayed_answers += other.replayed_answers;
    if let (Some(a), Some(b)) = (first, second)
        && a != b
    {
        outcome.answers_disagreeing += 1;
    }
    first.or(second)
}

async fn one_press(browser: &Browser, choice: Choice) -> PressOutcome {
    let mut outcome = PressOutcome::default();
    let n = choice.n;
    let body = serde_json::json!({
        "conversation_id": format!("conv-{}", n % 50),
        "message": format!("Question {n}: what changed in this version?{}", browser.directive),
        "document_version": "v1",
    });
    let started = Instant::now();
    let Some(task) = send(browser, "/v1/replies", Some(&body), choice, &mut outcome).await else {
        if outcome.quota_refused == 0 {
            outcome.ends.push(None);
        }
        return outcome;
    };
    let end = browser.follow(task, started, &mut outcome).await;
    outcome
        .ends
        .push(end.as_ref().map(|(status, _)| (*status, started.elapsed())));
    if choice.regenerate && matches!(end, Some((ReplyStatus::Completed, _))) {
        outcome.regenerated = true;
        let started = Instant::now();
        let path = format!("/v1/replies/{task}/regenerate");
        let plain = Choice {
            lose: false,
            double_click: false,
            ..choice
        };
        let Some(again) = send(browser, &path, None, plain, &mut outcome).await else {
            if outcome.quota_refused == 0 {
                outcome.ends.push(None);
            }
            return outcome;
        };
        let end = browser.follow(again, started, &mut outcome).await;
        outcome
            .ends
            .push(end.map(|(status, _)| (status, started.elapsed())));
    }
    outcome
}

/// Folds the presses into the report (pure).
fn report_of(outcomes: &[PressOutcome]) -> BrowsersReport {
    let mut report = BrowsersReport {
        presses: outcomes.len(),
        ..BrowsersReport::default()
    };
    let mut latencies = Vec::new();
    let mut first_text = Vec::new();
    for o in outcomes {
        report.requests += o.requests;
        report.retries += o.retries;
        report.lost_answers += o.lost_answers;
        report.regenerates += usize::from(o.regenerated);
        report.answers_disagreeing += o.answers_disagreeing;
        report.replayed_answers += o.replayed_answers;
        report.stream_reconnects += o.stream_reconnects;
        report.quota_refused += o.quota_refused;
        report.streamed += o.first_text.len();
        report.deltas += o.deltas;
        report.deltas_out_of_order += o.deltas_out_of_order;
        report.streamed_text_mismatches += o.streamed_text_mismatches;
        first_text.extend(o.first_text.iter().map(|took| took.as_millis() as i64));
        for end in &o.ends {
            match end {
                Some((ReplyStatus::Completed, took)) => {
                    report.completed += 1;
                    latencies.push(took.as_millis() as i64);
                }
                Some((ReplyStatus::Failed, took)) => {
                    report.failed += 1;
                    latencies.push(took.as_millis() as i64);
                }
                Some((ReplyStatus::Cancelled, _)) => report.cancelled += 1,
                _ => report.unfinished += 1,
            }
        }
    }
    latencies.sort_unstable();
    report.e2e_ms_p50 = replyd::check::percentile(&latencies, 0.50);
    report.e2e_ms_p99 = replyd::check::percentile(&latencies, 0.99);
    report.e2e_ms_max = latencies.last().copied().unwrap_or(0);
    report.e2e_ms = latencies;
    first_text.sort_unstable();
    report.first_text_ms_p50 = replyd::check::percentile(&first_text, 0.50);
    report.first_text_ms_p99 = replyd::check::percentile(&first_text, 0.99);
    report
}

/// Runs the presses, `concurrency` at a time, and reports.
pub async fn run(args: &BrowsersArgs) -> anyhow::Result<BrowsersReport> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency.max(1))
        .build()?;
    let deadline = Instant::now() + Duration::from_secs(args.press_limit_s);
    let browsers: Vec<Arc<Browser>> = args
        .api
        .iter()
        .map(|api| {
            Arc::new(Browser {
                client: client.clone(),
                api: api.trim_end_matches('/').to_owned(),
                key: args.key.clone(),
                lose_timeout: Duration::from_millis(args.lose_timeout_ms.max(1)),
                deadline,
                directive: args
                    .reply_chars
                    .map(|chars| format!(" [mock:reply_chars={chars}]"))
                    .unwrap_or_default(),
            })
        })
        .collect();
    anyhow::ensure!(!browsers.is_empty(), "--api names no API");
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let choices: Vec<Choice> = (0..args.presses)
        .map(|n| Choice {
            n,
            lose: rng.f64() < args.lose_share,
            double_click: rng.f64() < args.double_click_share,
            regenerate: rng.f64() < args.regenerate_share,
        })
        .collect();
    let outcomes: Vec<PressOutcome> = stream::iter(choices)
        .map(|choice| {
            let browser = Arc::clone(&browsers[choice.n % browsers.len()]);
            async move { one_press(&browser, choice).await }
        })
        .buffer_unordered(args.concurrency.max(1))
        .collect()
        .await;
    Ok(report_of(&outcomes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_event_is_parsed_and_a_keep_alive_is_not() {
        let block = "event: status\nid: 17-completed\ndata: {\"task_id\":\"6a1f6516-799f-404e-aa06-616005e973de\",\"status\":\"completed\",\"reply\":\"r\",\"failure\":null,\"attempts\":1,\"max_attempts\":3,\"created_at\":\"2026-12-01T10:31:07.455834Z\",\"updated_at\":\"2026-12-01T10:31:07.455834Z\",\"finished_at\":null}\n\n";
        let (id, event) = parse_event(block).unwrap();
        assert_eq!(id, "17-completed");
        let StreamEvent::Status(view) = event else {
            panic!("{event:?}")
        };
        assert_eq!(view.status, ReplyStatus::Completed);
        assert_eq!(parse_event(":\n\n"), None);
    }

    #[test]
    fn a_delta_and_a_withdrawal_are_parsed() {
        let block = "event: delta\nid: live-2-5\ndata: {\"task_id\":\"6a1f6516-799f-404e-aa06-616005e973de\",\"assignment_version\":2,\"seq\":5,\"text\":\" and \\\"so\\\" on\"}\n\n";
        assert_eq!(
            parse_event(block),
            Some((
                "live-2-5".to_owned(),
                StreamEvent::Delta(Delta {
                    assignment_version: 2,
                    seq: 5,
                    text: " and \"so\" on".to_owned(),
                })
            ))
        );
        let block = "event: withdrawn\nid: withdrawn-2\ndata: {\"task_id\":\"6a1f6516-799f-404e-aa06-616005e973de\",\"assignment_version\":2,\"reason\":\"retrying\"}\n\n";
        assert_eq!(
            parse_event(block),
            Some(("withdrawn-2".to_owned(), StreamEvent::Withdrawn))
        );
        // A delta without its fields is nothing the browser can show.
        assert_eq!(
            parse_event("event: delta\nid: live-1-1\ndata: {\"seq\":1}\n\n"),
            None
        );
    }

    #[test]
    fn live_text_is_checked_piece_by_piece_against_the_saved_reply() {
        let delta = |assignment_version, seq, text: &str| Delta {
            assignment_version,
            seq,
            text: text.to_owned(),
        };
        let mut seen = LiveTextSeen::default();
        assert!(seen.append(delta(1, 1, "Hel")));
        assert!(seen.append(delta(1, 2, "lo")));
        assert!(seen.fits(Some("Hello, world")));
        assert!(!seen.fits(Some("Help")));
        // A gap, then a piece of a new attempt that does not start at 1.
        assert!(!seen.append(delta(1, 4, "!")));
        assert!(!seen.append(delta(2, 2, "x")));
        // After a withdrawal the next attempt's text starts from empty.
        seen.withdraw();
        assert!(seen.append(delta(3, 1, "Bye")));
        assert!(seen.fits(Some("Bye")));
        assert!(seen.fits(None));
    }

    #[test]
    fn the_report_counts_every_press_and_its_ends() {
        let ms = Duration::from_millis;
        let outcomes = [
            PressOutcome {
                requests: 2,
                retries: 1,
                lost_answers: 1,
                ends: vec![Some((ReplyStatus::Completed, ms(300)))],
                first_text: vec![ms(120)],
                deltas: 4,
                ..PressOutcome::default()
            },
            PressOutcome {
                requests: 2,
                regenerated: true,
                ends: vec![
                    Some((ReplyStatus::Completed, ms(100))),
                    Some((ReplyStatus::Failed, ms(200))),
                ],
                first_text: vec![ms(40), ms(90)],
                deltas: 7,
                deltas_out_of_order: 1,
                ..PressOutcome::default()
            },
            PressOutcome {
                requests: 1,
                ends: vec![None],
                ..PressOutcome::default()
            },
        ];
        let report = report_of(&outcomes);
        assert_eq!(
            (
                report.presses,
                report.requests,
                report.retries,
                report.lost_answers
            ),
            (3, 5, 1, 1)
        );
        assert_eq!(
            (
                report.regenerates,
                report.completed,
                report.failed,
                report.unfinished
            ),
            (1, 2, 1, 1)
        );
        assert_eq!(
            (report.e2e_ms_p50, report.e2e_ms_p99, report.e2e_ms_max),
            (200, 300, 300)
        );
        assert_eq!(
            (
                report.streamed,
                report.deltas,
                report.deltas_out_of_order,
                report.first_text_ms_p50,
                report.first_text_ms_p99
            ),
            (3, 11, 1, 90, 120)
        );
        assert!(
            report
                .summary_line()
                .ends_with("e2e_ms_p50=200 e2e_ms_p99=300 streamed=3 deltas=11 deltas_out_of_order=1 streamed_text_mismatches=0 first_text_ms_p50=90 first_text_ms_p99=120"),
            "{}",
            report.summary_line()
        );
    }
}
