//! Server-Sent Events read as the spec reads them: `eventsource-stream` parses the fields and
//! joins an event's `data:` lines with a newline, after [`LineEnds`] has ended every line
//! with LF.
//!
//! Why the line ends are rewritten first: the spec ends a line with CRLF, CR or LF, and
//! eventsource-stream 0.2 reads a line only once its end is in its buffer. A buffer that
//! ends in CR may be half of a CRLF, so the parser waits for the next byte: a server that
//! ends its lines with CR alone has each event held until more bytes come, and its last event
//! (the final `[DONE]`) never read at the end of the body. Rewriting each CR, and each CRLF,
//! as LF as the bytes arrive (a CR at the end of one chunk remembered, so that an LF opening
//! the next is taken as its pair) gives the parser only lines it can end at once. The rewrite
//! changes nothing else: no field's value can hold a CR or an LF.

use eventsource_stream::{Event, EventStreamError, Eventsource as _};
use futures_util::{Stream, StreamExt as _};

/// The events of an SSE body.
pub(crate) fn events<B, E>(
    body: impl Stream<Item = Result<B, E>>,
) -> impl Stream<Item = Result<Event, EventStreamError<E>>>
where
    B: AsRef<[u8]>,
{
    let mut line_ends = LineEnds::default();
    body.map(move |chunk| chunk.map(|bytes| line_ends.rewrite(bytes.as_ref())))
        .eventsource()
}

/// Rewrites a byte stream's line ends (CRLF, CR, LF) as LF, chunk by chunk. Pure.
#[derive(Debug, Default)]
struct LineEnds {
    /// The last chunk ended in CR: an LF at the start of this one completes its CRLF.
    after_cr: bool,
}

impl LineEnds {
    fn rewrite(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(bytes.len());
        for &byte in bytes {
            match byte {
                b'\r' => out.push(b'\n'),
                b'\n' if self.after_cr => {}
                other => out.push(other),
            }
            self.after_cr = byte == b'\r';
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The events (name, data) of `body` arriving in pieces cut at `cuts` (byte offsets).
    async fn events_of(body: &str, cuts: &[usize]) -> Vec<(String, String)> {
        let mut pieces = Vec::new();
        let mut from = 0;
        for &cut in cuts.iter().chain([&body.len()]) {
            pieces.push(Ok::<_, std::convert::Infallible>(
                body.as_bytes()[from..cut].to_vec(),
            ));
            from = cut;
        }
        let mut out = Vec::new();
        let mut events = std::pin::pin!(events(futures_util::stream::iter(pieces)));
        while let Some(event) = events.next().await {
            let event = event.expect("a well-formed stream");
            out.push((event.event, event.data));
        }
        out
    }

    /// A chunk with its finish reason written over two `data:` lines, a comment and `[DONE]`,
    /// with `eol` ending every line.
    fn split_finish(eol: &str) -> String {
        [
            ": keep-alive",
            r#"data: {"choices":[{"delta":{},"#,
            r#"data: "finish_reason":"stop","index":0}]}"#,
            "",
            "data: [DONE]",
            "",
        ]
        .iter()
        .map(|line| format!("{line}{eol}"))
        .collect()
    }

    const JOINED: &str = "{\"choices\":[{\"delta\":{},\n\"finish_reason\":\"stop\",\"index\":0}]}";

    #[tokio::test]
    async fn an_event_split_over_two_data_lines_is_one_json_chunk() {
        let events = events_of(&split_finish("\n"), &[]).await;
        let data: Vec<&str> = events.iter().map(|(_, d)| d.as_str()).collect();
        assert_eq!(data, [JOINED, "[DONE]"]);
        // Joined with a newline, the chunk is still JSON, its finish reason readable (each
        // dialect's fold of such a stream is tested over HTTP against the mock).
        let chunk: serde_json::Value = serde_json::from_str(JOINED).unwrap();
        assert_eq!(chunk["choices"][0]["finish_reason"], "stop");
    }

    #[tokio::test]
    async fn every_line_end_the_spec_allows_gives_the_same_events_however_the_body_is_cut() {
        for eol in ["\n", "\r\n", "\r"] {
            let body = split_finish(eol);
            for first in 0..=body.len() {
                for second in first..=body.len() {
                    let events = events_of(&body, &[first, second]).await;
                    let data: Vec<&str> = events.iter().map(|(_, d)| d.as_str()).collect();
                    assert_eq!(data, [JOINED, "[DONE]"], "{eol:?} cut at {first}, {second}");
                }
            }
        }
    }

    proptest! {
        /// Rewritten chunk by chunk, a body's line ends are what rewriting it whole gives: the
        /// CRLF cut between two chunks is still one line end.
        #[test]
        fn line_ends_are_rewritten_the_same_however_the_bytes_are_cut(
            body in proptest::collection::vec(prop_oneof![Just(b'\r'), Just(b'\n'), Just(b'a')], 0..40),
            cuts in proptest::collection::vec(0usize..40, 0..6),
        ) {
            let whole = LineEnds::default().rewrite(&body);
            prop_assert!(!whole.contains(&b'\r'));
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(body.len())).collect();
            cuts.sort_unstable();
            let mut ends = LineEnds::default();
            let mut pieces = Vec::new();
            let mut from = 0;
            for cut in cuts.into_iter().chain([body.len()]) {
                pieces.extend(ends.rewrite(&body[from..cut]));
                from = cut;
            }
            prop_assert_eq!(pieces, whole);
        }
    }

    #[test]
    fn each_line_end_becomes_one_lf() {
        let mut ends = LineEnds::default();
        assert_eq!(ends.rewrite(b"a\r\nb\rc\nd\r\r\n"), b"a\nb\nc\nd\n\n");
        assert_eq!(ends.rewrite(b"e\r"), b"e\n");
        assert_eq!(
            ends.rewrite(b"\nf"),
            b"f",
            "the LF completing a CRLF cut in two"
        );
    }
}
