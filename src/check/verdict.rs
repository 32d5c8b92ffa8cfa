//! The verdict on every invariant, from the facts alone. Pure.

use super::facts::Facts;
use super::report::{Percentiles, Report};
use replyd_core::domain::TaskStatus;

/// The `p` quantile of `sorted` by the nearest-rank method (0 when empty).
pub fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Judges the facts. Pure.
pub fn verdict(facts: Facts) -> Report {
    let mut lost = 0;
    let mut bad_records = 0;
    let mut uncommitted_records = 0;
    for record in &facts.source {
        let below_commit = facts
            .committed
            .get(&record.partition)
            .is_some_and(|c| record.offset < *c);
        let dead_lettered = facts.dead.contains(&(record.partition, record.offset));
        if record.task.is_none() {
            bad_records += 1;
        }
        if !below_commit {
            uncommitted_records += 1;
        }
        if !below_commit || dead_lettered {
            continue;
        }
        let terminal = record
            .task
            .and_then(|id| facts.statuses.get(&id))
            .is_some_and(|s| s.is_terminal());
        if !terminal {
            lost += 1;
        }
    }
    let count =
        |status: TaskStatus| facts.statuses.values().filter(|s| **s == status).count() as i64;
    let mut attempts_per_task = facts.attempts_per_task;
    attempts_per_task.sort_unstable();
    let tasks = facts.statuses.len() as i64;
    let mut report = Report {
        tasks,
        completed: count(TaskStatus::Completed),
        failed: count(TaskStatus::Failed),
        pending: count(TaskStatus::Pending) + count(TaskStatus::Running),
        dead_lettered: facts.dead.len() as i64,
        records: facts.source.len() as i64,
        bad_records,
        uncommitted_records,
        duplicate_replies: facts.duplicate_replies,
        lost,
        fenced_rejections: facts.fenced_rejections,
        refused_calls: facts.refused_calls,
        attempts: attempts_per_task.iter().sum(),
        attempts_per_task: Percentiles {
            p50: percentile(&attempts_per_task, 0.50),
            p99: percentile(&attempts_per_task, 0.99),
            max: attempts_per_task.last().copied().unwrap_or(0),
        },
        max_attempts_exceeded: facts.max_attempts_exceeded,
        duplicate_tasks: facts.duplicate_tasks,
        tasks_without_one_outbox_row: facts.tasks_without_one_outbox_row,
        outbox_unpublished: facts.outbox_unpublished,
        reservations_open: facts.quota.open,
        reservations_charged: facts.quota.charged,
        reservations_released: facts.quota.released,
        reservations_expired: facts.quota.expired,
        reservations_unsettled: facts.quota.unsettled,
        reservations_unresolved: facts.quota.unresolved,
        completed_without_charge: facts.quota.completed_without_charge,
        charges_without_reply: facts.quota.charges_without_reply,
        quota_counter_mismatches: facts.quota.counter_mismatches,
        token_charge_mismatches: facts.quota.token_charge_mismatches,
        replies_by_worker: facts.replies_by_worker,
        mock_requests: facts.mock.map(|m| m.requests),
        mock_generations: facts.mock.map(|m| m.generations),
        mock_requests_per_task: facts
            .mock
            .filter(|_| tasks > 0)
            .map(|m| m.requests as f64 / tasks as f64),
        violations: Vec::new(),
    };
    if report.duplicate_replies > 0 {
        report
            .violations
            .push("I1 one reply: tasks with more than one accepted reply".into());
    }
    if report.lost > 0 {
        report.violations.push(
            "I3 nothing lost: records committed past without a terminal task or dead-letter copy"
                .into(),
        );
    }
    if report.max_attempts_exceeded > 0 {
        report
            .violations
            .push("I7 bounded effort: tasks with more attempts than max_attempts".into());
    }
    if report.reservations_unsettled > 0
        || report.completed_without_charge > 0
        || report.charges_without_reply > 0
        || report.quota_counter_mismatches > 0
        || report.token_charge_mismatches > 0
    {
        report.violations.push(
            "I8 quota once: a reservation past its TTL unsettled, a completed task without its charge, a charge without its reply, a counter that disagrees with its reservations, or a token charge other than the reply's reported usage (else its ceiling)"
                .into(),
        );
    }
    if report.duplicate_tasks > 0 || report.tasks_without_one_outbox_row > 0 {
        report.violations.push(
            "I6 one logical request: a submission with more than one task, or an API task without exactly one outbox row"
                .into(),
        );
    }
    report
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap, HashSet};

    use uuid::Uuid;

    use super::super::facts::{MockCounts, SourceRecord};
    use super::*;

    fn record(partition: i32, offset: i64, task: Option<Uuid>) -> SourceRecord {
        SourceRecord {
            partition,
            offset,
            task,
        }
    }

    #[test]
    fn a_record_committed_past_without_an_outcome_is_lost() {
        let (done, open) = (Uuid::new_v4(), Uuid::new_v4());
        let facts = Facts {
            source: vec![
                record(0, 0, Some(done)),
                record(0, 1, None),
                record(0, 2, Some(open)),
                record(0, 3, Some(open)),
            ],
            // Offset 1 is a bad record with its dead-letter copy; 2 is committed past while
            // its task is still running; 3 is not committed past yet.
            dead: HashSet::from([(0, 1)]),
            committed: HashMap::from([(0, 3)]),
            statuses: HashMap::from([(done, TaskStatus::Completed), (open, TaskStatus::Running)]),
            ..Facts::default()
        };
        let report = verdict(facts);
        assert_eq!(report.lost, 1);
        assert_eq!(report.bad_records, 1);
        assert_eq!(report.uncommitted_records, 1);
        assert_eq!((report.completed, report.pending), (1, 1));
        assert_eq!(report.violations.len(), 1);
        assert!(
            report.violations[0].starts_with("I3"),
            "{:?}",
            report.violations
        );
    }

    #[test]
    fn duplicates_and_budget_overruns_name_i1_i7_and_i6() {
        let report = verdict(Facts {
            duplicate_replies: 1,
            max_attempts_exceeded: 2,
            duplicate_tasks: 1,
            ..Facts::default()
        });
        let named: Vec<&str> = report.violations.iter().map(|v| &v[..2]).collect();
        assert_eq!(named, ["I1", "I7", "I6"]);
        assert!(report.render_table().contains("BROKEN"));
    }

    #[test]
    fn the_table_and_the_summary_show_the_mock_beside_the_attempts() {
        let task = Uuid::new_v4();
        let report = verdict(Facts {
            statuses: HashMap::from([(task, TaskStatus::Completed)]),
            attempts_per_task: vec![2],
            replies_by_worker: BTreeMap::from([("w1".to_string(), 1)]),
            mock: Some(MockCounts {
                requests: 2,
                generations: 1,
            }),
            ..Facts::default()
        });
        assert_eq!(report.mock_requests_per_task, Some(2.0));
        let table = report.render_table();
        assert!(table.contains("every invariant holds"), "{table}");
        assert!(table.contains("2.000 per task"), "{table}");
        assert!(!table.contains("Report {"), "{table}");
        let line = report.summary_line();
        assert!(
            line.contains("provider_requests=2 generations=1 replies_by_worker=w1:1"),
            "{line}"
        );
    }
}
