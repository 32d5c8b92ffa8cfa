//! The messages a worker holds, by message id: pure bookkeeping, no I/O. A Standard queue may
//! deliver a message again while this worker still runs it (within its visibility window, or
//! after an extension failed): that copy starts nothing, but its receipt handle replaces the
//! one held, because SQS acts only on a message's newest handle (a delete with an older one
//! "succeeds but might not delete" on AWS, and is refused by some emulators).

use std::collections::HashMap;

/// What a received message is to this worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Not held: start its handler.
    New,
    /// Already held (a duplicate delivery): its newest handle is kept, nothing starts.
    Again,
}

/// The messages held: received, and neither deleted nor handed back yet.
#[derive(Debug, Default)]
pub struct InFlight {
    held: HashMap<String, String>,
}

impl InFlight {
    /// Takes a received message in.
    pub fn arrive(&mut self, message_id: &str, receipt_handle: &str) -> Arrival {
        match self.held.get_mut(message_id) {
            Some(handle) => {
                *handle = receipt_handle.to_owned();
                Arrival::Again
            }
            None => {
                self.held
                    .insert(message_id.to_owned(), receipt_handle.to_owned());
                Arrival::New
            }
        }
    }

    /// Lets a message go (its handler ended): its newest handle, to delete it or hand it back
    /// with.
    pub fn settle(&mut self, message_id: &str) -> Option<String> {
        self.held.remove(message_id)
    }

    /// Every held message's id and newest handle, for the visibility extension.
    pub fn handles(&self) -> Vec<(String, String)> {
        self.held
            .iter()
            .map(|(id, handle)| (id.clone(), handle.clone()))
            .collect()
    }

    /// Whether `message_id` is still held under `receipt_handle` (not let go, not received
    /// again since).
    pub fn holds(&self, message_id: &str, receipt_handle: &str) -> bool {
        self.held
            .get(message_id)
            .is_some_and(|handle| handle == receipt_handle)
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_delivery_of_a_held_message_starts_nothing_and_its_newest_handle_is_used() {
        let mut held = InFlight::default();
        assert_eq!(held.arrive("m1", "h1"), Arrival::New);
        assert_eq!(held.arrive("m2", "h9"), Arrival::New);
        assert_eq!(held.arrive("m1", "h2"), Arrival::Again);
        assert_eq!(held.len(), 2);
        assert!(held.holds("m1", "h2") && !held.holds("m1", "h1"));
        assert_eq!(held.settle("m1").as_deref(), Some("h2"));
        assert!(!held.holds("m1", "h2"));
        assert_eq!(held.settle("m1"), None, "settled once");
        // Received again after it was let go (its delete may not have taken): a new run,
        // which the task's claim answers.
        assert_eq!(held.arrive("m1", "h3"), Arrival::New);
    }
}
