//! Which of a streamed response's faults fail the response itself and which break only the
//! connection it is read on. Apart from the book because it decides from a fault, not from a
//! response's state.

use crate::mock_provider::behaviour::Fault;

/// After how many deltas a streamed response's generation fails under `fault`: a stream error
/// fails the response itself (`response.failed`), as a server error mid-generation does.
pub fn generation_failure(fault: Fault) -> Option<usize> {
    match fault {
        Fault::StreamError { after_chunks, .. } => Some(after_chunks),
        _ => None,
    }
}

/// The fault a streamed response's connection gets: a cut or a stall breaks the connection
/// only (the response goes on in the background, to be resumed); a stream error is the
/// response's (at its create, [`generation_failure`]; a resume only reads it), not the
/// connection's.
pub fn connection_fault(fault: Fault) -> Fault {
    match fault {
        Fault::StreamError { .. } => Fault::None,
        fault => fault,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_error_fails_the_response_while_a_cut_breaks_only_the_connection() {
        let error = Fault::StreamError {
            after_chunks: 2,
            status: 500,
        };
        assert_eq!(generation_failure(error), Some(2));
        assert_eq!(connection_fault(error), Fault::None);
        let cut = Fault::StreamCut { after_chunks: 2 };
        assert_eq!(generation_failure(cut), None);
        assert_eq!(connection_fault(cut), cut);
        assert_eq!(generation_failure(Fault::DropAfterWork), None);
        assert_eq!(connection_fault(Fault::DropAfterWork), Fault::DropAfterWork);
    }
}
