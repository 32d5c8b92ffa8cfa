//! The reconciler's decisions: what to do with a reservation past its TTL, from the durable
//! task first and the provider's answer when the work may exist there. Pure decisions; the
//! reconciler in the service does the reads and writes around them.

/// What the reconciler knows of a task whose reservation is past its TTL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpiredTask {
    pub status: crate::domain::TaskStatus,
    /// A worker holds a live lease on it (by the database clock).
    pub lease_live: bool,
    /// A provider operation id is stored: the work may exist at the provider.
    pub has_operation: bool,
    /// A failed attempt set a backoff that has not passed yet: a retry is due.
    pub retry_due_later: bool,
    /// Some call of the task may have done work at the provider whose answer replyd never got
    /// (`reply_tasks.provider_may_have_run`).
    pub may_have_run: bool,
    /// The task (not terminal) was worked (claimed, renewed, given back) within the
    /// redelivery bound: a worker that vanished since may still have its record uncommitted,
    /// and the group hands it to another worker once the session times out.
    pub worked_recently: bool,
}

/// What to do with a reservation past its TTL: decided from the durable task first, and
/// from the provider before anything is released or charged while the work may exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiredDecision {
    /// The task completed: charge.
    Charge,
    /// The task failed and the provider did none of its work: settle as the reservation's
    /// policy says for a failure.
    SettleFailed,
    /// The task is still being worked: keep the reservation for another TTL.
    Extend(&'static str),
    /// A provider operation may hold the work: ask the provider before deciding.
    LookUp,
    /// Nobody is working the task and no work can exist: fail it (if it is not failed yet)
    /// and let the reservation expire.
    Expire(&'static str),
    /// The provider may have done the work and nothing can tell: fail the task (if it is not
    /// failed yet) and settle as `quota.charge_unresolved` says.
    Unresolved(&'static str),
}

impl ExpiredDecision {
    pub fn label(self) -> &'static str {
        match self {
            ExpiredDecision::Charge => "charge",
            ExpiredDecision::SettleFailed => "settle_failed",
            ExpiredDecision::Extend(_) => "extend",
            ExpiredDecision::LookUp => "look_up",
            ExpiredDecision::Expire(_) => "expire",
            ExpiredDecision::Unresolved(_) => "unresolved",
        }
    }
}

pub fn decide_expired(task: ExpiredTask) -> ExpiredDecision {
    use crate::domain::TaskStatus;
    match task.status {
        TaskStatus::Completed => ExpiredDecision::Charge,
        TaskStatus::Failed if !task.may_have_run => ExpiredDecision::SettleFailed,
        // Failed, and the provider may have done the work: held until something can tell.
        TaskStatus::Failed if task.has_operation => ExpiredDecision::LookUp,
        TaskStatus::Failed => ExpiredDecision::Unresolved(
            "the task failed while the provider may have done its work, and the provider cannot be asked",
        ),
        _ if task.lease_live => ExpiredDecision::Extend("a worker holds the task's lease"),
        _ if task.has_operation => ExpiredDecision::LookUp,
        _ if task.retry_due_later => ExpiredDecision::Extend("a retry of the task is due"),
        _ if task.worked_recently => ExpiredDecision::Extend(
            "worked within the redelivery bound: its record is still owed to a worker",
        ),
        _ if task.may_have_run => ExpiredDecision::Unresolved(
            "not worked within quota.reservation_ttl_ms, and an earlier call may have done the work at the provider",
        ),
        _ => ExpiredDecision::Expire(
            "not worked within quota.reservation_ttl_ms: no live lease, no provider operation",
        ),
    }
}

/// What the provider said of a stored operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookedUp {
    Done,
    StillRunning,
    /// Unknown, cancelled, expired or failed: no reply will come from it.
    Gone,
}

/// The decision once the provider answered (for a task not yet terminal, the reconciler
/// holds its lease then).
pub fn decide_looked_up(found: LookedUp) -> ExpiredDecision {
    match found {
        LookedUp::Done => ExpiredDecision::Charge,
        LookedUp::StillRunning => ExpiredDecision::Extend("the provider's operation still runs"),
        LookedUp::Gone => {
            ExpiredDecision::Expire("the provider has no reply for the task's operation")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::TaskStatus;
    use crate::quota::policy::QuotaPolicy;
    use crate::quota::reservation::Settle;

    fn task(status: TaskStatus) -> ExpiredTask {
        ExpiredTask {
            status,
            lease_live: false,
            has_operation: false,
            retry_due_later: false,
            may_have_run: false,
            worked_recently: false,
        }
    }

    /// What `decide_expired` decides, by its label.
    fn decided(task: ExpiredTask) -> &'static str {
        decide_expired(task).label()
    }

    /// What `decide_expired` decides, by its label, for a task in `status` as `set` changes it.
    fn decided_for(status: TaskStatus, set: impl FnOnce(&mut ExpiredTask)) -> &'static str {
        let mut changed = task(status);
        set(&mut changed);
        decided(changed)
    }

    #[test]
    fn the_durable_task_decides_first() {
        assert_eq!(
            decide_expired(task(TaskStatus::Completed)),
            ExpiredDecision::Charge
        );
        assert_eq!(
            decide_expired(task(TaskStatus::Failed)),
            ExpiredDecision::SettleFailed
        );
        // A terminal task is settled whatever else the row says.
        let done_with_op = ExpiredTask {
            has_operation: true,
            lease_live: true,
            ..task(TaskStatus::Completed)
        };
        assert_eq!(decide_expired(done_with_op), ExpiredDecision::Charge);
    }

    #[test]
    fn open_work_is_extended_looked_up_or_expired() {
        let leased = |t: &mut ExpiredTask| {
            t.lease_live = true;
            t.has_operation = true;
        };
        assert_eq!(decided_for(TaskStatus::Running, leased), "extend");
        let with_operation = |t: &mut ExpiredTask| t.has_operation = true;
        assert_eq!(decided_for(TaskStatus::Running, with_operation), "look_up");
        let backing_off = |t: &mut ExpiredTask| t.retry_due_later = true;
        assert_eq!(decided_for(TaskStatus::Pending, backing_off), "extend");
        assert_eq!(decided(task(TaskStatus::Pending)), "expire");
        assert_eq!(decided(task(TaskStatus::Running)), "expire");
    }

    #[test]
    fn a_failure_whose_work_may_exist_is_not_released_as_if_nothing_ran() {
        let unknown = |t: &mut ExpiredTask| t.may_have_run = true;
        assert_eq!(decided_for(TaskStatus::Failed, unknown), "unresolved");
        let with_operation = |t: &mut ExpiredTask| {
            t.may_have_run = true;
            t.has_operation = true;
        };
        assert_eq!(decided_for(TaskStatus::Failed, with_operation), "look_up");
        // Open work nobody runs any more, whose earlier call may have run: not "expired".
        assert_eq!(decided_for(TaskStatus::Pending, unknown), "unresolved");
        let policy = QuotaPolicy {
            charge_failed: false,
            pending_reserves: true,
            reservation_ttl: std::time::Duration::from_secs(60),
            charge_unresolved: true,
        };
        assert_eq!(policy.on_unresolved(), Settle::Charge);
        let releasing = QuotaPolicy {
            charge_unresolved: false,
            ..policy
        };
        assert_eq!(releasing.on_unresolved(), Settle::Release);
    }

    #[test]
    fn a_task_worked_within_the_redelivery_bound_is_still_owed_to_a_worker() {
        for status in [TaskStatus::Pending, TaskStatus::Running] {
            let recent = ExpiredTask {
                worked_recently: true,
                may_have_run: true,
                ..task(status)
            };
            assert!(
                matches!(decide_expired(recent), ExpiredDecision::Extend(_)),
                "{status:?}"
            );
        }
        // A terminal task is settled whatever its last work was.
        let done = ExpiredTask {
            worked_recently: true,
            ..task(TaskStatus::Completed)
        };
        assert_eq!(decide_expired(done), ExpiredDecision::Charge);
    }

    #[test]
    fn the_provider_decides_before_anything_is_released() {
        assert_eq!(decide_looked_up(LookedUp::Done), ExpiredDecision::Charge);
        assert!(matches!(
            decide_looked_up(LookedUp::StillRunning),
            ExpiredDecision::Extend(_)
        ));
        assert!(matches!(
            decide_looked_up(LookedUp::Gone),
            ExpiredDecision::Expire(_)
        ));
    }
}
