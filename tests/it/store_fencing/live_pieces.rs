//! The live text of a running attempt: a round of pieces writes only the running attempts'
//! and announces them packed.

use std::time::Duration;

use super::{LONG_LEASE, claim_ok, new_task};
use crate::helpers::TestDb;
use replyd::store::CompletionOutcome;
use replyd::store::live::{LIVE_PIECES_CHANNEL, PieceToWrite, parse_live_pieces};
use replyd_core::domain::TaskId;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_of_live_pieces_writes_only_running_attempts_and_announces_them_packed() {
    let db = TestDb::new().await;
    let (mut payloads, _listening) = crate::helpers::hear(&db.settings, LIVE_PIECES_CHANNEL).await;

    let (a, b, done) = (
        new_task(&db, 3).await,
        new_task(&db, 3).await,
        new_task(&db, 3).await,
    );
    let lease_a = claim_ok(&db.store, a, "w1", LONG_LEASE).await;
    let lease_b = claim_ok(&db.store, b, "w1", LONG_LEASE).await;
    let lease_done = claim_ok(&db.store, done, "w1", LONG_LEASE).await;
    assert_eq!(
        db.store.complete(&lease_done, "saved", None).await.unwrap(),
        CompletionOutcome::Accepted
    );
    // Pieces big enough that one round needs more than one notification.
    let big = "é".repeat(3_000);
    let piece = |task: TaskId, version: i64, seq: i32, text: &'static str| PieceToWrite {
        task_id: task,
        assignment_version: version,
        seq,
        text,
    };
    let big: &'static str = Box::leak(big.into_boxed_str());
    let round = [
        piece(a, lease_a.version, 1, big),
        // Not the running attempt: a zombie's version, and a task already completed.
        piece(b, lease_b.version - 1, 1, "zombie"),
        piece(done, lease_done.version, 1, "late"),
        piece(b, lease_b.version, 1, "line one\nline two"),
        piece(a, lease_a.version, 2, big),
    ];
    assert_eq!(
        db.store.append_live_pieces(&round).await.unwrap(),
        [true, false, false, true, true]
    );
    // Sent again (its answer lost): the same answer, nothing written or announced twice.
    assert_eq!(
        db.store.append_live_pieces(&round).await.unwrap(),
        [true, false, false, true, true]
    );
    // A last round marks the end: notifications come in commit order, so anything the
    // round sent again had announced would come before it.
    assert_eq!(
        db.store
            .append_live_pieces(&[piece(a, lease_a.version, 3, "end")])
            .await
            .unwrap(),
        [true]
    );
    let mut announced = Vec::new();
    while announced
        .last()
        .is_none_or(|p: &replyd::store::live::LivePiece| p.text != "end")
    {
        let payload = tokio::time::timeout(Duration::from_secs(30), payloads.recv())
            .await
            .expect("announced")
            .unwrap();
        assert!(payload.len() < 8_000);
        announced.extend(parse_live_pieces(&payload));
    }
    let got: Vec<(TaskId, i32, &str)> = announced
        .iter()
        .map(|p| (p.task_id, p.seq, p.text.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            (a, 1, big),
            (b, 1, "line one\nline two"),
            (a, 2, big),
            (a, 3, "end")
        ]
    );
    let stored = db
        .store
        .live_text_after(a, lease_a.version, 0)
        .await
        .unwrap();
    assert_eq!(stored.len(), 3);
}
