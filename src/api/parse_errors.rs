//! hyper's own answer to a request head its parser refuses, made a problem like every other
//! refusal of the API.
//!
//! When hyper's HTTP/1 parser refuses a head (a byte HTTP does not allow in a header, a bad
//! request line, a `Content-Length` that is not one number, a head over the parser's caps)
//! it writes a status line (`400`, `414` or `431`) with `content-length: 0` and closes the
//! connection; the application never sees the request, and no option of hyper changes that
//! answer. [`ProblemIo`] sits between hyper and the socket. Its write side puts a
//! problem+json answer in place of that bare head; its read side keeps a copy of the current
//! request's head (at most what hyper's buffer holds), so the problem can name what was
//! wrong, e.g. the header with a DEL byte in it.
//!
//! The decisions are pure: [`bare_error_at`] finds hyper's answer in what hyper writes,
//! [`problem_for`] reads the head hyper refused, [`answer`] renders the replacement. Every
//! answer of the application has a body and a content type, so a bodiless `4xx` head can only
//! be hyper's. The copy of a head starts when the previous answer is written: a head a client
//! pipelines behind an earlier request is kept only from there, and its problem may then say
//! less, or quote the wrong line.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::problem::{Problem, ProblemKind};

/// hyper's longest request target (`MAX_URI_LEN`); a longer one it answers `414`.
pub const HYPER_MAX_URI_BYTES: usize = 65_534;

/// The limits of a request's head: the API's own and those of hyper's parser above them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadCaps {
    /// `api.max_headers`.
    pub max_headers: usize,
    /// `api.max_header_bytes`.
    pub max_header_bytes: usize,
    /// hyper's `max_headers`: more fields and it refuses the head.
    pub parser_max_headers: usize,
    /// hyper's `max_buf_size`: a head that fills its buffer is refused.
    pub parser_max_head_bytes: usize,
}

/// A connection's IO, with hyper's bare refusals replaced by problems.
pub struct ProblemIo<T> {
    inner: T,
    caps: HeadCaps,
    /// The request head being read: the bytes since the last answer began, up to its blank
    /// line, at most `caps.parser_max_head_bytes`.
    head: Vec<u8>,
    head_complete: bool,
    /// The problem written in place of hyper's answer, and how much of it is out.
    replacement: Option<(Vec<u8>, usize)>,
}

impl<T> ProblemIo<T> {
    pub fn new(inner: T, caps: HeadCaps) -> Self {
        Self {
            inner,
            caps,
            head: Vec::new(),
            head_complete: false,
            replacement: None,
        }
    }

    fn keep_head(&mut self, mut bytes: &[u8]) {
        if self.head.is_empty() {
            // Blank lines before a request line are allowed (and skipped by the parser).
            while let [b'\r' | b'\n', rest @ ..] = bytes {
                bytes = rest;
            }
        }
        let room = self
            .caps
            .parser_max_head_bytes
            .saturating_sub(self.head.len());
        let from = self.head.len().saturating_sub(3);
        self.head.extend_from_slice(&bytes[..bytes.len().min(room)]);
        if let Some(length) = head_length(&self.head[from..]) {
            // The body's bytes are not the head's.
            self.head.truncate(from + length);
            self.head_complete = true;
        }
    }
}

impl<T: AsyncWrite + Unpin> ProblemIo<T> {
    /// Writes what is left of the replacement, if any.
    fn poll_replacement(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Self {
            inner, replacement, ..
        } = self;
        if let Some((answer, sent)) = replacement {
            while *sent < answer.len() {
                let n = ready!(Pin::new(&mut *inner).poll_write(cx, &answer[*sent..]))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                *sent += n;
            }
            *replacement = None;
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ProblemIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        if !this.head_complete {
            this.keep_head(&buf.filled()[before..]);
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ProblemIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        match bare_error_at(buf) {
            Some((0, status)) => {
                let problem = problem_for(status, &this.head, this.caps);
                crate::telemetry::api_refused(problem.kind.as_str(), problem.status.as_u16());
                this.replacement = Some((answer(&problem, buf), 0));
                // hyper's head counts as written: the problem goes out in its place, on this
                // call or on the flush hyper makes before it closes.
                match this.poll_replacement(cx) {
                    Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                    _ => Poll::Ready(Ok(buf.len())),
                }
            }
            // A pipelined answer before hyper's goes out as it is.
            Some((at, _)) => Pin::new(&mut this.inner).poll_write(cx, &buf[..at]),
            None => {
                if starts_final_answer(buf) {
                    // The next head read is the next request's.
                    this.head.clear();
                    this.head_complete = false;
                }
                Pin::new(&mut this.inner).poll_write(cx, buf)
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }

    /// Not vectored, so hyper writes each answer from one flat buffer, and its bare head
    /// arrives whole in one write.
    fn is_write_vectored(&self) -> bool {
        false
    }
}

/// The length of a head, through its blank line, if `bytes` holds all of it.
fn head_length(bytes: &[u8]) -> Option<usize> {
    let crlf = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4);
    let lf = bytes.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    crlf.into_iter().chain(lf).min()
}

/// Whether `written` starts a final answer's head. An interim one (`100 Continue`) is
/// followed by the same request's body, not by a new head; a final one may follow it in the
/// same write.
fn starts_final_answer(mut written: &[u8]) -> bool {
    while written.starts_with(b"HTTP/1.") {
        if written.get(9) != Some(&b'1') {
            return true;
        }
        match head_length(written) {
            Some(length) => written = &written[length..],
            None => return false,
        }
    }
    false
}

/// Where hyper's bare refusal starts in `written`, and its status: a `4xx` head with
/// `content-length: 0`, no content type and nothing after it, at the end of what hyper writes
/// (its last answer on the connection). `None` for anything else.
pub fn bare_error_at(written: &[u8]) -> Option<(usize, StatusCode)> {
    if !written.ends_with(b"\r\n\r\n") {
        return None;
    }
    let at = written.windows(7).rposition(|w| w == b"HTTP/1.")?;
    let head = &written[at..];
    if head_length(head)? != head.len() {
        return None;
    }
    let head = std::str::from_utf8(head).ok()?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let code = status_line
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse::<u16>().ok())?;
    if !(400..500).contains(&code) {
        return None;
    }
    let mut bodiless = false;
    for line in lines.filter(|line| !line.is_empty()) {
        let (name, value) = line.split_once(':')?;
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => bodiless = value.trim() == "0",
            "content-type" | "transfer-encoding" => return None,
            _ => {}
        }
    }
    let status = StatusCode::from_u16(code).ok()?;
    bodiless.then_some((at, status))
}

/// The problem for hyper's refusal `status` of `head` (the bytes of the refused head that
/// were read), naming what is wrong where it can.
pub fn problem_for(status: StatusCode, head: &[u8], caps: HeadCaps) -> Problem {
    match status {
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => Problem::new(
            status,
            ProblemKind::HeadersTooLarge,
            "Request header fields too large",
            head_too_large(head, caps),
        ),
        StatusCode::URI_TOO_LONG => Problem::new(
            status,
            ProblemKind::UriTooLong,
            "URI too long",
            format!(
                "the request target is over {HYPER_MAX_URI_BYTES} bytes, the most this server reads"
            ),
        ),
        _ => Problem::new(
            status,
            ProblemKind::MalformedRequest,
            "Bad request",
            malformed_head(head),
        ),
    }
}

fn head_too_large(head: &[u8], caps: HeadCaps) -> String {
    // Whole lines after the request line, up to the blank line.
    let fields = head
        .split(|b| *b == b'\n')
        .skip(1)
        .take_while(|line| !matches!(line, [] | [b'\r']))
        .count()
        .saturating_sub(usize::from(!head.ends_with(b"\n")));
    if head.len() >= caps.parser_max_head_bytes {
        format!(
            "the request's head is over {} bytes, the most this server reads; api.max_header_bytes allows {} bytes of header names and values",
            caps.parser_max_head_bytes, caps.max_header_bytes
        )
    } else if fields > caps.parser_max_headers {
        format!(
            "the request has more than {} header fields; api.max_headers allows {}",
            caps.parser_max_headers, caps.max_headers
        )
    } else {
        format!(
            "the request's head is too large: api.max_headers allows {} header fields and api.max_header_bytes {} bytes of names and values",
            caps.max_headers, caps.max_header_bytes
        )
    }
}

/// What is wrong with a head the parser refused: the first line that breaks HTTP/1.1's rules.
fn malformed_head(head: &[u8]) -> String {
    let mut lines = head
        .split(|b| *b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line));
    let request_line = lines.next().unwrap_or_default();
    if request_line.is_empty() {
        // Nothing of it was kept (it came before the previous answer was written).
        return "the request's head is not valid HTTP/1.1".into();
    }
    if !is_request_line(request_line) {
        return format!(
            "the request line {} is not `METHOD target HTTP/1.1`",
            super::echo::quoted_bytes(request_line)
        );
    }
    let mut lengths = Vec::new();
    for line in lines.take_while(|line| !line.is_empty()) {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            return format!(
                "the header line {} has no colon",
                super::echo::quoted_bytes(line)
            );
        };
        let (name, value) = (&line[..colon], trim_start(&line[colon + 1..]));
        if name.is_empty() || !name.iter().copied().all(is_token_byte) {
            return format!(
                "the header name {} has a character HTTP does not allow in a name",
                super::echo::quoted_bytes(name)
            );
        }
        // Checked above: the name is ASCII.
        let name = String::from_utf8_lossy(name);
        if let Some(at) = value.iter().position(|b| !is_value_byte(*b)) {
            return format!(
                "the header `{name}` has a byte HTTP does not allow in a value: 0x{:02X} at byte {at} of its value (only visible ASCII, spaces, tabs and UTF-8 are)",
                value[at]
            );
        }
        if name.eq_ignore_ascii_case("content-length") {
            lengths.push(value.trim_ascii_end());
        }
    }
    if lengths
        .iter()
        .any(|v| v.is_empty() || !v.iter().all(u8::is_ascii_digit))
        || lengths.windows(2).any(|pair| pair[0] != pair[1])
    {
        return "the header `Content-Length` is not one number".into();
    }
    "the request's head is not valid HTTP/1.1".into()
}

fn is_request_line(line: &[u8]) -> bool {
    let parts: Vec<&[u8]> = line.split(|b| *b == b' ').collect();
    match parts.as_slice() {
        [method, target, version] => {
            !method.is_empty()
                && method.iter().copied().all(is_token_byte)
                && !target.is_empty()
                && target.iter().all(|b| b.is_ascii_graphic() || *b >= 0x80)
                && matches!(*version, b"HTTP/1.1" | b"HTTP/1.0")
        }
        _ => false,
    }
}

/// A `tchar` of RFC 9110: what a method or a header name is made of.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A byte a header value may hold: visible ASCII, space, tab, or any byte of UTF-8 text.
fn is_value_byte(b: u8) -> bool {
    b == b'\t' || (0x20..0x7f).contains(&b) || b >= 0x80
}

fn trim_start(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    bytes
}

/// The answer written in place of hyper's `bare` head: `problem` as problem+json, keeping
/// hyper's `date` header; the connection closes after it, as hyper's own would.
pub fn answer(problem: &Problem, bare: &[u8]) -> Vec<u8> {
    let body = problem.body();
    let mut out = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\nconnection: close\r\n",
        problem.status.as_u16(),
        problem.status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes();
    for line in bare.split_inclusive(|b| *b == b'\n') {
        if line.len() > 5 && line[..5].eq_ignore_ascii_case(b"date:") {
            out.extend_from_slice(line);
        }
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPS: HeadCaps = HeadCaps {
        max_headers: 100,
        max_header_bytes: 16_384,
        parser_max_headers: 200,
        parser_max_head_bytes: 100_000,
    };

    /// hyper's bare answers, byte for byte as it writes them.
    fn bare(status: &str) -> Vec<u8> {
        format!(
            "HTTP/1.1 {status}\r\ncontent-length: 0\r\ndate: Tue, 02 Dec 2025 06:00:00 GMT\r\n\r\n"
        )
        .into_bytes()
    }

    #[test]
    fn hyper_s_bare_refusals_are_found_and_nothing_else() {
        for (status, code) in [
            ("400 Bad Request", 400),
            ("431 Request Header Fields Too Large", 431),
            ("414 URI Too Long", 414),
        ] {
            let written = bare(status);
            assert_eq!(
                bare_error_at(&written),
                Some((0, StatusCode::from_u16(code).unwrap()))
            );
            // After an answer it is pipelined behind.
            let mut pipelined = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}".to_vec();
            let at = pipelined.len();
            pipelined.extend_from_slice(&written);
            assert_eq!(bare_error_at(&pipelined).map(|(i, _)| i), Some(at));
        }
        let not_bare: [&[u8]; 7] = [
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 404 Not Found\r\ncontent-type: application/problem+json\r\ncontent-length: 90\r\n\r\n",
            // A HEAD request's answer to a problem: a length, no body.
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 90\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n{\"a\":1}",
            b"data: {\"status\":\"completed\"}\r\n\r\n",
        ];
        for written in not_bare {
            assert_eq!(bare_error_at(written), None, "{}", written.escape_ascii());
        }
    }

    #[test]
    fn a_final_answer_starts_a_new_head_and_an_interim_one_does_not() {
        assert!(starts_final_answer(b"HTTP/1.1 202 Accepted\r\n"));
        assert!(!starts_final_answer(b"HTTP/1.1 100 Continue\r\n\r\n"));
        assert!(starts_final_answer(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 413 Payload Too Large\r\n"
        ));
        assert!(!starts_final_answer(b"{\"task_id\":\"HTTP/1.1 200\"}"));
    }

    #[test]
    fn a_bad_byte_in_a_header_value_is_named_with_its_header() {
        let head = b"POST /v1/replies HTTP/1.1\r\nHost: x\r\nIdempotency-Key: press\x7f1\r\n\r\n";
        let problem = problem_for(StatusCode::BAD_REQUEST, head, CAPS);
        assert_eq!(
            (problem.status, problem.kind),
            (StatusCode::BAD_REQUEST, ProblemKind::MalformedRequest)
        );
        assert_eq!(
            problem.detail,
            "the header `Idempotency-Key` has a byte HTTP does not allow in a value: 0x7F at byte 5 of its value (only visible ASCII, spaces, tabs and UTF-8 are)"
        );
        // The parser may refuse a head before its end: what was read is enough.
        let partial = b"GET / HTTP/1.1\r\nX-Trace: a\x01";
        assert!(
            problem_for(StatusCode::BAD_REQUEST, partial, CAPS)
                .detail
                .starts_with(
                    "the header `X-Trace` has a byte HTTP does not allow in a value: 0x01"
                )
        );
    }

    #[test]
    fn each_kind_of_malformed_head_is_named() {
        let cases: [(&[u8], &str); 7] = [
            (b"", "the request's head is not valid HTTP/1.1"),
            (
                b"GET /\r\n\r\n",
                "the request line \"GET /\" is not `METHOD target HTTP/1.1`",
            ),
            (
                b"GET / HTTP/2.0\r\n\r\n",
                "the request line \"GET / HTTP/2.0\" is not",
            ),
            (
                b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
                "the header line \"no colon\" has no colon",
            ),
            (
                b"GET / HTTP/1.1\r\nBad Name: 1\r\n\r\n",
                "the header name \"Bad Name\" has a character HTTP does not allow",
            ),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
                "the header `Content-Length` is not one number",
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
                "the request's head is not valid HTTP/1.1",
            ),
        ];
        for (head, expected) in cases {
            let detail = problem_for(StatusCode::BAD_REQUEST, head, CAPS).detail;
            assert!(
                detail.starts_with(expected),
                "{}: {detail}",
                head.escape_ascii()
            );
        }
    }

    #[test]
    fn a_head_over_the_parser_s_caps_names_the_api_setting() {
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for n in 0..201 {
            many.extend_from_slice(format!("x{n}: 1\r\n").as_bytes());
        }
        let problem = problem_for(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, &many, CAPS);
        assert_eq!(problem.kind, ProblemKind::HeadersTooLarge);
        assert_eq!(
            problem.detail,
            "the request has more than 200 header fields; api.max_headers allows 100"
        );
        let huge = vec![b'a'; CAPS.parser_max_head_bytes];
        let detail = problem_for(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, &huge, CAPS).detail;
        assert!(
            detail.starts_with("the request's head is over 100000 bytes")
                && detail.contains("api.max_header_bytes allows 16384"),
            "{detail}"
        );
        let long_target = problem_for(StatusCode::URI_TOO_LONG, b"GET /aaaa", CAPS);
        assert_eq!(long_target.kind, ProblemKind::UriTooLong);
    }

    #[test]
    fn the_answer_is_problem_json_of_its_length_with_hyper_s_date() {
        let problem = problem_for(StatusCode::BAD_REQUEST, b"GET /\r\n\r\n", CAPS);
        let written = answer(&problem, &bare("400 Bad Request"));
        let text = String::from_utf8(written).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{head}");
        assert!(head.contains("\r\ncontent-type: application/problem+json\r\n"));
        assert!(head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())));
        assert!(head.contains("\r\ndate: Tue, 02 Dec 2025 06:00:00 GMT"));
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json["status"], 400);
        assert_eq!(
            json["type"],
            "https://replyd.dev/problems/malformed_request"
        );
    }

    /// The replacement goes out whole even when the socket takes a few bytes at a time, and the
    /// head it names is the one read.
    #[tokio::test]
    async fn the_replacement_is_written_whole_through_a_narrow_socket() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (ours, mut client) = tokio::io::duplex(7);
        let mut io = ProblemIo::new(ours, CAPS);
        let head = b"GET / HTTP/1.1\r\nX-Key: a\x7fb\r\n\r\n";
        let reader = tokio::spawn(async move {
            client.write_all(head).await.unwrap();
            let mut received = Vec::new();
            client.read_to_end(&mut received).await.unwrap();
            received
        });
        let mut read = vec![0u8; head.len()];
        io.read_exact(&mut read).await.unwrap();
        let bare = bare("400 Bad Request");
        assert_eq!(io.write(&bare).await.unwrap(), bare.len());
        io.flush().await.unwrap();
        io.shutdown().await.unwrap();
        drop(io);
        let received = String::from_utf8(reader.await.unwrap()).unwrap();
        let (_, body) = received.split_once("\r\n\r\n").unwrap();
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert!(
            json["detail"]
                .as_str()
                .unwrap()
                .starts_with("the header `X-Key`"),
            "{json}"
        );
    }
}
