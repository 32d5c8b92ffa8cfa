//! `replyd worker` end to end: real worker processes in a real consumer group on the real
//! broker, the real PostgreSQL, and the mock provider over HTTP. Each test names the failure it
//! provokes and the invariants it checks from the durable state afterwards.
//!
//! This file holds the invariants every room asserts. The rooms: [`delivery`] (records in, one
//! reply each, and the commit point), [`startup`] (settings, unreachable parts, the dead-letter
//! topic and health), [`dead_letters`] (bad records, the dead-letter topic and its replay),
//! [`rebalance`] (partitions moving between workers), [`parked`] (duplicates parked on a
//! lease and woken) and [`takeover`] (a lost holder's leases taken over, a zombie fenced).

mod dead_letters;
mod delivery;
mod parked;
mod rebalance;
mod startup;
mod takeover;

use std::time::Duration;

use crate::helpers::app::TestApp;

const LIMIT: Duration = Duration::from_secs(120);

/// Asserts the invariants the checker reads back: one reply per task (I1), nothing committed
/// past unfinished work (I3), attempts within budget (I7).
async fn assert_invariants(app: &TestApp, tasks: usize) -> replyd::check::Report {
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.duplicate_replies, 0, "{report:#?}");
    assert_eq!(report.lost, 0, "{report:#?}");
    assert_eq!(report.completed, tasks as i64, "{report:#?}");
    assert_eq!(report.pending, 0, "{report:#?}");
    report
}
