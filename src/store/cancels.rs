//! Stop: `replyd_cancel` (V23) ends an open task `cancelled` under its row lock, fencing the
//! running assignment and releasing the reservation; a finished task is left as it is.

use replyd_core::domain::TaskId;

use super::{Store, StoreError};

/// What a cancel did, as `replyd_cancel` answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The task was open and is cancelled now.
    Cancelled,
    /// An earlier cancel ended it: nothing changed.
    AlreadyCancelled,
    /// Its reply was saved first: nothing changed.
    AlreadyCompleted,
    /// It had failed for good: nothing changed.
    AlreadyFailed,
    /// No such task (never there, or forgotten).
    NotFound,
}

impl CancelOutcome {
    /// Every outcome, in the order of the enum.
    pub const ALL: [CancelOutcome; 5] = [
        CancelOutcome::Cancelled,
        CancelOutcome::AlreadyCancelled,
        CancelOutcome::AlreadyCompleted,
        CancelOutcome::AlreadyFailed,
        CancelOutcome::NotFound,
    ];

    /// The label `replyd_cancel` answers with (`forgotten` is read as not found), and the
    /// `outcome` label of `replyd_api_cancels_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            CancelOutcome::Cancelled => "cancelled",
            CancelOutcome::AlreadyCancelled => "already_cancelled",
            CancelOutcome::AlreadyCompleted => "already_completed",
            CancelOutcome::AlreadyFailed => "already_failed",
            CancelOutcome::NotFound => "not_found",
        }
    }

    fn parse(label: &str) -> Option<Self> {
        if label == "forgotten" {
            return Some(CancelOutcome::NotFound);
        }
        Self::ALL.into_iter().find(|o| o.as_str() == label)
    }
}

impl Store {
    /// Cancels `task_id` (one statement, one transaction).
    pub async fn cancel(&self, task_id: TaskId) -> Result<CancelOutcome, StoreError> {
        let label: String = self
            .row(
                "SELECT outcome FROM replyd_cancel($1)",
                &[&task_id.as_uuid()],
            )
            .await?
            .get(0);
        CancelOutcome::parse(&label)
            .ok_or_else(|| StoreError::Config(format!("unknown cancel outcome {label:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_label_reads_back_and_a_forgotten_task_is_not_found() {
        for outcome in CancelOutcome::ALL {
            assert_eq!(CancelOutcome::parse(outcome.as_str()), Some(outcome));
        }
        assert_eq!(
            CancelOutcome::parse("forgotten"),
            Some(CancelOutcome::NotFound)
        );
        assert_eq!(CancelOutcome::parse("cancelled_twice"), None);
    }
}
