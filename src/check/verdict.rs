//! The verdict on every invariant, from the facts alone. Pure.

use super::facts::Facts;
use super::report::{Percentiles, Report};
use crate::transport::Transport;

/// The `p` quantile of `sorted` by the nearest-rank method (0 when empty).
pub fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Judges the facts. Pure. The records were judged one by one as they were read
/// (`replyd_core::tally::RecordTallies::add`, by the source's transport); this judges the counts.
pub fn verdict(facts: Facts) -> Report {
    let tasks = facts.statuses.tasks;
    let mut report = Report {
        source: facts.source,
        tasks,
        completed: facts.statuses.completed,
        failed: facts.statuses.failed,
        cancelled: facts.statuses.cancelled,
        pending: facts.statuses.open,
        dead_lettered: facts.dead_lettered,
        records: facts.records.records,
        bad_records: facts.records.bad,
        uncommitted_records: facts.records.uncommitted,
        duplicate_replies: facts.duplicate_replies,
        lost: facts.records.lost,
        fenced_rejections: facts.fenced_rejections,
        refused_calls: facts.refused_calls,
        attempts: facts.attempts.total,
        attempts_per_task: Percentiles {
            p50: facts.attempts.p50,
            p99: facts.attempts.p99,
            max: facts.attempts.max,
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
        cancelled_misettled: facts.quota.cancelled_misettled,
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
        report.violations.push(match facts.source {
            Transport::Kafka => {
                "I3 nothing lost: records committed past without a terminal task or dead-letter copy".into()
            }
            Transport::Sqs => {
                "I3 nothing lost: open tasks handed to the queue with no message left in it".into()
            }
        });
    }
    if report.max_attempts_exceeded > 0 {
        report
            .violations
            .push("I7 bounded effort: tasks with more attempts than max_attempts".into());
    }
    if report.reservations_unsettled > 0
        || report.completed_without_charge > 0
        || report.cancelled_misettled > 0
        || report.charges_without_reply > 0
        || report.quota_counter_mismatches > 0
        || report.token_charge_mismatches > 0
    {
        report.violations.push(
            "I8 quota once: a reservation past its TTL unsettled, a completed task without its charge, a cancelled task's reservation settled against the Stop's rule (charged when its call may have run, else released), a charge without its reply, a counter that disagrees with its reservations, or a token charge other than the reply's reported usage (else its ceiling)"
                .into(),
        );
    }
    if report.duplicate_tasks > 0 || report.tasks_without_one_outbox_row > 0 {
        report.violations.push(
            "I6 one logical request: a submission with more than one task, or an API task or a retry without exactly one outbox row"
                .into(),
        );
    }
    report
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::facts::{AttemptStats, MockCounts, QuotaFacts, StatusCounts};
    use super::*;
    use replyd_core::tally::RecordTallies;

    #[test]
    fn a_record_committed_past_without_an_outcome_breaks_i3() {
        let facts = Facts {
            records: RecordTallies {
                records: 4,
                bad: 1,
                uncommitted: 1,
                lost: 1,
            },
            dead_lettered: 1,
            statuses: StatusCounts {
                tasks: 2,
                completed: 1,
                failed: 0,
                cancelled: 0,
                open: 1,
            },
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
    fn on_sqs_an_open_task_without_its_message_breaks_i3_in_the_queue_s_words() {
        use replyd_core::tally::QueueFacts;
        let queue = QueueFacts {
            in_queue: 0,
            dead_letters: 1,
            open_handed: 1,
        };
        let report = verdict(Facts {
            source: Transport::Sqs,
            records: queue.tallies(),
            dead_lettered: queue.dead_letters,
            ..Facts::default()
        });
        assert_eq!(report.source, Transport::Sqs);
        assert_eq!(report.lost, 1);
        assert!(report.violations[0].starts_with("I3") && report.violations[0].contains("queue"));
        let table = report.render_table();
        assert!(table.contains("lost tasks"), "{table}");
        assert!(!table.contains("records in the topic"), "{table}");
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
    fn a_cancelled_task_whose_reservation_was_settled_against_the_stops_rule_breaks_i8() {
        let report = verdict(Facts {
            statuses: StatusCounts {
                tasks: 1,
                cancelled: 1,
                ..StatusCounts::default()
            },
            quota: QuotaFacts {
                charged: 1,
                cancelled_misettled: 1,
                ..QuotaFacts::default()
            },
            ..Facts::default()
        });
        let named: Vec<&str> = report.violations.iter().map(|v| &v[..2]).collect();
        assert_eq!(named, ["I8"]);
        assert!(report.summary_line().contains("cancelled=1"));
        assert!(
            report
                .render_table()
                .contains("cancelled, settled against the Stop's rule")
        );
    }

    #[test]
    fn the_table_and_the_summary_show_the_mock_beside_the_attempts() {
        let report = verdict(Facts {
            statuses: StatusCounts {
                tasks: 1,
                completed: 1,
                ..StatusCounts::default()
            },
            attempts: AttemptStats {
                total: 2,
                p50: 2,
                p99: 2,
                max: 2,
            },
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
