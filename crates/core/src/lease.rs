//! The fencing rules as pure functions over a snapshot of a task row taken under its row lock,
//! with the database's `clock_timestamp()` read in the same statement. No I/O here: `tasks`
//! reads the snapshot, asks these functions, and writes what they decide.
//!
//! Keeps I2 (a write is accepted only from the current assignment with a live lease) and I7
//! (a claim never exceeds the attempt budget or the deadline).
//!
//! A live lease is respected, with one exception: a claim made for a Kafka record of partition
//! `p` takes over at once a live lease that was taken for a record of the same partition by
//! another holder ([`Claimer::may_take_over`]). The group gives a partition to one member at a
//! time, and a member that loses one cancels its work for it before it is handed on, so such a
//! lease belongs to a holder that is dead (a killed worker, restarted under the same id as a new
//! incarnation) or a zombie (stalled past its session): waiting out its lease would only delay
//! the record. The takeover adds one to the assignment version like any claim, so what the old
//! holder writes afterwards is refused by the fence (I2), and at most one reply is saved (I1).

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::domain::{AttemptOutcome, TaskStatus};

/// The columns of a task row that fencing decisions read, plus the database clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSnapshot {
    pub status: TaskStatus,
    pub assignment_version: i64,
    pub lease_owner: Option<String>,
    pub lease_until: Option<DateTime<Utc>>,
    pub attempt_count: i32,
    pub max_attempts: i32,
    pub deadline: Option<DateTime<Utc>>,
    /// No claim before this instant (a backoff chosen by the previous attempt).
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub has_response: bool,
    /// `lease_partition` (V33): the partition of the record the current lease was claimed for,
    /// when its claimer held that partition alone (a Kafka consumer); `None` otherwise (an SQS
    /// message, a claim with no record, a claim of the previous release).
    pub lease_partition: Option<i32>,
    /// `clock_timestamp()` when the snapshot was read, under the row lock.
    pub now: DateTime<Utc>,
}

impl LeaseSnapshot {
    fn lease_live(&self) -> bool {
        lease_live(self.status, self.lease_until, self.now)
    }
}

/// Whether a task's lease is live at `now` (the database clock): the task runs and its lease
/// ends after `now` (a lease that ends exactly now is over). The fence (`replyd_lease_holds`,
/// V9) and the claim (`replyd_claim`) say the same in SQL, held to [`decide_claim`] by the
/// store's tests; the reconciler reads it here.
pub fn lease_live(
    status: TaskStatus,
    lease_until: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> bool {
    status == TaskStatus::Running && lease_until.is_some_and(|until| until > now)
}

/// Who claims: the lease owner string and, for a claim made for a record of a partition the
/// claimer holds alone in its consumer group (Kafka), that partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claimer<'a> {
    /// The lease owner this process writes: `<worker_id>#<incarnation>`, so that a worker
    /// restarted under the same id is another holder than the one it replaced.
    pub owner: &'a str,
    /// The record's partition when the source gives it to one consumer at a time; `None` for a
    /// shared source (SQS: every worker reads the queue's one "partition") and for claims made
    /// for no record (reconciler, API, tests), which keep respecting every live lease.
    pub partition: Option<i32>,
}

impl<'a> Claimer<'a> {
    /// A claimer that holds no partition: respects every live lease.
    pub fn without_partition(owner: &'a str) -> Self {
        Self {
            owner,
            partition: None,
        }
    }

    /// Whether this claimer may take over the live lease of `row` at once: it claims for a
    /// record of a partition it holds alone, the lease was taken for a record of the same
    /// partition, and by another holder. Never from itself: a duplicate record of the task in
    /// the same process (same owner string) parks until its own lease ends, as before.
    pub fn may_take_over(&self, row: &LeaseSnapshot) -> bool {
        self.partition.is_some()
            && row.lease_partition == self.partition
            && row.lease_owner.as_deref() != Some(self.owner)
    }
}

/// The right to work on a task: valid while `version` is the task's current
/// `assignment_version` and the lease has not run out by the database clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub task_id: Uuid,
    pub version: i64,
    pub owner: String,
    pub until: DateTime<Utc>,
    /// 1-based number of this attempt (the task's `attempt_count` after the claim).
    pub attempt: i32,
}

/// What a claim did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// This caller holds the task now.
    Claimed(Lease),
    /// This caller holds the task now, taken over from a live lease of another holder of the
    /// record's partition (a dead or zombie holder, [`Claimer::may_take_over`]).
    TookOver(Lease),
    /// Nothing to do: the task already has its reply (I5: no provider call).
    AlreadyCompleted,
    /// Nothing to do: the task failed for good.
    AlreadyFailed,
    /// Nothing to do: the user stopped the task.
    AlreadyCancelled,
    /// Another assignment holds a live lease; come back after `until`.
    LeasedByOther {
        owner: String,
        version: i64,
        until: DateTime<Utc>,
    },
    /// The attempt budget was spent; the claim marked the task failed.
    BudgetExhausted { attempts: i32 },
    /// The deadline passed; the claim marked the task failed.
    DeadlinePassed { deadline: DateTime<Utc> },
    /// The task is backing off after a failed attempt; come back at `at`.
    NotBefore { at: DateTime<Utc> },
    /// No such task.
    NotFound,
    /// The task was deleted by retention or an erasure, and is remembered as forgotten: a
    /// record of it is done, with no call (a forgotten task never comes back).
    Forgotten,
}

/// The kinds of claim outcome, a closed set: the label `replyd_claim` (V9, V15) answers with,
/// the metrics' and logs' label, and what the store reads a claim's row back as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClaimKind {
    Claimed,
    TookOver,
    AlreadyCompleted,
    AlreadyFailed,
    AlreadyCancelled,
    LeasedByOther,
    BudgetExhausted,
    DeadlinePassed,
    BackingOff,
    NotFound,
    Forgotten,
}

impl ClaimKind {
    /// Every kind, in the order of the enum.
    pub const ALL: [ClaimKind; 11] = [
        ClaimKind::Claimed,
        ClaimKind::TookOver,
        ClaimKind::AlreadyCompleted,
        ClaimKind::AlreadyFailed,
        ClaimKind::AlreadyCancelled,
        ClaimKind::LeasedByOther,
        ClaimKind::BudgetExhausted,
        ClaimKind::DeadlinePassed,
        ClaimKind::BackingOff,
        ClaimKind::NotFound,
        ClaimKind::Forgotten,
    ];

    /// The label, as `replyd_claim` writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimKind::Claimed => "claimed",
            ClaimKind::TookOver => "took_over_from_previous_holder",
            ClaimKind::AlreadyCompleted => "already_completed",
            ClaimKind::AlreadyFailed => "already_failed",
            ClaimKind::AlreadyCancelled => "already_cancelled",
            ClaimKind::LeasedByOther => "leased_by_other",
            ClaimKind::BudgetExhausted => "budget_exhausted",
            ClaimKind::DeadlinePassed => "deadline_passed",
            ClaimKind::BackingOff => "backing_off",
            ClaimKind::NotFound => "not_found",
            ClaimKind::Forgotten => "forgotten",
        }
    }

    /// The kind a label names; `None` for one this build does not know.
    pub fn parse(label: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.as_str() == label)
    }
}

impl ClaimOutcome {
    /// Why this claim failed the task, when it did (its budget spent or its deadline passed):
    /// the failure's label and its words, for a task of `max_attempts` whose next attempt
    /// would have been `next_attempt`.
    pub fn failure(&self, max_attempts: u32, next_attempt: i32) -> Option<(&'static str, String)> {
        match self {
            ClaimOutcome::BudgetExhausted { attempts } => Some((
                "budget_exhausted",
                format!("attempt budget exhausted: {attempts} of {max_attempts} attempts used"),
            )),
            ClaimOutcome::DeadlinePassed { deadline } => Some((
                "deadline_passed",
                format!(
                    "deadline {} passed before attempt {next_attempt}",
                    deadline.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
                ),
            )),
            _ => None,
        }
    }

    /// The outcome's kind.
    pub fn kind(&self) -> ClaimKind {
        match self {
            ClaimOutcome::Claimed(_) => ClaimKind::Claimed,
            ClaimOutcome::TookOver(_) => ClaimKind::TookOver,
            ClaimOutcome::AlreadyCompleted => ClaimKind::AlreadyCompleted,
            ClaimOutcome::AlreadyFailed => ClaimKind::AlreadyFailed,
            ClaimOutcome::AlreadyCancelled => ClaimKind::AlreadyCancelled,
            ClaimOutcome::LeasedByOther { .. } => ClaimKind::LeasedByOther,
            ClaimOutcome::BudgetExhausted { .. } => ClaimKind::BudgetExhausted,
            ClaimOutcome::DeadlinePassed { .. } => ClaimKind::DeadlinePassed,
            ClaimOutcome::NotBefore { .. } => ClaimKind::BackingOff,
            ClaimOutcome::NotFound => ClaimKind::NotFound,
            ClaimOutcome::Forgotten => ClaimKind::Forgotten,
        }
    }

    /// Stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        self.kind().as_str()
    }

    /// The lease this caller holds now, however it got it.
    pub fn lease(&self) -> Option<&Lease> {
        match self {
            ClaimOutcome::Claimed(lease) | ClaimOutcome::TookOver(lease) => Some(lease),
            _ => None,
        }
    }

    /// The assignment version the outcome names: ours when claimed, the holder's when leased.
    pub fn version(&self) -> Option<i64> {
        match self {
            ClaimOutcome::Claimed(lease) | ClaimOutcome::TookOver(lease) => Some(lease.version),
            ClaimOutcome::LeasedByOther { version, .. } => Some(*version),
            _ => None,
        }
    }
}

/// Whose assignment a claim ends, when the task was running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Takeover {
    /// The previous assignment's lease ran out without an outcome.
    LeaseLapsed,
    /// The previous assignment's lease is live, but was taken for a record of the claimer's
    /// partition by another holder, who has lost the partition since ([`Claimer::may_take_over`]).
    FromLostHolder,
}

/// What a claim should do, decided from the locked row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimDecision {
    /// Take the task: `version + 1`, a new lease, one more attempt. `takes_over` says whose
    /// assignment ends when the task was running (its call may have run: `provider_may_have_run`).
    Claim { takes_over: Option<Takeover> },
    /// Report without writing.
    Refuse(ClaimOutcome),
    /// Mark the task failed with `reason`, then report.
    Fail {
        reason: String,
        outcome: ClaimOutcome,
    },
}

/// Decides a claim by `claimer`: pending (or running with an expired lease), under budget and
/// before the deadline → claim. A live lease is respected (the lease is the only right to
/// work), including one of this very process, unless the claimer may take it over as the
/// new holder of the partition it was taken for ([`Claimer::may_take_over`]); the budget and
/// the deadline are then checked as for any claim.
pub fn decide_claim(row: &LeaseSnapshot, claimer: &Claimer<'_>) -> ClaimDecision {
    let mut takes_over = (row.status == TaskStatus::Running).then_some(Takeover::LeaseLapsed);
    match row.status {
        TaskStatus::Completed => return ClaimDecision::Refuse(ClaimOutcome::AlreadyCompleted),
        TaskStatus::Failed => return ClaimDecision::Refuse(ClaimOutcome::AlreadyFailed),
        TaskStatus::Cancelled => return ClaimDecision::Refuse(ClaimOutcome::AlreadyCancelled),
        TaskStatus::Running if row.lease_live() && claimer.may_take_over(row) => {
            takes_over = Some(Takeover::FromLostHolder);
        }
        TaskStatus::Running if row.lease_live() => {
            return ClaimDecision::Refuse(ClaimOutcome::LeasedByOther {
                owner: row.lease_owner.clone().unwrap_or_default(),
                version: row.assignment_version,
                // lease_live() implies lease_until is set.
                until: row.lease_until.unwrap_or(row.now),
            });
        }
        TaskStatus::Running | TaskStatus::Pending => {}
    }
    if let Some(deadline) = row.deadline.filter(|d| *d <= row.now) {
        // Checked before the backoff: a task whose deadline passed while it waited fails now,
        // with no further call.
        return ClaimDecision::Fail {
            reason: format!(
                "deadline exceeded: the deadline {deadline} passed before attempt {}",
                row.attempt_count + 1
            ),
            outcome: ClaimOutcome::DeadlinePassed { deadline },
        };
    }
    if let Some(at) = row.next_attempt_at.filter(|at| *at > row.now) {
        return ClaimDecision::Refuse(ClaimOutcome::NotBefore { at });
    }
    if row.attempt_count >= row.max_attempts {
        return ClaimDecision::Fail {
            reason: format!(
                "attempt budget exhausted: {} of {} attempts used",
                row.attempt_count, row.max_attempts
            ),
            outcome: ClaimOutcome::BudgetExhausted {
                attempts: row.attempt_count,
            },
        };
    }
    ClaimDecision::Claim { takes_over }
}

/// Why a fenced write (completion, renewal, failure) was refused. Read from the row after the
/// guarded UPDATE matched nothing, under the same row lock, so the answer is the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The task already has its saved reply. `by_this_assignment` is true when it was this very
    /// assignment's (an earlier write whose acknowledgement was lost).
    AlreadySaved { by_this_assignment: bool },
    /// The task failed for good.
    Failed,
    /// The user stopped the task.
    Cancelled,
    /// This assignment is still the current one, but its lease ran out by the database clock.
    LeaseExpired,
    /// A newer assignment exists: this caller is a zombie.
    TakenOver { current_version: i64 },
    /// The task row does not exist.
    NotFound,
}

impl Refusal {
    /// Stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::AlreadySaved { .. } => "already_saved",
            Refusal::Failed => "already_failed",
            Refusal::Cancelled => "already_cancelled",
            Refusal::LeaseExpired => "fenced_lease_expired",
            Refusal::TakenOver { .. } => "fenced_taken_over",
            Refusal::NotFound => "not_found",
        }
    }

    /// The `reply_attempts.outcome` that records this refusal. Every refusal of a write is a
    /// fencing: only the current assignment with a live lease may write, and a reply saved by
    /// another assignment means this one is not current. (A repeat of this assignment's own
    /// accepted write is not recorded at all; see the store's `fence::is_own_earlier_write`.)
    pub fn attempt_outcome(&self) -> AttemptOutcome {
        AttemptOutcome::Fenced
    }
}

/// Classifies a refused fenced write by `my_version`. The order matters: a saved reply or a
/// terminal failure is the most useful answer whatever else holds; only then does a version
/// mismatch (takeover) or a dead lease explain it.
pub fn classify_refusal(row: &LeaseSnapshot, my_version: i64) -> Refusal {
    if row.has_response {
        return Refusal::AlreadySaved {
            by_this_assignment: row.assignment_version == my_version,
        };
    }
    if row.status == TaskStatus::Failed {
        return Refusal::Failed;
    }
    if row.status == TaskStatus::Cancelled {
        return Refusal::Cancelled;
    }
    if row.assignment_version != my_version {
        return Refusal::TakenOver {
            current_version: row.assignment_version,
        };
    }
    if row.status == TaskStatus::Running && !row.lease_live() {
        return Refusal::LeaseExpired;
    }
    // Same version, running, live lease, no reply: the guarded UPDATE would have matched. A
    // row in this state was changed by something other than replyd; refusing is the safe
    // answer, and "taken over" tells the caller to stop.
    Refusal::TakenOver {
        current_version: row.assignment_version,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;
    use proptest::prelude::*;

    fn running(version: i64, lease_left_ms: i64) -> LeaseSnapshot {
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        LeaseSnapshot {
            status: TaskStatus::Running,
            assignment_version: version,
            lease_owner: Some("w1".into()),
            lease_until: Some(now + Duration::milliseconds(lease_left_ms)),
            attempt_count: 1,
            max_attempts: 3,
            deadline: None,
            next_attempt_at: None,
            has_response: false,
            lease_partition: Some(3),
            now,
        }
    }

    /// A row in `status` whose lease ran out a moment ago.
    fn lapsed(version: i64, status: TaskStatus) -> LeaseSnapshot {
        LeaseSnapshot {
            status,
            ..running(version, -1)
        }
    }

    /// The outcome a claim of `row` by `claimer` fails the task with; none when it does not.
    fn failure(row: &LeaseSnapshot, claimer: &Claimer<'_>) -> Option<ClaimOutcome> {
        match decide_claim(row, claimer) {
            ClaimDecision::Fail { outcome, .. } => Some(outcome),
            _ => None,
        }
    }

    /// A claim made for no record, or for a record of a shared source (SQS).
    const NO_PARTITION: Claimer<'static> = Claimer {
        owner: "w2#b",
        partition: None,
    };

    #[test]
    fn a_claim_that_failed_the_task_says_why_and_no_other_claim_does() {
        let spent = ClaimOutcome::BudgetExhausted { attempts: 3 };
        assert_eq!(
            spent.failure(3, 4),
            Some((
                "budget_exhausted",
                "attempt budget exhausted: 3 of 3 attempts used".to_owned()
            ))
        );
        let deadline = "2026-12-07T06:00:00.5Z".parse().unwrap();
        assert_eq!(
            ClaimOutcome::DeadlinePassed { deadline }.failure(3, 2),
            Some((
                "deadline_passed",
                "deadline 2026-12-07T06:00:00.500Z passed before attempt 2".to_owned()
            ))
        );
        assert_eq!(ClaimOutcome::AlreadyCompleted.failure(3, 1), None);
    }

    #[test]
    fn live_lease_is_respected_and_expired_lease_is_taken_over() {
        assert!(matches!(
            decide_claim(&running(1, 1), &NO_PARTITION),
            ClaimDecision::Refuse(ClaimOutcome::LeasedByOther { version: 1, .. })
        ));
        // Expiry is exclusive: a lease that ends exactly now is no longer live.
        assert_eq!(
            decide_claim(&running(1, 0), &NO_PARTITION),
            ClaimDecision::Claim {
                takes_over: Some(Takeover::LeaseLapsed)
            }
        );
    }

    /// How a claim of `row` fails the task, by the outcome's label; None when it does not.
    fn failed_as(row: &LeaseSnapshot) -> Option<&'static str> {
        failure(row, &NO_PARTITION).map(|outcome| outcome.label())
    }

    #[test]
    fn claim_past_budget_or_deadline_fails_the_task() {
        let mut row = running(3, -1);
        row.attempt_count = 3;
        assert!(matches!(
            failure(&row, &NO_PARTITION),
            Some(ClaimOutcome::BudgetExhausted { attempts: 3 })
        ));
        let mut row = running(1, -1);
        row.deadline = Some(row.now);
        assert_eq!(failed_as(&row), Some("deadline_passed"));
    }

    #[test]
    fn a_backing_off_task_is_not_claimed_before_its_time_unless_its_deadline_passed() {
        let mut row = lapsed(1, TaskStatus::Pending);
        row.next_attempt_at = Some(row.now + Duration::milliseconds(500));
        assert!(matches!(
            decide_claim(&row, &NO_PARTITION),
            ClaimDecision::Refuse(ClaimOutcome::NotBefore { .. })
        ));
        row.next_attempt_at = Some(row.now);
        assert_eq!(
            decide_claim(&row, &NO_PARTITION),
            ClaimDecision::Claim { takes_over: None }
        );
        row.next_attempt_at = Some(row.now + Duration::milliseconds(500));
        row.deadline = Some(row.now);
        assert_eq!(failed_as(&row), Some("deadline_passed"));
    }

    #[test]
    fn terminal_tasks_are_never_claimed() {
        let mut row = lapsed(2, TaskStatus::Completed);
        row.has_response = true;
        assert_eq!(
            decide_claim(&row, &NO_PARTITION),
            ClaimDecision::Refuse(ClaimOutcome::AlreadyCompleted)
        );
        row.status = TaskStatus::Failed;
        row.has_response = false;
        assert_eq!(
            decide_claim(&row, &NO_PARTITION),
            ClaimDecision::Refuse(ClaimOutcome::AlreadyFailed)
        );
    }

    #[test]
    fn refusals_name_the_reason_in_priority_order() {
        let mut saved = running(2, 1000);
        saved.status = TaskStatus::Completed;
        saved.has_response = true;
        assert_eq!(
            classify_refusal(&saved, 1),
            Refusal::AlreadySaved {
                by_this_assignment: false
            }
        );
        assert_eq!(
            classify_refusal(&saved, 2),
            Refusal::AlreadySaved {
                by_this_assignment: true
            }
        );
        assert_eq!(
            classify_refusal(&running(2, 1000), 1),
            Refusal::TakenOver { current_version: 2 }
        );
        assert_eq!(classify_refusal(&running(2, 0), 2), Refusal::LeaseExpired);
        let mut failed = running(2, 1000);
        failed.status = TaskStatus::Failed;
        assert_eq!(classify_refusal(&failed, 1), Refusal::Failed);
    }

    /// Worker w1's first incarnation took the lease for a record of partition 3 (`running`).
    fn kafka(owner: &'static str, partition: i32) -> Claimer<'static> {
        Claimer {
            owner,
            partition: Some(partition),
        }
    }

    #[test]
    fn a_claim_for_the_same_partition_takes_over_a_live_lease_of_another_holder() {
        let row = LeaseSnapshot {
            lease_owner: Some("w1#a".into()),
            ..running(1, 60_000)
        };
        // The same worker id restarted (a new incarnation), or a survivor given the partition.
        for claimer in [kafka("w1#b", 3), kafka("w2#c", 3)] {
            assert_eq!(
                decide_claim(&row, &claimer),
                ClaimDecision::Claim {
                    takes_over: Some(Takeover::FromLostHolder)
                },
                "{claimer:?}"
            );
        }
    }

    #[test]
    fn a_live_lease_is_respected_by_its_own_holder_another_partition_and_a_shared_source() {
        let row = LeaseSnapshot {
            lease_owner: Some("w1#a".into()),
            ..running(1, 60_000)
        };
        // A duplicate record consumed by the same process parks: never a takeover from itself.
        // A record of another partition, or a claim that holds no partition, keeps the old rule.
        for claimer in [
            kafka("w1#a", 3),
            kafka("w2#c", 4),
            Claimer::without_partition("w2#c"),
        ] {
            assert!(
                matches!(
                    decide_claim(&row, &claimer),
                    ClaimDecision::Refuse(ClaimOutcome::LeasedByOther { version: 1, .. })
                ),
                "{claimer:?}"
            );
        }
        // A lease taken by a claimer that held no partition alone (SQS, the previous release).
        let shared = LeaseSnapshot {
            lease_partition: None,
            ..row
        };
        assert!(matches!(
            decide_claim(&shared, &kafka("w2#c", 3)),
            ClaimDecision::Refuse(ClaimOutcome::LeasedByOther { .. })
        ));
    }

    #[test]
    fn a_takeover_of_a_live_lease_still_keeps_the_budget_and_the_deadline() {
        let mut row = running(3, 60_000);
        row.attempt_count = 3;
        assert!(matches!(
            failure(&row, &kafka("w2#c", 3)),
            Some(ClaimOutcome::BudgetExhausted { attempts: 3 })
        ));
        let mut row = running(1, 60_000);
        row.deadline = Some(row.now);
        assert!(matches!(
            failure(&row, &kafka("w2#c", 3)),
            Some(ClaimOutcome::DeadlinePassed { .. })
        ));
    }

    fn snapshot() -> impl Strategy<Value = LeaseSnapshot> {
        (
            prop_oneof![
                Just(TaskStatus::Pending),
                Just(TaskStatus::Running),
                Just(TaskStatus::Completed),
                Just(TaskStatus::Failed),
                Just(TaskStatus::Cancelled),
            ],
            -3i64..=3,
            proptest::option::of(prop_oneof![Just("w1#a"), Just("w1#b"), Just("w2#c")]),
            proptest::option::of(0i32..=2),
            0i32..=3,
            1i32..=3,
            proptest::option::of(-3i64..=3),
        )
            .prop_map(
                |(status, lease, owner, partition, attempts, max, deadline)| {
                    let mut row = running(1, lease * 1000);
                    row.status = status;
                    row.lease_owner = owner.map(str::to_owned);
                    row.lease_partition = partition;
                    row.attempt_count = attempts.min(max);
                    row.max_attempts = max;
                    row.deadline = deadline.map(|d| row.now + Duration::seconds(d));
                    row
                },
            )
    }

    fn claimer() -> impl Strategy<Value = Claimer<'static>> {
        (
            prop_oneof![Just("w1#a"), Just("w1#b"), Just("w2#c")],
            proptest::option::of(0i32..=2),
        )
            .prop_map(|(owner, partition)| Claimer { owner, partition })
    }

    proptest! {
        /// The takeover rule changes one answer only: a live lease that the claimer may take
        /// over is claimed as the lapsed lease would be; every other decision is the claim of
        /// a claimer with no partition (the rule before it).
        #[test]
        fn a_live_lease_is_taken_over_only_by_another_holder_of_its_partition(
            row in snapshot(),
            claimer in claimer(),
        ) {
            let decided = decide_claim(&row, &claimer);
            let before = decide_claim(&row, &Claimer::without_partition(claimer.owner));
            let live = row.lease_live();
            let may = claimer.partition.is_some()
                && row.lease_partition == claimer.partition
                && row.lease_owner.as_deref() != Some(claimer.owner);
            if live && may {
                // As if the lease had just lapsed.
                let lapsed = LeaseSnapshot { lease_until: Some(row.now), ..row.clone() };
                let expected = match decide_claim(&lapsed, &claimer) {
                    ClaimDecision::Claim { .. } => ClaimDecision::Claim {
                        takes_over: Some(Takeover::FromLostHolder),
                    },
                    other => other,
                };
                prop_assert_eq!(&decided, &expected);
            } else {
                prop_assert_eq!(&decided, &before);
                if live && row.status == TaskStatus::Running {
                    let refused = matches!(decided, ClaimDecision::Refuse(ClaimOutcome::LeasedByOther { .. }));
                    prop_assert!(refused);
                }
            }
            // Never from itself.
            if row.lease_owner.as_deref() == Some(claimer.owner) && live {
                let refused = matches!(decided, ClaimDecision::Refuse(ClaimOutcome::LeasedByOther { .. }));
                prop_assert!(refused);
            }
        }
    }
}
