//! A conversation's history at intake: a new message's task is asked with the earlier
//! messages and the replies the user kept, fixed when the task is created (read back from the
//! task itself), bound to its key by `kept_replies` only, so a replay after another turn is the
//! same task; a regenerate answers with its source's history; the budget drops the oldest
//! turns whole. Real worker and relay processes, the broker, PostgreSQL, the mock over HTTP.

use std::time::Duration;

use replyd::api::reply_view::{Accepted, ReplyStatus};
use replyd::api::settings::ApiSettings;
use replyd_core::domain::Role;
use replyd_lab::mock_provider::MockSettings;
use serde_json::{Value, json};

use crate::helpers::api::{self, Front};
use crate::helpers::app::{TestApp, WorkerConfig};

/// The messages the task's provider request holds, as (role, text), read from the task.
async fn asked(app: &TestApp, task: &Accepted) -> Vec<(Role, String)> {
    let stored = app.db.store.read(task.task_id).await.unwrap().unwrap();
    stored
        .spec
        .request
        .messages
        .into_iter()
        .map(|m| (m.role, m.content))
        .collect()
}

/// Sends `message` in conversation `c1` under `key`, with `kept` replies if any; waits for its
/// reply and returns the task and the reply.
async fn turn(front: &Front, key: &str, message: &str, kept: &[&Accepted]) -> (Accepted, String) {
    let response = front.post_body("acme", key, &body(message, kept)).await;
    assert_eq!(response.status(), 202, "{}", response.text().await.unwrap());
    let accepted: Accepted = response.json().await.unwrap();
    (accepted.clone(), reply_of(front, &accepted).await)
}

fn body(message: &str, kept: &[&Accepted]) -> Value {
    let mut body = json!({"conversation_id": "c1", "message": message, "document_version": "v2"});
    if !kept.is_empty() {
        body["kept_replies"] = kept.iter().map(|t| json!(t.task_id)).collect();
    }
    body
}

async fn reply_of(front: &Front, task: &Accepted) -> String {
    front.wait_until("acme", task, ReplyStatus::Completed).await;
    front.view("acme", task).await.reply.unwrap()
}

fn user(text: &str) -> (Role, String) {
    (Role::User, text.to_owned())
}

fn assistant(text: &str) -> (Role, String) {
    (Role::Assistant, text.to_owned())
}

/// A refusal's problem: its status, `type` and `fields`.
async fn problem(response: reqwest::Response) -> (u16, String, Vec<String>) {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    let fields = body["fields"]
        .as_array()
        .map(|f| f.iter().map(|v| v.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default();
    (status, body["type"].as_str().unwrap().to_owned(), fields)
}

async fn messages_in_c1(app: &TestApp) -> i64 {
    let client = app.db.raw_client().await;
    client
        .query_one(
            "SELECT count(*) FROM messages WHERE conversation_id = 'c1'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_task_is_asked_with_the_conversation_up_to_its_message_as_it_was_when_created() {
    let mock = MockSettings {
        latency_ms: 20,
        ..MockSettings::default()
    };
    let app = TestApp::start(2, mock, WorkerConfig::default()).await;
    let front = api::front(&app.db.store, &["acme"]).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");

    let (first, reply1) = turn(&front, "k1", "What are the key decisions?", &[]).await;
    assert_eq!(
        asked(&app, &first).await,
        [user("What are the key decisions?")]
    );
    let (second, reply2) = turn(&front, "k2", "Which one is the riskiest?", &[]).await;
    // The user regenerates the second answer, then keeps the first of the two.
    let again = front.regenerate("acme", &second).await;
    let reply2b = reply_of(&front, &again).await;
    assert_ne!(reply2, reply2b);
    assert_eq!(
        asked(&app, &again).await,
        asked(&app, &second).await,
        "a regenerate is asked as its source was"
    );

    // The third turn: the first two messages with the replies shown, read back from the task.
    let third_body = body("Summarise it in one line.", &[&second]);
    let (third, reply3) = turn(&front, "k3", "Summarise it in one line.", &[&second]).await;
    let third_asked = vec![
        user("What are the key decisions?"),
        assistant(&reply1),
        user("Which one is the riskiest?"),
        assistant(&reply2),
        user("Summarise it in one line."),
    ];
    assert_eq!(asked(&app, &third).await, third_asked);

    // Unnamed, an earlier message comes with its newest reply: the regenerated one.
    let (fourth, reply4) = turn(&front, "k4", "And the second riskiest?", &[]).await;
    assert_eq!(
        asked(&app, &fourth).await[..6],
        [
            user("What are the key decisions?"),
            assistant(&reply1),
            user("Which one is the riskiest?"),
            assistant(&reply2b),
            user("Summarise it in one line."),
            assistant(&reply3),
        ]
    );

    // A replay of the third press after the fourth turn is the same task, asked as before.
    let replay = front.post_body("acme", "k3", &third_body).await;
    assert_eq!(replay.status(), 202);
    let replayed: Accepted = replay.json().await.unwrap();
    assert_eq!((replayed.task_id, replayed.replayed), (third.task_id, true));
    assert_eq!(asked(&app, &third).await, third_asked);
    // The same key with another choice of kept replies is another request.
    let other_choice = body("Summarise it in one line.", &[&again]);
    assert_eq!(
        problem(front.post_body("acme", "k3", &other_choice).await).await,
        (
            422,
            "https://replyd.dev/problems/idempotency_key_reused".to_owned(),
            vec!["kept_replies".to_owned()]
        )
    );

    // kept_replies naming no earlier reply, one twice, or two replies to one message: a 422
    // naming the field, and nothing written.
    let before = messages_in_c1(&app).await;
    let stranger = Accepted {
        task_id: replyd_core::domain::TaskId::new_random(),
        ..first.clone()
    };
    for (n, kept) in [vec![&stranger], vec![&first, &first], vec![&second, &again]]
        .into_iter()
        .enumerate()
    {
        let refused = front
            .post_body("acme", &format!("bad-{n}"), &body("Any more?", &kept))
            .await;
        let (status, kind, fields) = problem(refused).await;
        assert_eq!(
            (status, kind.as_str(), fields.as_slice()),
            (
                422,
                "https://replyd.dev/problems/invalid_body",
                ["kept_replies".to_owned()].as_slice()
            ),
            "{kept:?}"
        );
    }
    assert_eq!(messages_in_c1(&app).await, before);

    // A regenerate of the third answer is asked with the third's history, not the fourth's.
    let third_again = front.regenerate("acme", &third).await;
    assert_eq!(asked(&app, &third_again).await, third_asked);
    reply_of(&front, &third_again).await;

    // A budget that holds the newest turn only (its bytes and two messages' framing): the
    // older ones are dropped whole.
    let last = "And the second riskiest?".len() + reply4.len();
    let tight = front
        .beside(
            &app.db.store,
            ApiSettings {
                history_max_tokens: u32::try_from(last + 16).unwrap(),
                ..ApiSettings::default()
            },
        )
        .await;
    let response = tight.post_body("acme", "k5", &body("One more?", &[])).await;
    assert_eq!(response.status(), 202);
    let fifth: Accepted = response.json().await.unwrap();
    assert_eq!(
        asked(&app, &fifth).await,
        [
            user("And the second riskiest?"),
            assistant(&reply4),
            user("One more?"),
        ]
    );
    // Off: each message alone.
    let off = front
        .beside(
            &app.db.store,
            ApiSettings {
                history_max_tokens: 0,
                ..ApiSettings::default()
            },
        )
        .await;
    let response = off.post_body("acme", "k6", &body("Alone?", &[])).await;
    let sixth: Accepted = response.json().await.unwrap();
    assert_eq!(asked(&app, &sixth).await, [user("Alone?")]);
    reply_of(&front, &fifth).await;
    reply_of(&front, &sixth).await;

    app.wait_until_committed_to_end(Duration::from_secs(120))
        .await;
    let report = app.check().await;
    assert!(report.violations.is_empty(), "{report:?}");
    assert_eq!(report.completed, 8);
}
