//! A transaction's status changes announced together at its commit (V32), in payloads under
//! NOTIFY's limit.

use std::time::Duration;

use crate::helpers::{TestDb, task_spec};
use replyd_core::domain::TaskStatus;

/// A transaction's status changes go out together at its commit (V32): notifications of
/// `<task_id> <status>` lines, each under NOTIFY's 8,000 bytes, and none for a statement that
/// changes no status. A batch of claims (one statement per task) or of completions is one
/// transaction, so it wakes every listening session once, not once per task.
#[tokio::test]
async fn a_transaction_notifies_its_status_changes_together() {
    use replyd::store::listen::{TASK_STATUS_CHANNEL, parse_status_payloads};

    let db = TestDb::new().await;
    let mut tasks = Vec::new();
    for _ in 0..310 {
        let spec = task_spec(3);
        db.store
            .claim_task(
                spec.task_id,
                "w-1",
                Duration::from_secs(30),
                Some(&spec),
                None,
            )
            .await
            .unwrap();
        tasks.push(spec.task_id.as_uuid());
    }
    let sentinel = task_spec(3);
    db.store
        .claim_task(
            sentinel.task_id,
            "w-1",
            Duration::from_secs(30),
            Some(&sentinel),
            None,
        )
        .await
        .unwrap();

    // Other tests' schemas notify on the same channel: only this test's tasks count.
    let (mut rx, _listening) = crate::helpers::hear(&db.settings, TASK_STATUS_CHANNEL).await;

    let mut client = db.raw_client().await;
    // 300 in one statement; 10 in a transaction of one statement each.
    let (many, few) = tasks.split_at(300);
    client
        .execute(
            "UPDATE reply_tasks SET status = 'failed', failure = 'test', lease_owner = NULL, \
             lease_until = NULL WHERE task_id = ANY($1)",
            &[&many],
        )
        .await
        .unwrap();
    let tx = client.transaction().await.unwrap();
    for task in few {
        tx.execute(
            "UPDATE reply_tasks SET status = 'failed', failure = 'test', lease_owner = NULL, \
             lease_until = NULL WHERE task_id = $1",
            &[task],
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    // Rolled back: nothing heard of it.
    let tx = client.transaction().await.unwrap();
    tx.execute(
        "UPDATE reply_tasks SET status = 'completed', saved_response = 'x', failure = NULL \
         WHERE task_id = $1",
        &[&few[0]],
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    // No status changes: no notification.
    client
        .execute(
            "UPDATE reply_tasks SET updated_at = clock_timestamp() WHERE task_id = ANY($1)",
            &[&tasks],
        )
        .await
        .unwrap();
    // The last word, to know that all before it has been heard (one session's notifications
    // arrive in commit order).
    client
        .execute(
            "UPDATE reply_tasks SET status = 'failed', failure = 'test', lease_owner = NULL, \
             lease_until = NULL WHERE task_id = $1",
            &[&sentinel.task_id.as_uuid()],
        )
        .await
        .unwrap();

    let ours: std::collections::HashSet<uuid::Uuid> = tasks.iter().copied().collect();
    let mut payloads = Vec::new();
    loop {
        let payload = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .expect("the sentinel's notification")
            .expect("the listening session ended");
        let lines: Vec<_> = parse_status_payloads(&payload)
            .map(|line| line.expect("every line understood"))
            .collect();
        if lines.iter().any(|(task, _)| *task == sentinel.task_id) {
            assert_eq!(lines, vec![(sentinel.task_id, TaskStatus::Failed)]);
            break;
        }
        if lines.iter().any(|(task, _)| ours.contains(&task.as_uuid())) {
            payloads.push((payload.len(), lines));
        }
    }
    assert_eq!(
        payloads.len(),
        3,
        "310 changes in one statement, 150 a notification: {:?}",
        payloads
            .iter()
            .map(|(len, l)| (len, l.len()))
            .collect::<Vec<_>>()
    );
    let mut heard = std::collections::HashSet::new();
    for (len, lines) in &payloads {
        assert!(*len < 8_000, "a payload of {len} bytes");
        for (task, status) in lines {
            assert_eq!(*status, TaskStatus::Failed);
            assert!(
                ours.contains(&task.as_uuid()),
                "another test's task in ours"
            );
            assert!(heard.insert(*task), "{task} heard twice");
        }
    }
    assert_eq!(heard.len(), tasks.len(), "every change heard");
}
