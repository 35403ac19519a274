//! Connections: the accept loop with a connection limit below the descriptor limit, a timeout
//! on request headers (which also closes idle keep-alive connections), and a bounded graceful
//! shutdown. axum's own `serve` has none of these.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{watch, Semaphore};

use crate::state::ConnectionLimits;

/// Busy answers being written at once; past this, a connection over the limit is closed
/// without one (each holds a descriptor for up to a second).
const MAX_BUSY_REPLIES: usize = 64;

/// Accepts connections until `stop` resolves, then closes the listener, asks every connection
/// to finish its request in flight, and waits for them at most `limits.shutdown_timeout`.
/// Returns whether all finished in time.
pub(crate) async fn serve_connections(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: ConnectionLimits,
    stop: impl std::future::Future<Output = ()>,
) -> bool {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let busy = Arc::new(Semaphore::new(MAX_BUSY_REPLIES));
    let (closing, closed) = watch::channel(false);
    tokio::pin!(stop);
    let mut told_full = false;
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => break,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors (or another per-connection error): wait a moment instead
                // of spinning; the connections already open keep being served.
                if !told_full {
                    note!("warning: cannot accept a connection: {e}");
                    told_full = true;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if let Ok(reply) = busy.clone().try_acquire_owned() {
                let max = limits.max_connections;
                tokio::spawn(async move {
                    let _reply = reply;
                    let _ = tokio::time::timeout(Duration::from_secs(1), too_many(stream, max)).await;
                });
            }
            continue;
        };
        let (router, mut closed) = (router.clone(), closed.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let service = hyper_util::service::TowerToHyperService::new(router);
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
            let conn = http.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            let stopping = tokio::select! {
                _ = conn.as_mut() => false,
                r = closed.wait_for(|c| *c) => r.is_ok(),
            };
            if stopping {
                // The request in flight (if any) finishes; an idle connection closes now.
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            }
        });
    }
    drop(listener);
    let _ = closing.send(true);
    let all = limits.max_connections.min(u32::MAX as usize) as u32;
    let finished = tokio::time::timeout(limits.shutdown_timeout, slots.acquire_many(all)).await.is_ok();
    finished
}

/// The answer to a connection over the limit: 503 with an OpenAI error, then close.
async fn too_many(mut stream: tokio::net::TcpStream, max: usize) {
    let body = serde_json::json!({"error": {
        "message": format!("the server has {max} connections open, its limit (--max-connections); retry later"),
        "type": "server_error", "code": "too_many_connections", "param": null}})
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
    let _ = stream.shutdown().await;
    // Read what the client sent until it closes (within the caller's bound): closing with its
    // request unread would reset the connection and could lose the answer.
    let mut sink = [0u8; 4096];
    while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
}
