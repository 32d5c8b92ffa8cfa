//! Server-Sent Events read as the spec reads them, by `sseer`: it ends a line at CRLF, CR or
//! LF (a CR at the end of a chunk held until the next byte says whether an LF completes it,
//! and taken as a line end when the body ends), and joins an event's `data:` lines with a
//! newline.
//!
//! Why this parser: it scans for line ends with `memchr` over the body's own `Bytes` and hands
//! each field out as a slice of them, so a chunk holding a whole stream (as a fast server
//! sends it) is read in one pass; a parser that copies the rest of its buffer at each line
//! costs time in the square of the lines a chunk holds (P3 in `docs/BENCHMARKS.md`).

use futures_util::Stream;
pub(crate) use sseer::{errors::EventStreamError, event::Event};

/// The events of an SSE body.
pub(crate) fn events<B, E>(
    body: impl Stream<Item = Result<B, E>>,
) -> impl Stream<Item = Result<Event, EventStreamError<E>>>
where
    B: Into<bytes::Bytes>,
{
    sseer::event_stream::EventStream::new(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
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
            out.push((event.event.to_string(), event.data.to_string()));
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
        /// However a body's lines end (each line by CRLF, CR or LF, mixed) and however it is
        /// cut into chunks, it gives the events the same body ended by LF gives whole: a CRLF
        /// cut between two chunks is one line end, and a CR that ends the body ends its line.
        #[test]
        fn events_are_the_same_whatever_the_line_ends_and_the_cuts(
            events in proptest::collection::vec(
                (prop_oneof![Just(""), Just("delta"), Just("done")], "[a-z {}\":]{0,12}", 1usize..3),
                0..5,
            ),
            ends in proptest::collection::vec(prop_oneof![Just("\n"), Just("\r\n"), Just("\r")], 16),
            cuts in proptest::collection::vec(0usize..200, 0..6),
        ) {
            let mut lines = Vec::new();
            for (name, data, copies) in &events {
                if !name.is_empty() {
                    lines.push(format!("event: {name}"));
                }
                for _ in 0..*copies {
                    lines.push(format!("data: {data}"));
                }
                lines.push(String::new());
            }
            let plain: String = lines.iter().map(|line| format!("{line}\n")).collect();
            let mut mixed = String::new();
            let mut before = "";
            for (line, &eol) in lines.iter().zip(ends.iter().cycle()) {
                // A CR, an empty line and an LF read as one CRLF: that empty line ends its
                // event, so it is written ended by CRLF instead.
                let eol = if before == "\r" && line.is_empty() && eol == "\n" { "\r\n" } else { eol };
                mixed.push_str(line);
                mixed.push_str(eol);
                before = eol;
            }
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(mixed.len())).collect();
            cuts.sort_unstable();
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let whole = runtime.block_on(events_of(&plain, &[]));
            prop_assert_eq!(whole.len(), events.len());
            prop_assert_eq!(runtime.block_on(events_of(&mixed, &cuts)), whole);
        }
    }
}
