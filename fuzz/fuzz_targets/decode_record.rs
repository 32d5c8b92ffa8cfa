//! Fuzzes the record decoder and the checks behind it: whatever bytes arrive on the topic,
//! `TaskSpec::from_record` returns a task or a typed `RecordError` (a dead-letter reason); it
//! never panics, and a task it returns survives a round trip through the wire format.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use replyd_core::domain::{RecordRules, TaskSpec};

fuzz_target!(|bytes: &[u8]| {
    let rules = RecordRules::default();
    match TaskSpec::from_record(Some(bytes), None, &rules) {
        Ok(spec) => {
            let again = TaskSpec::from_record(Some(&spec.to_proto().encode_to_vec()), None, &rules)
                .expect("a decoded task encodes to a valid record");
            assert_eq!(again, spec);
        }
        Err(error) => {
            // Every refusal has a stable label and a message for the DLQ headers.
            assert!(!error.kind().is_empty());
            assert!(!error.to_string().is_empty());
        }
    }
});
