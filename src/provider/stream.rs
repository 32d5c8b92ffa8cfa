//! Streamed answers, shared by the adapters: the Server-Sent Events of a success answer read
//! one at a time (parsed as the spec reads them, [`super::sse`]), each handed to the
//! dialect's [`StreamFold`] (pure), its text to the caller's [`TextSink`] as it arrives.
//!
//! The saved reply does not change with streaming: it is the fold's whole text, and only once
//! the provider says it is whole: its final event (`[DONE]`, `message_stop`,
//! `response.completed`), or, as the providers' SDKs take it, a finish reason (`finish_reason`,
//! `stop_reason`) followed by the clean end of the body, which is how some OpenAI-compatible
//! servers end a stream. Everything read is read until one of those, so a usage chunk sent
//! after the finish reason is kept. Everything before that is a hint for the task's
//! followers. A stream that ends otherwise (a cut connection, a clean end before any finish
//! reason, a stall past `provider.stream_idle_timeout_ms`) is a call whose answer was lost,
//! `Ambiguous` as a broken body always was; an error event after the first tokens is a
//! failure after the provider started working, `MaybeExecuted`.

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use futures_util::StreamExt as _;
use reqwest::{Response, StatusCode};
use serde::Deserialize;

use super::adapter::TextSink;
use super::generation::Reply;
use super::http::body;
use replyd_core::provider::{Generation, ProviderError, RateSignals, Usage};

/// What a dialect makes of a streamed answer, one event at a time. Pure: the adapters' tests
/// feed it the events the real APIs send.
pub(crate) trait StreamFold: Send {
    /// One event (its `event:` name, empty when it has none, and its `data:`): the text it
    /// adds (borrowed from `data` unless it held escapes: most events are a piece of text, and
    /// most pieces need no copy of their own), or the error it reports.
    fn event<'d>(
        &mut self,
        event: &str,
        data: &'d str,
    ) -> Result<Option<Cow<'d, str>>, ProviderError>;
    /// Whether the provider's final event has arrived: nothing more is read after it.
    fn finished(&self) -> bool;
    /// Whether the answer is whole should the body end cleanly here, before the final event.
    /// The SDKs' reading: a finish reason has arrived and the body ended, with no error and
    /// no stall, so nothing was lost but what would have come after it. False by default.
    fn whole_at_clean_end(&self) -> bool {
        false
    }
    /// What has come of the reply so far.
    fn reply(&self) -> &Reply;
    /// The usage the provider has reported so far (Anthropic reports the prompt's at the
    /// start and the output's at the end; OpenAI only at the end).
    fn usage(&self) -> Option<Usage> {
        self.reply().usage
    }
    /// Characters of text received so far.
    fn chars(&self) -> usize {
        self.reply().chars()
    }
    /// The generation, once finished.
    fn generation(self) -> Result<Generation, ProviderError>;
}

/// A stream that names its finish reason before its final event, as chat completions'
/// (`finish_reason`, then `[DONE]`) and Messages (`stop_reason`, then `message_stop`) do: its
/// dialect's [`ReasonEvents`] reads each event into the [`Folded`] parts every such stream
/// has. Pure.
pub(crate) struct ReasonStream<E> {
    asked_model: String,
    folded: Folded,
    events: E,
}

/// What a [`ReasonStream`] has given so far.
#[derive(Default)]
pub(crate) struct Folded {
    pub(crate) reply: Reply,
    /// The finish reason, once one came.
    pub(crate) finish_reason: Option<String>,
    /// Whether the final event came.
    pub(crate) done: bool,
}

/// A dialect's reading of a [`ReasonStream`]'s events.
pub(crate) trait ReasonEvents: Default + Send {
    /// One event (as [`StreamFold::event`]), what it says kept in `folded`.
    fn event<'d>(
        &mut self,
        folded: &mut Folded,
        event: &str,
        data: &'d str,
    ) -> Result<Option<Cow<'d, str>>, ProviderError>;
    /// Why the finished stream's reply is no generation (a refusal, a finish with no text), if
    /// it is none.
    fn refused(&self, folded: &Folded) -> Option<ProviderError>;
}

impl<E: ReasonEvents> ReasonStream<E> {
    pub(crate) fn new(asked_model: &str) -> Self {
        Self {
            asked_model: asked_model.to_owned(),
            folded: Folded::default(),
            events: E::default(),
        }
    }
}

impl<E: ReasonEvents> StreamFold for ReasonStream<E> {
    fn event<'d>(
        &mut self,
        event: &str,
        data: &'d str,
    ) -> Result<Option<Cow<'d, str>>, ProviderError> {
        self.events.event(&mut self.folded, event, data)
    }

    fn finished(&self) -> bool {
        self.folded.done
    }

    /// The providers' SDKs build the answer from the events they got and return it when the
    /// body ends, and require a finish reason: a body that ends cleanly after it is the whole
    /// answer (a usage sent after it may then be missing), one that ends before it is not.
    fn whole_at_clean_end(&self) -> bool {
        self.folded.finish_reason.is_some()
    }

    fn reply(&self) -> &Reply {
        &self.folded.reply
    }

    fn generation(self) -> Result<Generation, ProviderError> {
        match self.events.refused(&self.folded) {
            Some(error) => Err(error),
            None => Ok(self.folded.reply.generation(&self.asked_model)),
        }
    }
}

/// A success answer to a request that asked for a stream, as a generation carrying the
/// answer's rate signals: its events folded by `fold` (pieces to `sink`), or, from a server
/// that answered the whole reply instead, its body read by `whole`.
pub(crate) async fn answer<F: StreamFold>(
    response: Response,
    mut fold: F,
    sink: &dyn TextSink,
    idle: Duration,
    request_timeout: Duration,
    whole: impl FnOnce(StatusCode, &[u8]) -> Result<Generation, ProviderError>,
) -> Result<Generation, ProviderError> {
    let signals = RateSignals::read(response.headers(), SystemTime::now());
    let mut generation = if is_event_stream(&response) {
        read(response, &mut fold, sink, idle)
            .await
            .map_err(|cut| cut.error)?;
        fold.generation()?
    } else {
        let status = response.status();
        whole(status, &body(response, request_timeout).await?)?
    };
    generation.rate_signals = signals;
    Ok(generation)
}

/// How a read of a stream ended without a generation.
pub(crate) struct Cut {
    pub error: ProviderError,
    /// Whether the connection (not the provider) ended it: the provider may still be working,
    /// and an API that can resume a stream can pick it up where it broke.
    pub connection: bool,
}

/// Reads `response`'s events into `fold` until its final event, handing each piece of text
/// and each usage report to `sink`. `idle` bounds the wait for any one event.
pub(crate) async fn read<F: StreamFold>(
    response: Response,
    fold: &mut F,
    sink: &dyn TextSink,
    idle: Duration,
) -> Result<(), Cut> {
    let mut events = std::pin::pin!(super::sse::events(response.bytes_stream()));
    let mut reported = fold.usage();
    // One timer for the whole stream, moved only when it fires: an answer is many small
    // events, and a timer set and cleared around each (`tokio::time::timeout`) is work for
    // every piece. The stream has stalled when the timer fires and no event came in the
    // `idle` before.
    let mut quiet = std::pin::pin!(tokio::time::sleep(idle));
    let mut last_event = tokio::time::Instant::now();
    loop {
        let next = tokio::select! {
            biased;
            next = events.next() => next,
            () = &mut quiet => {
                let stalled_until = last_event + idle;
                if tokio::time::Instant::now() >= stalled_until {
                    return Err(lost(
                        fold,
                        &format!(
                            "no event for {} ms (provider.stream_idle_timeout_ms)",
                            idle.as_millis()
                        ),
                    ));
                }
                quiet.as_mut().reset(stalled_until);
                continue;
            }
        };
        last_event = tokio::time::Instant::now();
        let event = match next {
            // Some servers end the body after the finish reason (and the usage) without their
            // final event; a cut connection is an error, not this clean end.
            None if fold.whole_at_clean_end() => return Ok(()),
            None => return Err(lost(fold, "the stream ended without its final event")),
            Some(Err(e)) => return Err(lost(fold, &format!("the stream broke: {e}"))),
            Some(Ok(event)) => event,
        };
        let text = fold.event(&event.event, &event.data).map_err(|error| Cut {
            error,
            connection: false,
        })?;
        if let Some(text) = text.filter(|t| !t.is_empty()) {
            sink.text(&text);
        }
        let usage = fold.usage();
        if usage != reported {
            if let Some(usage) = usage {
                sink.usage(usage);
            }
            reported = usage;
        }
        if fold.finished() {
            return Ok(());
        }
    }
}

/// Whether an answer is an event stream: a server that ignores `stream` (an older
/// OpenAI-compatible one, a gateway) answers the whole reply as JSON, which is read as such.
pub(crate) fn is_event_stream(response: &Response) -> bool {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}

/// An event's name: its `data`'s own `type` where it has one (the SSE `event:` line repeats
/// it, and a server may leave that line out), else the `event:` line's.
pub(crate) fn event_name<'a>(data_type: &'a str, event: &'a str) -> &'a str {
    if data_type.is_empty() {
        event
    } else {
        data_type
    }
}

/// An answer lost in transit after `fold` had part of it: `Ambiguous`, saying how much came.
fn lost(fold: &impl StreamFold, why: &str) -> Cut {
    Cut {
        error: ProviderError::Ambiguous {
            message: format!("{why} after {} characters of text", fold.chars()),
        },
        connection: true,
    }
}

/// An error event after the provider started answering: it ran (and may bill what it wrote).
pub(crate) fn failed_mid_stream(
    status: u16,
    kind: Option<&str>,
    message: &str,
    chars: usize,
) -> ProviderError {
    ProviderError::MaybeExecuted {
        status,
        message: format!(
            "{}{message} (an error event after {chars} characters of text)",
            kind.map(|k| format!("{k}: ")).unwrap_or_default()
        ),
    }
}

/// The error object of an error event after the first tokens: Messages' `error` event, a chat
/// completion stream's `error` chunk.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ErrorEvent {
    #[serde(rename = "type")]
    pub(crate) kind: Option<String>,
    pub(crate) message: Option<String>,
}

impl ErrorEvent {
    /// The failure it reports ([`failed_mid_stream`]) after the text `folded` holds.
    pub(crate) fn failed_mid_stream(&self, status: u16, folded: &Folded) -> ProviderError {
        failed_mid_stream(
            status,
            self.kind.as_deref(),
            self.message.as_deref().unwrap_or("no message"),
            folded.reply.chars(),
        )
    }
}

/// A stream event that is not what its dialect documents.
pub(crate) fn malformed(what: &str, error: impl std::fmt::Display) -> ProviderError {
    ProviderError::MalformedResponse {
        message: format!("stream event is not {what}: {error}"),
    }
}

/// A string of an event's data, borrowed from it unless it holds escapes: a stream is many
/// small events, and their strings (ids, types, pieces of text) need not each be allocated.
/// serde borrows a `Cow<str>` only as a field of its own, never inside an `Option`, hence the
/// wrapper.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Text<'a>(#[serde(borrow)] pub Cow<'a, str>);

impl Text<'_> {
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }

    pub(crate) fn into_owned(self) -> String {
        self.0.into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Event<'a> {
        #[serde(borrow)]
        piece: Option<Text<'a>>,
    }

    #[test]
    fn a_piece_is_borrowed_from_the_data_unless_it_holds_escapes() {
        let plain: Event = serde_json::from_str(r#"{"piece":"Hello"}"#).unwrap();
        assert!(matches!(plain.piece, Some(Text(Cow::Borrowed("Hello")))));
        let escaped: Event = serde_json::from_str(r#"{"piece":"a\nb"}"#).unwrap();
        assert!(matches!(escaped.piece, Some(Text(Cow::Owned(ref s))) if s == "a\nb"));
        let absent: Event = serde_json::from_str("{}").unwrap();
        assert!(absent.piece.is_none());
    }
}
