//! The store's server-side functions against a real PostgreSQL, each checked against the Rust
//! code that is its specification or that reads what it writes.
//!
//! The rooms: [`claim`] (`replyd_claim` decides what `lease::decide_claim` decides),
//! [`capacity`] (`replyd_pace` schedules what `pacing::schedule` schedules, and the budget
//! shared by workers), [`learned_rate`] (the learned rate's SQL moves as `pacing::Learned`
//! moves), [`closed_sets`] (the code's closed sets are the columns' `CHECK` lists and the claim
//! function's answers) and [`notifications`] (a transaction's status changes announced
//! together).

mod capacity;
mod claim;
mod closed_sets;
mod learned_rate;
mod notifications;
