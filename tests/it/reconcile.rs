//! The quota's reconciler against the real PostgreSQL and the mock provider over HTTP (I8): a
//! reservation nobody comes back for does not hold quota forever, and before anything is
//! released or charged again the durable task is asked first and the provider second.

use std::sync::Arc;
use std::time::Duration;

use crate::helpers::provider::{request, start_mock, stats};
use crate::helpers::{TestDb, api};
use replyd::api::ApiState;
use replyd::api::reply_view::Accepted;
use replyd::api::settings::ApiSettings;
use replyd::provider::{
    BackgroundProvider, OpenAiResponsesProvider, Provider, ProviderApi, ProviderSettings,
};
use replyd::reconcile::{ReconcileReport, Reconciler};
use replyd::store::CompletionOutcome;
use replyd_core::domain::{TaskId, TaskStatus};
use replyd_core::lease::ClaimOutcome;
use replyd_core::quota::QuotaSettings;
use replyd_lab::mock_provider::{MockHandle, MockSettings};
use serde_json::json;
use tokio_util::sync::CancellationToken;

struct Setup {
    db: TestDb,
    base: String,
    key: String,
    mock: MockHandle,
    provider: Arc<OpenAiResponsesProvider>,
    _stop: tokio_util::sync::DropGuard,
}

async fn setup() -> Setup {
    let db = TestDb::new().await;
    let key = api::workspace_with_key(&db.store, "acme").await;
    let state = ApiState::new(
        db.store.clone(),
        ApiSettings::default(),
        api::limits(10_000),
    );
    let (base, stop) = api::serve_on_loopback(state, CancellationToken::new()).await;
    let mock = start_mock(MockSettings {
        latency_ms: 20,
        ..MockSettings::default()
    })
    .await;
    let provider = Arc::new(
        OpenAiResponsesProvider::new(&ProviderSettings {
            base_url: mock.base_url(),
            api_key: Some(replyd::config::Secret::new("sk-test")),
            request_timeout_ms: 5_000,
            connect_timeout_ms: 2_000,
            default_model: "mock-model".into(),
            api: ProviderApi::BackgroundResponses,
            poll_interval_ms: 10,
            operation_max_wait_ms: 5_000,
            ..ProviderSettings::default()
        })
        .unwrap(),
    );
    Setup {
        db,
        base,
        key: key.token,
        mock,
        provider,
        _stop: stop,
    }
}

impl Setup {
    async fn submit(&self, key: &str) -> TaskId {
        let accepted: Accepted = reqwest::Client::new()
            .post(format!("{}/v1/replies", self.base))
            .bearer_auth(&self.key)
            .header("Idempotency-Key", key)
            .json(&json!({"conversation_id": "c", "message": "q"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        accepted.task_id
    }

    async fn reconcile(&self) -> ReconcileReport {
        let provider: Arc<dyn Provider> = self.provider.clone();
        Reconciler::new(
            self.db.store.clone(),
            Some(provider),
            QuotaSettings::default().policy(),
            Duration::from_secs(30),
            // No task of these tests is worked by a vanished worker.
            Duration::ZERO,
        )
        .run_once()
        .await
        .unwrap()
    }

    /// Moves every open reservation's TTL into the past: the tab closed an hour ago.
    async fn age_reservations(&self) {
        crate::helpers::age_open_reservations(&self.db).await;
    }

    /// (state, settled_by, counter used, counter reserved) of `task`'s reservation.
    async fn reservation(&self, task: TaskId) -> (String, Option<String>, i64, i64) {
        let row = self
            .db
            .raw_client()
            .await
            .query_one(
                "SELECT r.state, r.settled_by, q.used, q.reserved FROM quota_reservations r \
                 JOIN quota_counters q USING (workspace_id) WHERE r.task_id = $1",
                &[&task.as_uuid()],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1), row.get(2), row.get(3))
    }

    /// Claims `task` as `owner` with a lease of `lease`, as a worker would.
    async fn claim(&self, task: TaskId, owner: &str, lease: Duration) -> replyd_core::lease::Lease {
        match self.db.store.claim(task, owner, lease).await.unwrap() {
            ClaimOutcome::Claimed(lease) => lease,
            other => panic!("{task} not claimable: {other:?}"),
        }
    }

    /// Plays a worker that claims `task` with a lease of `lease`, starts the provider's
    /// operation for `prompt`, stores its id and is then gone (its call timed out, it died).
    async fn start_and_lose(
        &self,
        task: TaskId,
        prompt: &str,
        lease: Duration,
    ) -> (
        replyd_core::lease::Lease,
        replyd_core::provider::OperationId,
    ) {
        let lease = self.claim(task, "w-dead", lease).await;
        let operation = self
            .provider
            .start(&request(&task.to_string(), prompt))
            .await
            .unwrap();
        self.db
            .store
            .record_operation(&lease, Some(&operation.0))
            .await
            .unwrap()
            .unwrap();
        (lease, operation)
    }

    /// Waits until `task`'s lease has run out by the database clock (its worker is gone).
    async fn wait_until_lease_out(&self, task: TaskId) {
        let client = self.db.raw_client().await;
        crate::helpers::wait_until_sql(
            &client,
            "the lease has run out",
            "SELECT lease_until < clock_timestamp() FROM reply_tasks WHERE task_id = $1",
            &[&task.as_uuid()],
        )
        .await;
    }

    async fn decisions(&self, task: TaskId) -> Vec<String> {
        self.db
            .raw_client()
            .await
            .query(
                "SELECT decided_by || ' ' || decision FROM quota_decisions WHERE task_id = $1 \
                 ORDER BY decision_id",
                &[&task.as_uuid()],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_nobody_works_expires_and_frees_its_quota() {
    // The relay is stopped (none runs here): the task never reaches a worker.
    let s = setup().await;
    let task = s.submit("closed-tab").await;
    assert_eq!(s.reconcile().await.examined, 0, "not before the TTL");
    s.age_reservations().await;
    let report = s.reconcile().await;
    assert_eq!((report.examined, report.expired), (1, 1), "{report:?}");
    let stored = s.db.store.read(task).await.unwrap().unwrap();
    assert_eq!(stored.status, TaskStatus::Failed);
    assert!(
        stored
            .failure
            .as_deref()
            .unwrap()
            .starts_with("reservation expired: not worked within quota.reservation_ttl_ms"),
        "{stored:?}"
    );
    assert_eq!(
        s.reservation(task).await,
        ("expired".into(), Some("reconciler".into()), 0, 0)
    );
    assert_eq!(s.decisions(task).await, ["reconciler expire"]);
    // A second pass finds nothing; the record reaching a worker later finds a failed task.
    assert_eq!(s.reconcile().await.examined, 0);
    assert_eq!(
        s.db.store
            .claim(task, "w-late", Duration::from_secs(30))
            .await
            .unwrap(),
        ClaimOutcome::AlreadyFailed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_the_provider_finished_is_saved_and_charged_once_without_a_new_generation() {
    let s = setup().await;
    let task = s.submit("timed-out").await;
    // A worker claimed the task, started the provider's operation, stored its id, and then
    // lost track of it (its call timed out, it died); its lease has run out.
    let (lease, operation) = s
        .start_and_lose(task, "q", Duration::from_millis(200))
        .await;
    // The work finishes at the provider while nobody waits for it.
    s.provider.wait(&operation).await.unwrap();
    s.wait_until_lease_out(task).await;
    s.age_reservations().await;
    let generations = stats(&s.mock).await.generations;
    assert_eq!(generations, 1);

    let report = s.reconcile().await;
    assert_eq!(report.completed_from_provider, 1, "{report:?}");
    let stored = s.db.store.read(task).await.unwrap().unwrap();
    assert_eq!(stored.status, TaskStatus::Completed);
    assert!(stored.saved_response.is_some());
    assert_eq!(
        s.reservation(task).await,
        ("charged".into(), Some("reconciler".into()), 1, 0)
    );
    assert_eq!(stats(&s.mock).await.generations, 1, "no new generation");
    assert_eq!(s.decisions(task).await, ["reconciler complete"]);

    // The dead worker's delayed answer arrives: refused by the fence, the charge unchanged.
    let late = s.db.store.complete(&lease, "late", None).await.unwrap();
    assert!(matches!(late, CompletionOutcome::Refused(_)), "{late:?}");
    assert_eq!(
        s.reservation(task).await,
        ("charged".into(), Some("reconciler".into()), 1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_the_provider_never_received_is_not_charged() {
    let s = setup().await;
    let task = s.submit("never-sent").await;
    let lease = s.claim(task, "w-dead", Duration::from_millis(100)).await;
    // An id the provider does not know (the create never reached it).
    s.db.store
        .record_operation(&lease, Some("resp_never_created"))
        .await
        .unwrap()
        .unwrap();
    s.wait_until_lease_out(task).await;
    s.age_reservations().await;
    let report = s.reconcile().await;
    assert_eq!(report.expired, 1, "{report:?}");
    assert_eq!(
        s.reservation(task).await,
        ("expired".into(), Some("reconciler".into()), 0, 0)
    );
    assert_eq!(stats(&s.mock).await.generations, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_in_progress_keeps_its_reservation() {
    let s = setup().await;
    let held = s.submit("leased").await;
    let running = s.submit("provider-running").await;
    // One task leased by a live worker; one whose operation is still running at the provider
    // (a slow prompt) while its worker's lease has run out.
    let _live = s.claim(held, "w-live", Duration::from_secs(60)).await;
    let (_, operation) = s
        .start_and_lose(
            running,
            "[mock:latency_ms=60000] slow",
            Duration::from_millis(100),
        )
        .await;
    s.wait_until_lease_out(running).await;
    s.age_reservations().await;
    let report = s.reconcile().await;
    assert_eq!(report.extended, 2, "{report:?}");
    for task in [held, running] {
        let (state, _, _, reserved) = s.reservation(task).await;
        assert_eq!((state.as_str(), reserved), ("reserved", 2));
        assert_eq!(s.decisions(task).await, ["reconciler extend"]);
    }
    // Extended: not looked at again before a new TTL.
    assert_eq!(s.reconcile().await.examined, 0);
    // The slow task is pending again for its worker (the reconciler gave its lease back).
    let stored = s.db.store.read(running).await.unwrap().unwrap();
    assert_eq!(stored.status, TaskStatus::Pending);
    assert_eq!(
        stored.provider_operation_id.as_deref(),
        Some(operation.0.as_str())
    );
}

/// Plays a worker whose wait on `task`'s operation gave up while the provider still ran it
/// (`provider.operation_max_wait_ms`): the task fails, its work may exist.
async fn fail_while_running(s: &Setup, task: TaskId, operation_id: Option<&str>) {
    let lease = s.claim(task, "w-gave-up", Duration::from_secs(30)).await;
    if let Some(id) = operation_id {
        s.db.store
            .record_operation(&lease, Some(id))
            .await
            .unwrap()
            .unwrap();
    }
    let failed =
        s.db.store
            .fail(
                &lease,
                "operation still running after 1800000 ms",
                replyd_core::domain::AttemptOutcome::Timeout,
                replyd_core::domain::ProviderRan::Maybe,
            )
            .await
            .unwrap();
    assert!(matches!(failed, replyd::store::FailOutcome::Failed));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_task_whose_operation_the_provider_finished_is_charged_once_and_stays_failed() {
    let s = setup().await;
    let task = s.submit("gave-up").await;
    let operation = s
        .provider
        .start(&request(&task.to_string(), "q"))
        .await
        .unwrap();
    fail_while_running(&s, task, Some(&operation.0)).await;
    // Held, not released: the provider may still finish.
    assert_eq!(s.reservation(task).await, ("reserved".into(), None, 0, 1));
    s.provider.wait(&operation).await.unwrap();
    s.age_reservations().await;

    let report = s.reconcile().await;

    assert_eq!(report.settled, 1, "{report:?}");
    assert_eq!(
        s.reservation(task).await,
        ("charged".into(), Some("reconciler".into()), 1, 0)
    );
    assert_eq!(s.decisions(task).await, ["reconciler charged"]);
    let stored = s.db.store.read(task).await.unwrap().unwrap();
    assert_eq!(
        stored.status,
        TaskStatus::Failed,
        "every reader was told so"
    );
    assert_eq!(stats(&s.mock).await.generations, 1, "no new generation");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_task_whose_operation_the_provider_never_had_is_not_charged() {
    let s = setup().await;
    let task = s.submit("gone").await;
    fail_while_running(&s, task, Some("resp_never_created")).await;
    s.age_reservations().await;

    s.reconcile().await;

    assert_eq!(
        s.reservation(task).await,
        ("expired".into(), Some("reconciler".into()), 0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_task_nobody_can_ask_about_is_settled_as_the_policy_says() {
    let s = setup().await;
    let task = s.submit("lost-answer").await;
    fail_while_running(&s, task, None).await;
    // Not before its TTL: held, and holding capacity.
    assert_eq!(s.reconcile().await.examined, 0);
    assert_eq!(s.reservation(task).await, ("reserved".into(), None, 0, 1));
    s.age_reservations().await;

    s.reconcile().await;

    // quota.charge_unresolved (true by default): the provider may have billed the work.
    assert_eq!(
        s.reservation(task).await,
        ("charged".into(), Some("reconciler".into()), 1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasing_a_failed_task_whose_work_may_exist_charges_its_open_reservation() {
    let s = setup().await;
    let task = s.submit("erased-unresolved").await;
    let pending = s.submit("erased-pending").await;
    fail_while_running(&s, task, None).await;
    // Held for the reconciler, and holding capacity: two open reservations.
    let counter = || async {
        let row =
            s.db.raw_client()
                .await
                .query_one(
                    "SELECT used, reserved FROM quota_counters WHERE workspace_id = 'acme'",
                    &[],
                )
                .await
                .unwrap();
        (row.get::<_, i64>(0), row.get::<_, i64>(1))
    };
    assert_eq!(counter().await, (0, 2));

    let erased =
        s.db.store
            .erase(&replyd::store::forgetting::ErasureScope {
                workspace_id: "acme".into(),
                conversation_id: Some("c".into()),
            })
            .await
            .unwrap();

    // The failed task's provider may have done the work: charged, never released (I8); the
    // task nobody claimed did nothing: released. Nothing is left holding capacity.
    assert_eq!(
        (
            erased.forgotten.tasks,
            erased.forgotten.charged,
            erased.forgotten.released
        ),
        (2, 1, 1),
        "{erased:?}"
    );
    assert_eq!(counter().await, (1, 0));
    for id in [task, pending] {
        assert!(s.db.store.is_forgotten(id).await.unwrap());
    }
}
