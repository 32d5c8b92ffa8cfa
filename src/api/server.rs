//! The API's HTTP/1.1 server: an accept loop on hyper's connection builder, so that this
//! process, not the server library, decides what each refusal looks like and how long a
//! client may take. On shutdown the listener is dropped, each connection finishes the request
//! it has (an idle one closes at once), and [`serve`]'s task ends when the last one has.
//!
//! What hyper 1.12's `http1::Builder` offers, and what is used:
//! - `header_read_timeout`, which needs a timer (`axum::serve` sets none, so a half-sent head
//!   was held open without end): `api.header_read_timeout_ms`. hyper closes the connection
//!   without an answer; the same timeout bounds an idle keep-alive connection.
//! - `max_headers` (default 100) and `max_buf_size` (about 400 KB; a head that fills the read
//!   buffer is refused): over either, hyper answers `431` itself. Both are set above our own
//!   limits (twice `api.max_headers` fields; room for the longest request line hyper takes
//!   and twice `api.max_header_bytes`), so a request a little over a limit reaches
//!   `limit_headers`, whose problem names the setting and the count, and the buffer is
//!   bounded by our settings rather than hyper's default.
//! - `max_header_size`: another cap on the head with the same bare answer; left unset.
//! - `ignore_invalid_headers`: drops a malformed header line silently, so a bad
//!   `Idempotency-Key` would look absent; not used.
//! - None changes what hyper writes when its parser refuses a head (a byte HTTP does not
//!   allow, a bad request line, a head over its caps): a status line with `content-length: 0`,
//!   then it closes, and the application never sees the request. So each connection's IO is
//!   wrapped in [`super::parse_errors::ProblemIo`], whose write side puts a problem in place of
//!   that bare answer: one contained piece, rather than a parser of our own in front of
//!   hyper's.
//!
//! HTTP/2 is not served (axum's `http2` feature was off before, too).

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::parse_errors::{HYPER_MAX_URI_BYTES, HeadCaps, ProblemIo};
use super::routes::router;
use super::settings::ApiSettings;
use super::state::ApiState;

/// hyper's header-count cap as a multiple of `api.max_headers`: a request somewhat over our
/// limit reaches the application, which names the setting and the count; only one far over
/// it meets hyper's cap.
const PARSER_HEADERS_PER_ALLOWED: usize = 2;

/// The caps of hyper's parser, from the API's own limits (see the module's doc).
pub fn head_caps(settings: &ApiSettings) -> HeadCaps {
    let parser_max_headers = settings
        .max_headers
        .saturating_mul(PARSER_HEADERS_PER_ALLOWED);
    // A head on the wire: the request line, then per field its name, ": ", value and CRLF
    // (`api.max_header_bytes` counts names and values only), then a blank line. Always over
    // hyper's smallest buffer (8 KiB; `max_buf_size` panics below it).
    let parser_max_head_bytes = (HYPER_MAX_URI_BYTES + 64)
        .saturating_add(settings.max_header_bytes.saturating_mul(2))
        .saturating_add(parser_max_headers.saturating_mul(4));
    HeadCaps {
        max_headers: settings.max_headers,
        max_header_bytes: settings.max_header_bytes,
        parser_max_headers,
        parser_max_head_bytes,
    }
}

/// Binds `listen` (port 0 picks one) and serves until `shutdown`; returns the bound address
/// and the task that ends once every open request has been answered. The rate limit's
/// buckets are swept beside it until `shutdown`.
pub async fn serve(
    listen: SocketAddr,
    state: ApiState,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let caps = head_caps(&state.settings);
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(state.settings.header_read_timeout())
        .max_headers(caps.parser_max_headers)
        .max_buf_size(caps.parser_max_head_bytes);
    // The rate limit's buckets are swept while the server runs, so they are as many as the
    // callers of the last interval, not every caller ever seen.
    tokio::spawn(super::rate_limit::sweep_until(
        state.limiter.clone(),
        shutdown.clone(),
    ));
    let service = TowerToHyperService::new(router(state));
    let handle = tokio::spawn(accept(listener, http, service, caps, shutdown));
    Ok((addr, handle))
}

/// Takes connections until `shutdown`, then waits for the open ones to finish.
async fn accept(
    listener: TcpListener,
    http: http1::Builder,
    service: TowerToHyperService<Router>,
    caps: HeadCaps,
    shutdown: CancellationToken,
) {
    let connections = TaskTracker::new();
    loop {
        let stream = tokio::select! {
            // Shutdown first: no connection is taken once it has been asked for.
            biased;
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    if wait_after_accept_error(&e, &shutdown).await {
                        continue;
                    }
                    break;
                }
            },
        };
        let connection =
            http.serve_connection(TokioIo::new(ProblemIo::new(stream, caps)), service.clone());
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let mut connection = std::pin::pin!(connection);
            let served = tokio::select! {
                served = connection.as_mut() => served,
                () = shutdown.cancelled() => {
                    // Answer the request in hand, then close.
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = served {
                // The client's doing (a head refused and answered, a head too slow, a reset):
                // its connection ends, the server goes on.
                tracing::debug!(error = %e, "API connection ended with an error");
            }
        });
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// After a failed accept: one connection's failure is skipped at once; anything else (out of
/// file descriptors) is logged and waited out for a second, so the loop does not spin on it.
/// False when shutdown came meanwhile.
async fn wait_after_accept_error(e: &std::io::Error, shutdown: &CancellationToken) -> bool {
    use std::io::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    ) {
        return true;
    }
    tracing::error!(error = %e, "the API cannot accept connections");
    tokio::select! {
        () = shutdown.cancelled() => false,
        () = tokio::time::sleep(Duration::from_secs(1)) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parser_caps_are_above_the_api_limits() {
        let settings = ApiSettings::default();
        let caps = head_caps(&settings);
        assert_eq!(caps.parser_max_headers, 2 * settings.max_headers);
        assert!(
            caps.parser_max_head_bytes > HYPER_MAX_URI_BYTES + 2 * settings.max_header_bytes,
            "{caps:?}"
        );
    }
}
