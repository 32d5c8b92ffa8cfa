//! A conversation through the API: read page by page while others write, its messages with
//! their regenerated replies, bad pages as problems, and erased.

use std::time::Duration;

use super::{key_for, start};
use crate::helpers::api::Api;
use replyd::api::reply_view::Accepted;
use reqwest::StatusCode;
use serde_json::{Value, json};

/// One page of conversation `conversation`, as `key`'s workspace sees it.
async fn page(api: &Api, key: &str, conversation: &str, query: &str) -> (StatusCode, Value) {
    let response = api
        .client
        .get(format!(
            "{}/v1/conversations/{conversation}/messages{query}",
            api.base
        ))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    (response.status(), response.json().await.unwrap())
}

async fn press_in(api: &Api, conversation: &str, key: &str, message: &str) -> Accepted {
    let response = api
        .client
        .post(format!("{}/v1/replies", api.base))
        .bearer_auth(&api.key)
        .header("Idempotency-Key", key)
        .json(&json!({"conversation_id": conversation, "message": message}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    response.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_read_page_by_page_while_others_write_shows_each_message_once_in_order() {
    let api = start().await;
    let api = std::sync::Arc::new(api);
    // Four writers press 15 messages each into one conversation while a reader pages.
    let mut writers = Vec::new();
    for w in 0..4 {
        let api = std::sync::Arc::clone(&api);
        writers.push(tokio::spawn(async move {
            let mut tasks = Vec::new();
            for i in 0..15 {
                let accepted = press_in(
                    &api,
                    "busy",
                    &format!("w{w}-{i}"),
                    &format!("writer {w}, {i}"),
                )
                .await;
                tasks.push(accepted.task_id.to_string());
            }
            tasks
        }));
    }
    let mut seen: Vec<String> = Vec::new();
    let mut cursor: Option<String> = None;
    let mut writing = true;
    let mut pages = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the reader did not reach the end in 120 s: {} seen, writing: {writing}",
            seen.len()
        );
        if writing && writers.iter().all(|w| w.is_finished()) {
            writing = false;
        }
        let query = match &cursor {
            Some(c) => format!("?limit=7&after={c}"),
            None => "?limit=7".into(),
        };
        let (status, body) = page(&api, &api.key, "busy", &query).await;
        if status == StatusCode::NOT_FOUND {
            // No message committed yet: the conversation is made by its first.
            continue;
        }
        assert_eq!(status, StatusCode::OK, "{body}");
        pages += 1;
        for message in body["messages"].as_array().unwrap() {
            let replies = message["replies"].as_array().unwrap();
            assert_eq!(replies.len(), 1, "{message}");
            seen.push(replies[0]["task_id"].as_str().unwrap().to_owned());
        }
        cursor = body["next_cursor"].as_str().map(str::to_owned).or(cursor);
        // Past the last write, read to the end once more.
        if !writing && !body["has_more"].as_bool().unwrap() {
            break;
        }
    }
    let mut pressed: Vec<String> = Vec::new();
    for writer in writers {
        pressed.extend(writer.await.unwrap());
    }
    let distinct: std::collections::BTreeSet<&String> = seen.iter().collect();
    assert_eq!(
        distinct.len(),
        seen.len(),
        "a message shown twice: {seen:?}"
    );
    let pressed: std::collections::BTreeSet<&String> = pressed.iter().collect();
    assert_eq!(distinct, pressed, "a message skipped");
    assert!(pages >= 9, "{pages} pages");
    // Each writer's messages are listed in the order it wrote them.
    let content_order: Vec<String> = {
        let mut all = Vec::new();
        let mut after = String::new();
        loop {
            let (_, body) = page(&api, &api.key, "busy", &format!("?limit=100{after}")).await;
            for m in body["messages"].as_array().unwrap() {
                all.push(m["content"].as_str().unwrap().to_owned());
            }
            if !body["has_more"].as_bool().unwrap() {
                break;
            }
            after = format!("&after={}", body["next_cursor"].as_str().unwrap());
        }
        all
    };
    for w in 0..4 {
        let mine: Vec<&String> = content_order
            .iter()
            .filter(|c| c.starts_with(&format!("writer {w},")))
            .collect();
        let expected: Vec<String> = (0..15).map(|i| format!("writer {w}, {i}")).collect();
        assert_eq!(mine, expected.iter().collect::<Vec<_>>());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_message_shows_its_regenerated_replies_and_a_bad_page_is_a_problem() {
    let api = start().await;
    let first = press_in(&api, "conv-a", "a-1", "What are the key decisions?").await;
    let second = press_in(&api, "conv-a", "a-2", "And the risks?").await;
    let third = press_in(&api, "conv-a", "a-3", "Who decided?").await;
    let regenerated: Accepted = api
        .client
        .post(format!(
            "{}/v1/replies/{}/regenerate",
            api.base, first.task_id
        ))
        .bearer_auth(&api.key)
        .header("Idempotency-Key", "a-1-again")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();

    let (status, one) = page(&api, &api.key, "conv-a", "?limit=2").await;
    assert_eq!(status, StatusCode::OK, "{one}");
    assert_eq!(one["conversation_id"], "conv-a");
    assert_eq!(one["has_more"], true);
    let messages = one["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0]["content"], "What are the key decisions?");
    let replies: Vec<&str> = messages[0]["replies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["task_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        replies,
        [first.task_id.to_string(), regenerated.task_id.to_string()],
        "the reply, then the regenerated one"
    );
    assert_eq!(messages[0]["replies"][0]["status"], "pending");
    assert_eq!(
        messages[1]["replies"][0]["task_id"],
        second.task_id.to_string()
    );
    let next = one["next_cursor"].as_str().unwrap();
    let (_, two) = page(&api, &api.key, "conv-a", &format!("?limit=2&after={next}")).await;
    assert_eq!(two["has_more"], false);
    assert_eq!(
        two["messages"][0]["replies"][0]["task_id"],
        third.task_id.to_string()
    );
    // Past the newest: an empty page that keeps the cursor, for what comes next.
    let last = two["next_cursor"].as_str().unwrap();
    let (_, three) = page(&api, &api.key, "conv-a", &format!("?after={last}")).await;
    assert_eq!(three["messages"], json!([]));
    assert_eq!(three["next_cursor"], last);
    let fourth = press_in(&api, "conv-a", "a-4", "Anything else?").await;
    let (_, four) = page(&api, &api.key, "conv-a", &format!("?after={last}")).await;
    assert_eq!(
        four["messages"][0]["replies"][0]["task_id"],
        fourth.task_id.to_string()
    );

    // A message written as the previous release's intake writes it (no number given): the
    // insert numbers it, so it is listed after the others.
    let old_release = uuid::Uuid::new_v4();
    api.db
        .raw_client()
        .await
        .execute(
            "INSERT INTO messages (message_id, workspace_id, conversation_id, content) \
             VALUES ($1, 'acme', 'conv-a', 'From the previous release')",
            &[&old_release],
        )
        .await
        .unwrap();
    let (_, five) = page(&api, &api.key, "conv-a", &format!("?after={last}")).await;
    let contents: Vec<&str> = five["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["Anything else?", "From the previous release"]);

    // Another workspace's key, and a conversation nobody wrote to: exactly as absent.
    let other = key_for(&api.db, "globex").await;
    let (status, problem) = page(&api, &other, "conv-a", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{problem}");
    let (status, _) = page(&api, &api.key, "never-written", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // Pages the API cannot give: problems naming the parameter.
    for query in [
        "?after=42",
        "?after=c2VxOi0x",
        "?limit=0",
        "?limit=101",
        "?limit=ten",
    ] {
        let (status, problem) = page(&api, &api.key, "conv-a", query).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {problem}");
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("/invalid_query"),
            "{query}: {problem}"
        );
    }
}

async fn erase_conversation(api: &Api, key: &str, conversation: &str) -> (StatusCode, Value) {
    let response = api
        .client
        .delete(format!("{}/v1/conversations/{conversation}", api.base))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    (response.status(), response.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_erased_through_the_api_is_gone_refuses_new_messages_and_erases_again_as_nothing()
 {
    let api = start().await;
    let first = press_in(&api, "to-erase", "e-1", "Forget this").await;
    press_in(&api, "to-erase", "e-2", "And this").await;
    let kept = press_in(&api, "to-keep", "k-1", "Keep this").await;
    let other = key_for(&api.db, "globex").await;

    // Another workspace's key, and a conversation nobody wrote to: exactly as absent.
    assert_eq!(
        erase_conversation(&api, &other, "to-erase").await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        erase_conversation(&api, &api.key, "never-written").await.0,
        StatusCode::NOT_FOUND
    );

    let (status, erased) = erase_conversation(&api, &api.key, "to-erase").await;
    assert_eq!(status, StatusCode::OK, "{erased}");
    assert_eq!(
        erased,
        json!({"conversation_id": "to-erase", "tasks": 2, "messages": 2, "ended": 2})
    );
    assert!(api.db.store.is_forgotten(first.task_id).await.unwrap());
    let (status, _) = page(&api, &api.key, "to-erase", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let shown = api
        .client
        .get(format!("{}{}", api.base, first.status_url))
        .bearer_auth(&api.key)
        .send()
        .await
        .unwrap();
    assert_eq!(shown.status(), StatusCode::NOT_FOUND);
    let refused = api
        .client
        .post(format!("{}/v1/replies", api.base))
        .bearer_auth(&api.key)
        .header("Idempotency-Key", "e-3")
        .json(&json!({"conversation_id": "to-erase", "message": "Hello again"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::GONE);

    // Again: nothing left to delete, the same answer.
    let (status, again) = erase_conversation(&api, &api.key, "to-erase").await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(
        again,
        json!({"conversation_id": "to-erase", "tasks": 0, "messages": 0, "ended": 0})
    );
    // The other conversation is untouched.
    let (status, listed) = page(&api, &api.key, "to-keep", "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        listed["messages"][0]["replies"][0]["task_id"],
        kept.task_id.to_string()
    );
}
