//! The domain: what a task is, independent of where it comes from or is kept. Pure: no I/O.
//!
//! - [`record`]: untrusted records parsed into trusted [`TaskSpec`] values, or a
//!   [`RecordError`] naming the problem (a dead-letter reason).
//! - [`task`]: the stored task, its lifecycle and the outcomes of its attempts and records.
//! - [`limits`]: the bounds of what a task may carry from the intake to Kafka.

pub mod limits;
pub mod record;
pub mod task;

pub use record::*;
pub use task::*;
