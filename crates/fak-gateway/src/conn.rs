//! Connections: the accept loop behind [`crate::serve_with`], its timeouts, its cap on
//! open connections, and the graceful shutdown.
//!
//! Each accepted TCP connection is served by hyper's HTTP/1 connection (keep-alive on,
//! `TCP_NODELAY` set) with these limits, all from [`GatewayConfig`]:
//!
//! - **header timeout** ([`GatewayConfig::header_timeout`], hyper's
//!   `header_read_timeout`): a connection must deliver a whole request head within this
//!   time of opening, or of its previous response ending, else it is closed. So it also
//!   closes keep-alive connections that stay idle that long, and a client that trickles
//!   a request line or headers is cut.
//! - **idle timeout** ([`GatewayConfig::idle_timeout`]): the longest the server waits on
//!   a stalled client mid-request: a request body whose next bytes do not arrive (the
//!   request fails with 400, `reading the body: ...`), or a response the client stops
//!   reading (a write that cannot proceed; the connection is closed, which drops the
//!   response and cancels its generation). A stream whose tokens the client reads is
//!   never cut, however long it runs, nor a response the engine takes long to produce.
//! - **connection cap** ([`GatewayConfig::max_connections`]): at most this many
//!   connections are open at once. When the cap is reached, the server stops accepting:
//!   further connections wait in the listen backlog (the kernel's, bounded) until an open
//!   one closes, so they cost no file descriptor in this process. Trickling connections
//!   free their slots after the header timeout.
//! - **a client that leaves** before a response's head is sent (a non-streamed
//!   generation, or a request still queued): the request's future is dropped, which
//!   cancels its generation, as a stream's is when a write fails. hyper notices an EOF
//!   itself only while its read buffer is empty (so not behind the bytes of a pipelined
//!   request), so each pending request has a watcher that reads the socket ahead of
//!   hyper (at most [`READ_AHEAD`] bytes, handed to hyper first and in order: nothing
//!   is lost for the next pipelined request) and ends the connection, without a
//!   response, on the end of input (a FIN: HTTP/1 half-close is not supported, as with
//!   hyper's default `half_close(false)`) or a socket error (an RST). A peer that
//!   vanishes without either is found by TCP keepalive: probes after
//!   [`KEEPALIVE_IDLE`] of silence, every [`KEEPALIVE_INTERVAL`], [`KEEPALIVE_RETRIES`]
//!   unanswered ones error the socket (about 30 s). Streams are watched by their writes
//!   (keep-alives, [`GatewayConfig::sse_keep_alive`]).
//!
//! Shutdown: when the `shutdown` future resolves the listener is closed (new connections
//! are refused), idle keep-alive connections are closed, and requests in flight go on
//! for up to [`GatewayConfig::shutdown_grace`]. At the end of the grace:
//!
//! - a request still waiting for its response (queued for a worker slot, or a whole
//!   non-streamed generation) is answered 503 `overloaded_error` in its API's error
//!   shape, with `Retry-After`, and its generation cancelled;
//! - a stream still running gets a final error event in its wire's shape and ends, its
//!   generation cancelled: OpenAI routes `data: {"error": {...}}` then `data: [DONE]`
//!   (the OpenAI SDKs raise an `APIError` on a data object with an `error` key),
//!   `/v1/messages` `event: error` with `{"type": "error", "error": {"type":
//!   "overloaded_error", ...}}` (what Anthropic's SDKs raise on).
//!
//! Then [`crate::serve_with`] waits at most [`FLUSH_MARGIN`] more for those answers to
//! be written and returns. [`crate::serve_engine`] adds the engine's side: requests
//! queued in the engine are answered 503 when the shutdown begins, and every generation
//! still running is cancelled when the grace ends.

use crate::error::{ApiError, Flavor};
use crate::GatewayConfig;
use axum::body::{Body, Bytes};
use axum::http::{header, Request};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::Sleep;

/// After the shutdown grace, the longest [`crate::serve_with`] waits for the final
/// answers (503s, streams' error events) to be written before it returns anyway.
pub const FLUSH_MARGIN: Duration = Duration::from_secs(2);

/// TCP keepalive on accepted connections: the silence from the peer after which the
/// first probe is sent (`TCP_KEEPIDLE`).
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);

/// TCP keepalive: the time between unanswered probes (`TCP_KEEPINTVL`).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);

/// TCP keepalive: the unanswered probes after which the socket errors (`TCP_KEEPCNT`,
/// `ETIMEDOUT`).
pub const KEEPALIVE_RETRIES: u32 = 3;

/// The most bytes (of a pipelined request) the watcher of a pending request holds
/// ahead of hyper; with that many waiting it looks only at the socket's readiness.
pub const READ_AHEAD: usize = 64 * 1024;

/// How often the watcher looks at the socket's readiness when [`READ_AHEAD`] is full.
const FULL_POLL: Duration = Duration::from_millis(500);

/// A future that resolves once the shutdown grace is over; never, before shutdown.
type Expired = Pin<Box<dyn Future<Output = ()> + Send>>;

fn expired(rx: &watch::Receiver<bool>) -> Expired {
    let mut rx = rx.clone();
    Box::pin(async move {
        // A dropped sender (the accept loop gone) counts as expired.
        let _ = rx.wait_for(|e| *e).await;
    })
}

/// Serves `router` on `listener` with `config`'s connection limits until `shutdown`
/// resolves, then shuts down gracefully (see the module docs).
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    config: &GatewayConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let cap = config.max_connections.max(1);
    let slots = Arc::new(Semaphore::new(cap));
    let graceful = GracefulShutdown::new();
    let (expire_tx, expire_rx) = watch::channel(false);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .keep_alive(true)
        .header_read_timeout(config.header_timeout);
    let idle = config.idle_timeout;
    let mut shutdown = std::pin::pin!(shutdown);
    let mut said_full = false;
    loop {
        let slot = match Arc::clone(&slots).try_acquire_owned() {
            Ok(s) => s,
            Err(_) => {
                if !said_full {
                    tracing::warn!(
                        "{cap} connections open (--max-connections): new ones wait until one closes"
                    );
                    said_full = true;
                }
                tokio::select! {
                    () = &mut shutdown => break,
                    s = Arc::clone(&slots).acquire_owned() => s.map_err(io::Error::other)?,
                }
            }
        };
        let tcp = tokio::select! {
            () = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Per-connection failures (reset before accept) and running out of
                    // descriptors: go on; the latter after a pause, as hyper's servers do.
                    if !is_connection_error(&e) {
                        tracing::error!("accepting a connection: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    continue;
                }
            },
        };
        said_full = false;
        set_nodelay(&tcp);
        set_keepalive(&tcp);
        let sock = Arc::new(Socket::new(tcp));
        let io = TokioIo::new(StallIo::new(Arc::clone(&sock), idle));
        let svc = ConnService {
            router: router.clone(),
            idle,
            expire: expire_rx.clone(),
            sock,
        };
        let conn = graceful.watch(http.serve_connection(io, svc));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection ended: {e}");
            }
            drop(slot);
        });
    }
    drop(listener);
    let grace = config.shutdown_grace;
    tracing::info!(
        "shutting down: no new connections; waiting up to {:.1} s for {} open ones",
        grace.as_secs_f64(),
        graceful.count()
    );
    let timer = tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        let _ = expire_tx.send(true);
    });
    if tokio::time::timeout(grace + FLUSH_MARGIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the shutdown grace; leaving them");
    }
    timer.abort();
    Ok(())
}

/// Accept errors that concern one connection only.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Sets `TCP_NODELAY`: a stream writes one small event per token, and with Nagle's
/// algorithm on, each write after the first would wait for the client's (delayed, up to
/// 40 ms) acknowledgement of the one before.
pub(crate) fn set_nodelay(tcp: &TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!("TCP_NODELAY on an accepted connection: {e}");
    }
}

/// Turns on TCP keepalive with [`KEEPALIVE_IDLE`], [`KEEPALIVE_INTERVAL`] and
/// [`KEEPALIVE_RETRIES`], so a peer gone without a FIN or RST (its host off, the
/// network cut) errors the socket and the watcher of its pending request ends it.
pub(crate) fn set_keepalive(tcp: &TcpStream) {
    let ka = socket2::TcpKeepalive::new().with_time(KEEPALIVE_IDLE);
    #[cfg(any(
        target_os = "linux",
        target_os = "android",
        target_os = "macos",
        target_os = "freebsd"
    ))]
    let ka = ka
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    if let Err(e) = socket2::SockRef::from(tcp).set_tcp_keepalive(&ka) {
        tracing::debug!("TCP keepalive on an accepted connection: {e}");
    }
}

/// The socket of one connection, shared by hyper's IO ([`StallIo`]) and the watchers
/// of its pending requests ([`Socket::left`]). Every read of the socket goes through
/// `ahead` under its lock, so bytes reach hyper in the order they came.
struct Socket {
    tcp: TcpStream,
    ahead: Mutex<Ahead>,
}

/// What a watcher read before hyper asked.
#[derive(Default)]
struct Ahead {
    /// Bytes not yet handed to hyper (at most [`READ_AHEAD`]).
    buf: Vec<u8>,
    /// The end of input, once a read found it: `None` for EOF, else the error's kind and
    /// message (an `io::Error` is not `Clone`).
    end: Option<Option<(io::ErrorKind, String)>>,
}

impl Ahead {
    /// The error a read after `end` gives (none for EOF: zero bytes).
    fn end_error(&self) -> Option<io::Error> {
        self.end
            .as_ref()
            .and_then(|e| e.as_ref())
            .map(|(kind, msg)| io::Error::new(*kind, msg.clone()))
    }
}

impl Socket {
    fn new(tcp: TcpStream) -> Self {
        Socket {
            tcp,
            ahead: Mutex::new(Ahead::default()),
        }
    }

    fn ahead(&self) -> std::sync::MutexGuard<'_, Ahead> {
        self.ahead.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// hyper's read: bytes read ahead first, then the socket.
    fn poll_read(&self, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let mut a = self.ahead();
        if !a.buf.is_empty() {
            let n = out.remaining().min(a.buf.len());
            out.put_slice(&a.buf[..n]);
            a.buf.drain(..n);
            return Poll::Ready(Ok(()));
        }
        if a.end.is_some() {
            return Poll::Ready(a.end_error().map_or(Ok(()), Err));
        }
        loop {
            ready!(self.tcp.poll_read_ready(cx))?;
            match self.tcp.try_read(out.initialize_unfilled()) {
                Ok(n) => {
                    if n == 0 && out.remaining() > 0 {
                        a.end = Some(None);
                    }
                    out.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Resolves when the client has left: the end of its input (EOF) or a socket error
    /// (reset, keepalive timeout), with the reason. Meanwhile it reads what arrives into
    /// `ahead` for hyper (bytes of a pipelined request), up to [`READ_AHEAD`]; beyond
    /// that, it polls the socket's readiness for a FIN or an error every [`FULL_POLL`].
    async fn left(&self) -> io::Error {
        loop {
            let ready = match self.tcp.ready(Interest::READABLE).await {
                Ok(r) => r,
                Err(e) => return e,
            };
            match self.read_ahead() {
                Watch::Left(why) => return why,
                Watch::Waiting => {}
                Watch::Full => {
                    if ready.is_read_closed() || ready.is_error() {
                        return client_closed();
                    }
                    tokio::time::sleep(FULL_POLL).await;
                }
            }
        }
    }

    /// Reads what the socket holds into `ahead`, up to [`READ_AHEAD`].
    fn read_ahead(&self) -> Watch {
        let mut a = self.ahead();
        if a.end.is_some() {
            return Watch::Left(a.end_error().unwrap_or_else(client_closed));
        }
        loop {
            let start = a.buf.len();
            let room = READ_AHEAD - start;
            if room == 0 {
                return Watch::Full;
            }
            a.buf.resize(start + room.min(16 * 1024), 0);
            let r = self.tcp.try_read(&mut a.buf[start..]);
            let n = *r.as_ref().unwrap_or(&0);
            a.buf.truncate(start + n);
            match r {
                Ok(0) => {
                    a.end = Some(None);
                    return Watch::Left(client_closed());
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Watch::Waiting,
                Err(e) => {
                    a.end = Some(Some((e.kind(), e.to_string())));
                    return Watch::Left(e);
                }
            }
        }
    }
}

/// What [`Socket::read_ahead`] found.
enum Watch {
    /// The client left, for this reason.
    Left(io::Error),
    /// All there was is read; wait for more.
    Waiting,
    /// [`READ_AHEAD`] bytes wait for hyper.
    Full,
}

fn client_closed() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the client closed the connection",
    )
}

/// The service of one connection: the router, with request bodies under the idle
/// timeout, answers cut short at the end of the shutdown grace, and pending requests
/// dropped when the client leaves (the connection then ends with the reason, unanswered).
#[derive(Clone)]
struct ConnService {
    router: Router,
    idle: Option<Duration>,
    expire: watch::Receiver<bool>,
    sock: Arc<Socket>,
}

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, io::Error>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let idle = self.idle;
        let req = req.map(|b| match idle {
            Some(limit) => Body::new(StallBody::new(b, limit)),
            None => Body::new(b),
        });
        let path = req.uri().path().to_string();
        let mut router = self.router.clone();
        let expire = self.expire.clone();
        let sock = Arc::clone(&self.sock);
        Box::pin(async move {
            let mut gone = expired(&expire);
            let resp = tokio::select! {
                biased;
                r = tower_service::Service::call(&mut router, req) => match r {
                    Ok(r) => r,
                    Err(e) => match e {},
                },
                () = &mut gone => return Ok(ApiError::shutting_down()
                    .with_flavor(Flavor::of_path(&path))
                    .into_response()),
                why = sock.left() => {
                    // Dropping the request's future (done by returning) cancels its
                    // generation; the error ends the connection without a response.
                    tracing::info!("{path}: the client left before the response ({why}); cancelled");
                    return Err(why);
                }
            };
            Ok(end_at_shutdown(resp, &path, gone))
        })
    }
}

/// `resp`, with its body (an SSE stream of the API routes) ended by a final error event
/// in its wire's shape when `expired` resolves.
fn end_at_shutdown(resp: Response, path: &str, expired: Expired) -> Response {
    let sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !sse || !path.starts_with("/v1/") {
        return resp;
    }
    let last = final_event(Flavor::of_path(path));
    resp.map(|inner| {
        Body::new(Drained {
            inner: Some(inner),
            expired,
            last: Some(last),
        })
    })
}

/// The SSE bytes that end a stream cut by the shutdown, in `flavor`'s shape.
fn final_event(flavor: Flavor) -> Bytes {
    let body = ApiError::shutting_down().with_flavor(flavor).body();
    Bytes::from(match flavor {
        Flavor::OpenAi => format!("data: {body}\n\ndata: [DONE]\n\n"),
        Flavor::Anthropic => format!("event: error\ndata: {body}\n\n"),
    })
}

/// A response body that ends with `last` when the shutdown grace expires. axum's SSE
/// body yields one frame per event, so the cut falls between events.
struct Drained {
    inner: Option<Body>,
    expired: Expired,
    last: Option<Bytes>,
}

impl HttpBody for Drained {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(this.last.take().map(|b| Ok(Frame::data(b))));
        };
        if this.expired.as_mut().poll(cx).is_ready() {
            // Dropping the stream cancels its generation.
            this.inner = None;
            return Poll::Ready(this.last.take().map(|b| Ok(Frame::data(b))));
        }
        match ready!(Pin::new(inner).poll_frame(cx)) {
            None => {
                // Finished on its own: nothing to add.
                this.inner = None;
                this.last = None;
                Poll::Ready(None)
            }
            other => Poll::Ready(other),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_none() && self.last.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// A request body that fails when its next bytes take longer than `limit`.
struct StallBody {
    inner: Incoming,
    limit: Duration,
    timer: Option<Pin<Box<Sleep>>>,
}

impl StallBody {
    fn new(inner: Incoming, limit: Duration) -> Self {
        StallBody {
            inner,
            limit,
            timer: None,
        }
    }
}

impl HttpBody for StallBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(f) => {
                this.timer = None;
                Poll::Ready(f.map(|r| r.map_err(io::Error::other)))
            }
            Poll::Pending => {
                let limit = this.limit;
                let t = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                ready!(t.as_mut().poll(cx));
                Poll::Ready(Some(Err(stalled("no request body bytes", limit))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

fn stalled(what: &str, limit: Duration) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("{what} for {:.1} s (the idle timeout)", limit.as_secs_f64()),
    )
}

/// A connection's socket as hyper's IO: reads through [`Socket::poll_read`], writes
/// that fail once one has waited `limit` for the client to read.
struct StallIo {
    sock: Arc<Socket>,
    limit: Option<Duration>,
    timer: Option<Pin<Box<Sleep>>>,
}

impl StallIo {
    fn new(sock: Arc<Socket>, limit: Option<Duration>) -> Self {
        StallIo {
            sock,
            limit,
            timer: None,
        }
    }

    /// One write of the shared socket (`try_write` and its readiness, as tokio's own
    /// `poll_write` does).
    fn poll_write_with(
        &self,
        cx: &mut Context<'_>,
        mut write: impl FnMut(&TcpStream) -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.sock.tcp.poll_write_ready(cx))?;
            match write(&self.sock.tcp) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }

    /// After a write that could not proceed: pending, or the timeout's error.
    fn stalled<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let Some(limit) = self.limit else {
            return Poll::Pending;
        };
        let t = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(t.as_mut().poll(cx));
        Poll::Ready(Err(stalled("the client read nothing", limit)))
    }

    fn wrote<T>(&mut self, r: Poll<io::Result<T>>, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        match r {
            Poll::Ready(r) => {
                self.timer = None;
                Poll::Ready(r)
            }
            Poll::Pending => self.stalled(cx),
        }
    }
}

impl AsyncRead for StallIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.sock.poll_read(cx, buf)
    }
}

impl AsyncWrite for StallIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = self.poll_write_with(cx, |t| t.try_write(buf));
        self.wrote(r, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = self.poll_write_with(cx, |t| t.try_write_vectored(bufs));
        self.wrote(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // A TCP socket has no buffer of its own to flush (tokio's flush is a no-op too).
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // As tokio's `TcpStream::poll_shutdown`: shut the write side.
        Poll::Ready(socket2::SockRef::from(&self.sock.tcp).shutdown(std::net::Shutdown::Write))
    }
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn accepted_connections_have_tcp_nodelay() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (server_side, _) = l.accept().await.unwrap();
        // Off by default: the setting is ours, not the platform's.
        assert!(!server_side.nodelay().unwrap());
        super::set_nodelay(&server_side);
        assert!(server_side.nodelay().unwrap());
    }

    #[tokio::test]
    async fn accepted_connections_have_short_tcp_keepalive() {
        use super::{KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_RETRIES};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (server_side, _) = l.accept().await.unwrap();
        let sock = socket2::SockRef::from(&server_side);
        // Off by default: a vanished peer would hold its request for good.
        assert!(!sock.keepalive().unwrap());
        super::set_keepalive(&server_side);
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        #[cfg(target_os = "linux")]
        {
            assert_eq!(sock.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
            assert_eq!(sock.tcp_keepalive_retries().unwrap(), KEEPALIVE_RETRIES);
        }
    }
}
