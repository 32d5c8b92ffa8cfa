//! Kafka at the edges: the group consumer, the in-flight offset tracker behind its commits,
//! and the dead-letter producer.

pub mod consumer;
pub mod dead_letter;
pub mod tracker;
