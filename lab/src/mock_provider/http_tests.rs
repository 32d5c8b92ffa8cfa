//! Streamed answers over real HTTP: each dialect's events read by a client to their end, a
//! cut or stalled stream, the in-stream errors, a background response's stream resumed after
//! its last event, and when a stream's parts arrive. Beside the server rather than inside
//! `sse`, which the server uses.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::mock_provider::{FaultSettings, LimitSettings, MockHandle, MockSettings, spawn};

/// A reply long enough for several deltas of the default 12 characters.
const LONG: &str = "[mock:reply_chars=100] tell me";

async fn mock(settings: MockSettings) -> MockHandle {
    spawn(settings, "127.0.0.1:0".parse().unwrap())
        .await
        .expect("the mock starts")
}

async fn set_faults(mock: &MockHandle, faults: &FaultSettings) {
    let answer = reqwest::Client::new()
        .put(format!("{}/faults", mock.base_url()))
        .json(faults)
        .send()
        .await
        .unwrap();
    assert!(answer.status().is_success(), "{answer:?}");
}

/// One parsed server-sent event: its `event:` name, if any, and its `data:`.
#[derive(Debug)]
struct Sse {
    name: Option<String>,
    data: String,
}

impl Sse {
    fn json(&self) -> Value {
        serde_json::from_str(&self.data).expect("JSON data")
    }
}

/// Reads a streamed body to its end: its events, and whether it ended cleanly (`false`:
/// the connection broke).
async fn read_stream(mut answer: reqwest::Response) -> (Vec<Sse>, bool) {
    let mut body = Vec::new();
    let clean = loop {
        match answer.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            Ok(None) => break true,
            Err(_) => break false,
        }
    };
    let text = String::from_utf8(body).expect("UTF-8");
    let events = text
        .split("\n\n")
        .filter(|block| !block.is_empty())
        .map(parse_event)
        .collect();
    assert!(
        text.is_empty() || text.ends_with("\n\n") || !clean,
        "{text:?}"
    );
    (events, clean)
}

/// One event's block (its lines, without the blank line that ends it).
fn parse_event(block: &str) -> Sse {
    let mut name = None;
    let mut data = None;
    for line in block.lines() {
        if let Some(value) = line.strip_prefix("event: ") {
            name = Some(value.to_owned());
        } else if let Some(value) = line.strip_prefix("data: ") {
            data = Some(value.to_owned());
        } else {
            panic!("not an SSE line: {line:?}");
        }
    }
    Sse {
        name,
        data: data.expect("every event has data"),
    }
}

/// A stream read as it arrives: each event with when it arrived after `started`, and when the
/// body ended cleanly.
async fn read_timed(
    mut answer: reqwest::Response,
    started: Instant,
) -> (Vec<(Duration, Sse)>, Duration) {
    let mut events = Vec::new();
    let mut pending = String::new();
    while let Some(chunk) = answer.chunk().await.expect("the stream runs to its end") {
        let arrived = started.elapsed();
        pending.push_str(std::str::from_utf8(&chunk).expect("UTF-8 chunks"));
        while let Some(end) = pending.find("\n\n") {
            events.push((arrived, parse_event(&pending[..end])));
            pending.drain(..end + 2);
        }
    }
    assert!(pending.is_empty(), "an unfinished event: {pending:?}");
    (events, started.elapsed())
}

/// When a stream's first and last text deltas arrived (`is_delta` tells them), and when it
/// ended, against the `latency` it was asked to take in all: the first well before the end,
/// the last in its second half, the end at about the latency. Bounds on order and share only:
/// the machine may be slow, never early.
fn assert_paced_over(
    what: &str,
    latency: Duration,
    events: &[(Duration, Sse)],
    end: Duration,
    is_delta: impl Fn(&Sse) -> bool,
) {
    let deltas: Vec<Duration> = events
        .iter()
        .filter(|(_, event)| is_delta(event))
        .map(|(arrived, _)| *arrived)
        .collect();
    assert!(deltas.len() >= 5, "{what}: {} deltas", deltas.len());
    let (first, last) = (deltas[0], deltas[deltas.len() - 1]);
    assert!(
        first < latency.mul_f64(0.6),
        "{what}: the first delta came at {first:?} of {latency:?}"
    );
    assert!(
        last >= latency / 2,
        "{what}: the deltas were not spread, the last came at {last:?} of {latency:?}"
    );
    assert!(
        end >= latency.mul_f64(0.9),
        "{what}: the stream ended at {end:?}, before its latency {latency:?}"
    );
    assert!(
        first < last && last <= end,
        "{what}: {first:?} {last:?} {end:?}"
    );
}

async fn chat(mock: &MockHandle, key: Option<&str>, body: Value) -> reqwest::Response {
    let mut request = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", mock.base_url()))
        .json(&body);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request.send().await.unwrap()
}

fn chat_body(stream: bool, include_usage: bool) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": LONG}]});
    if stream {
        body["stream"] = json!(true);
    }
    if include_usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

fn chat_text(events: &[Sse]) -> String {
    events
        .iter()
        .filter(|e| e.data != "[DONE]")
        .filter_map(|e| {
            e.json()["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

#[tokio::test]
async fn a_chat_stream_tells_the_reply_a_whole_answer_tells_and_ends_with_done() {
    let mock = mock(MockSettings {
        honour_idempotency_key: true,
        limits: LimitSettings {
            requests_per_minute: Some(6000),
            ..LimitSettings::default()
        },
        ..MockSettings::default()
    })
    .await;
    let whole: Value = chat(&mock, Some("k"), chat_body(false, false))
        .await
        .json()
        .await
        .unwrap();
    let text = whole["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(text.chars().count(), 100);
    assert!(text.ends_with(" [generation 1]"), "{text}");

    let answer = chat(&mock, Some("k"), chat_body(true, true)).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(
        answer.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    assert!(answer.headers().contains_key("x-ratelimit-limit-requests"));
    let (events, clean) = read_stream(answer).await;
    assert!(clean);
    assert_eq!(
        chat_text(&events),
        text,
        "the replay streams the stored reply"
    );
    assert_eq!(
        events[0].json()["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let n = events.len();
    assert_eq!(events[n - 1].data, "[DONE]");
    let usage = events[n - 2].json();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"], whole["usage"]);
    assert_eq!(events[n - 3].json()["choices"][0]["finish_reason"], "stop");
    assert!(events[..n - 2].iter().all(|e| e.json()["usage"].is_null()));
    assert!(events.iter().all(|e| e.name.is_none()));

    let (fresh, _) = read_stream(chat(&mock, None, chat_body(true, false)).await).await;
    assert!(chat_text(&fresh).ends_with(" [generation 2]"));
    assert!(
        fresh[..fresh.len() - 1]
            .iter()
            .all(|e| e.json().get("usage").is_none()),
        "no usage unless asked"
    );
    let stats = mock.stats();
    assert_eq!(stats.generations, 2);
    assert_eq!((stats.streams_started, stats.streams_completed), (2, 2));
    assert_eq!(stats.in_flight, 0);
    assert_eq!(stats.cancelled, 0);

    let refused = chat(
        &mock,
        None,
        json!({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(refused.status(), 400);
}

#[tokio::test]
async fn a_cut_chat_stream_breaks_after_its_deltas_without_done_and_a_stall_waits_first() {
    let mock = mock(MockSettings::default()).await;
    set_faults(
        &mock,
        &FaultSettings {
            stream_cut_rate: 1.0,
            stream_fault_after_chunks: 2,
            ..FaultSettings::default()
        },
    )
    .await;
    let whole = chat(&mock, None, chat_body(false, false)).await;
    assert_eq!(whole.status(), 200, "a whole answer draws no stream fault");
    let (events, clean) = read_stream(chat(&mock, None, chat_body(true, true)).await).await;
    assert!(!clean, "the connection is cut");
    assert_eq!(events.len(), 3, "the role and two deltas: {events:?}");
    assert!(events.iter().all(|e| e.data != "[DONE]"));
    let stats = mock.stats();
    assert_eq!((stats.streams_cut, stats.generations), (1, 2));

    set_faults(
        &mock,
        &FaultSettings {
            stream_stall_rate: 1.0,
            stream_fault_after_chunks: 1,
            hang_ms: 300,
            ..FaultSettings::default()
        },
    )
    .await;
    let started = std::time::Instant::now();
    let (events, clean) = read_stream(chat(&mock, None, chat_body(true, false)).await).await;
    assert!(!clean);
    assert_eq!(events.len(), 2);
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));
    assert_eq!(mock.stats().streams_stalled, 1);
}

async fn message(mock: &MockHandle, stream: bool) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}/v1/messages", mock.base_url()))
        .header("x-api-key", "k")
        .header("anthropic-version", "2023-06-01")
        .json(&json!({
            "model": "claude-x",
            "max_tokens": 64,
            "stream": stream,
            "messages": [{"role": "user", "content": LONG}],
        }))
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_messages_stream_follows_anthropics_order_and_an_error_closes_it() {
    let mock = mock(MockSettings::default()).await;
    let (events, clean) = read_stream(message(&mock, true).await).await;
    assert!(clean);
    let names: Vec<&str> = events.iter().map(|e| e.name.as_deref().unwrap()).collect();
    let deltas = names.len() - 6;
    assert_eq!(names[..3], ["message_start", "content_block_start", "ping"]);
    assert!(
        names[3..3 + deltas]
            .iter()
            .all(|n| *n == "content_block_delta")
    );
    assert_eq!(
        names[3 + deltas..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    let text: String = events[3..3 + deltas]
        .iter()
        .map(|e| e.json()["delta"]["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text.chars().count(), 100);
    assert!(text.ends_with(" [generation 1]"));
    assert_eq!(
        events[0].json()["message"]["id"],
        "msg_mock_1",
        "{:?}",
        events[0]
    );

    set_faults(
        &mock,
        &FaultSettings {
            stream_error_rate: 1.0,
            error_status: 529,
            ..FaultSettings::default()
        },
    )
    .await;
    let whole: Value = message(&mock, false).await.json().await.unwrap();
    assert_eq!(whole["type"], "message");
    let (events, clean) = read_stream(message(&mock, true).await).await;
    assert!(clean, "an error event, then the stream closes");
    let last = events.last().unwrap();
    assert_eq!(last.name.as_deref(), Some("error"));
    assert_eq!(
        last.json(),
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| e.name.as_deref() == Some("content_block_delta"))
            .count(),
        3
    );
    let stats = mock.stats();
    assert_eq!((stats.streams_errored, stats.generations), (1, 3));
}

async fn create_streamed(mock: &MockHandle, stream: bool) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}/v1/responses", mock.base_url()))
        .json(&json!({
            "model": "m",
            "background": true,
            "stream": stream,
            "input": [{"role": "user", "content": LONG}],
        }))
        .send()
        .await
        .unwrap()
}

async fn retrieve(mock: &MockHandle, id: &str, query: &str) -> reqwest::Response {
    reqwest::get(format!("{}/v1/responses/{id}{query}", mock.base_url()))
        .await
        .unwrap()
}

fn sequence(event: &Sse) -> u64 {
    event.json()["sequence_number"].as_u64().unwrap()
}

fn response_text(events: &[Sse]) -> String {
    events
        .iter()
        .filter(|e| e.name.as_deref() == Some("response.output_text.delta"))
        .map(|e| e.json()["delta"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn a_cut_background_stream_is_resumed_after_its_last_event_and_loses_nothing() {
    // At a fixed interval, so the response is still generating when the resume comes.
    let mock = mock(MockSettings {
        stream_chunk_interval_ms: Some(5),
        ..MockSettings::default()
    })
    .await;
    set_faults(
        &mock,
        &FaultSettings {
            stream_cut_rate: 1.0,
            stream_fault_after_chunks: 2,
            ..FaultSettings::default()
        },
    )
    .await;
    let (first, clean) = read_stream(create_streamed(&mock, true).await).await;
    assert!(!clean);
    set_faults(&mock, &FaultSettings::default()).await;
    assert_eq!(first[0].name.as_deref(), Some("response.created"));
    let created = first[0].json();
    assert_eq!(created["response"]["status"], "queued");
    let id = created["response"]["id"].as_str().unwrap().to_owned();
    for (n, event) in first.iter().enumerate() {
        assert_eq!(sequence(event), n as u64);
    }
    let last = sequence(first.last().unwrap());

    let resumed = retrieve(&mock, &id, &format!("?stream=true&starting_after={last}")).await;
    assert_eq!(resumed.status(), 200);
    let (rest, clean) = read_stream(resumed).await;
    assert!(clean);
    assert_eq!(sequence(&rest[0]), last + 1);
    let end = rest.last().unwrap();
    assert_eq!(end.name.as_deref(), Some("response.completed"));

    let text = response_text(&first) + &response_text(&rest);
    let whole: Value = retrieve(&mock, &id, "").await.json().await.unwrap();
    assert_eq!(whole["status"], "completed");
    assert_eq!(whole["output"][0]["content"][0]["text"], text.as_str());
    assert_eq!(end.json()["response"], whole);
    assert!(text.ends_with(" [generation 1]"), "{text}");

    let (replayed, _) = read_stream(retrieve(&mock, &id, "?stream=true").await).await;
    assert_eq!(
        replayed.len() as u64,
        sequence(end) + 1,
        "every event again"
    );
    let stats = mock.stats();
    assert_eq!(stats.generations, 1);
    assert_eq!(
        (
            stats.streams_started,
            stats.streams_cut,
            stats.streams_completed
        ),
        (3, 1, 2)
    );
}

#[tokio::test]
async fn a_stream_error_fails_the_response_and_a_plain_one_cannot_be_streamed() {
    let mock = mock(MockSettings::default()).await;
    set_faults(
        &mock,
        &FaultSettings {
            stream_error_rate: 1.0,
            stream_fault_after_chunks: 1,
            ..FaultSettings::default()
        },
    )
    .await;
    let (events, clean) = read_stream(create_streamed(&mock, true).await).await;
    assert!(clean);
    let end = events.last().unwrap();
    assert_eq!(end.name.as_deref(), Some("response.failed"));
    assert_eq!(end.json()["response"]["status"], "failed");
    assert_eq!(response_text(&events).chars().count(), 12);
    assert_eq!(mock.stats().streams_errored, 1);

    let plain: Value = create_streamed(&mock, false).await.json().await.unwrap();
    let id = plain["id"].as_str().unwrap();
    let refused = retrieve(&mock, id, "?stream=true").await;
    assert_eq!(refused.status(), 400);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not created with stream=true")
    );
    assert_eq!(
        retrieve(&mock, "resp_404", "?stream=true").await.status(),
        404
    );
}

/// A stream takes its generation's latency in all, as an answer sent whole does: its first
/// delta a quarter in, its deltas spread over the rest, its close at the latency. In each
/// dialect, the latency from the settings or from the prompt's directive.
#[tokio::test]
async fn a_stream_takes_its_latency_in_all_and_its_first_delta_comes_well_before_its_end() {
    let latency = Duration::from_millis(400);
    let mock = mock(MockSettings {
        latency_ms: 400,
        ..MockSettings::default()
    })
    .await;

    let started = Instant::now();
    let (events, end) = read_timed(chat(&mock, None, chat_body(true, true)).await, started).await;
    assert_eq!(events.last().unwrap().1.data, "[DONE]");
    assert_paced_over("chat", latency, &events, end, |e| {
        e.data != "[DONE]"
            && e.json()["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|text| !text.is_empty())
    });

    let started = Instant::now();
    let (events, end) = read_timed(message(&mock, true).await, started).await;
    assert_eq!(
        events.last().unwrap().1.name.as_deref(),
        Some("message_stop")
    );
    assert_paced_over("messages", latency, &events, end, |e| {
        e.name.as_deref() == Some("content_block_delta")
    });

    // The directive's latency, longer than the settings', is the whole stream's too.
    let longer = Duration::from_millis(700);
    let started = Instant::now();
    let created = reqwest::Client::new()
        .post(format!("{}/v1/responses", mock.base_url()))
        .json(&json!({
            "model": "m",
            "background": true,
            "stream": true,
            "input": [{"role": "user", "content": format!("[mock:latency_ms=700] {LONG}")}],
        }))
        .send()
        .await
        .unwrap();
    let (events, end) = read_timed(created, started).await;
    assert_eq!(
        events.last().unwrap().1.name.as_deref(),
        Some("response.completed")
    );
    assert_paced_over("background response", longer, &events, end, |e| {
        e.name.as_deref() == Some("response.output_text.delta")
    });

    let stats = mock.stats();
    assert_eq!(stats.generations, 3);
    assert_eq!((stats.streams_started, stats.streams_completed), (3, 3));
}

#[tokio::test]
async fn at_a_fixed_interval_headers_go_at_once_the_first_delta_after_the_latency_and_a_client_that_leaves_still_costs_a_generation()
 {
    let mock = mock(MockSettings {
        stream_chunk_interval_ms: Some(20),
        ..MockSettings::default()
    })
    .await;
    let started = std::time::Instant::now();
    let body = json!({
        "messages": [{"role": "user", "content": "[mock:latency_ms=300] [mock:reply_chars=2000]"}],
        "stream": true,
    });
    let mut answer = chat(&mock, None, body).await;
    assert!(started.elapsed() < std::time::Duration::from_millis(300));
    let first = answer.chunk().await.unwrap().expect("a first event");
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));
    assert!(first.starts_with(b"data: "));
    drop(answer);

    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while mock.stats().in_flight > 0 {
        assert!(std::time::Instant::now() < deadline, "{:?}", mock.stats());
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let stats = mock.stats();
    assert_eq!(stats.generations, 1);
    assert_eq!(stats.cancelled, 1, "the client left before the end");
    assert_eq!(stats.streams_started, 1);
    assert_eq!(
        stats.streams_completed + stats.streams_cut + stats.streams_errored,
        0
    );
}
