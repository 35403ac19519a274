//! The server assembled and run: the config checked, the workers started (`workers`), the
//! routes (`handlers`, `ui`) behind the guard (`guard`), the connections accepted (`conn`) until
//! the stop signal, then a bounded shutdown.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::DefaultBodyLimit;
use axum::Router;
use vl_models::engine::Engine;

use crate::state::{App, ServerConfig};
use crate::ServerError;

/// Serves the OpenAI API for `engine` on `listener` until SIGINT or SIGTERM; then stops
/// accepting, lets running requests finish, and returns.
pub fn serve(engine: Arc<Engine>, listener: std::net::TcpListener, config: ServerConfig) -> Result<(), ServerError> {
    serve_until(engine, listener, config, shutdown_signal())
}

/// `serve`, stopping when `stop` resolves instead of at a signal (an embedding program's own
/// shutdown, a test's end); the shutdown that follows is the same, bounded by
/// `config.connections.shutdown_timeout`.
pub fn serve_until(
    engine: Arc<Engine>,
    listener: std::net::TcpListener,
    config: ServerConfig,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), ServerError> {
    let config = checked(config)?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    if !local.ip().is_loopback() && config.api_key.is_none() {
        note!(
            "warning: listening on {local}, reachable from other machines, without --api-key: anyone who can reach it can use the model"
        );
    }
    let (app, workers) = crate::workers::start(engine, config)?;
    let router = router(&app);
    let (ui, limits) = (app.config.ui, app.config.connections);
    // When the stop signal came: the shutdown bound counts from there, for the connections and
    // the workers together.
    let stopped_at = Arc::new(std::sync::OnceLock::<Instant>::new());
    let stop_mark = stopped_at.clone();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let done = rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        note!("listening on http://{local}");
        if ui {
            note!("web chat: http://{local}/");
        }
        let stop = async move {
            stop.await;
            let _ = stop_mark.set(Instant::now());
            note!(
                "stopping: no new connections; finishing the requests in flight (at most {} s)",
                limits.shutdown_timeout.as_secs_f64()
            );
        };
        Ok::<_, std::io::Error>(crate::conn::serve_connections(listener, router, limits, stop).await)
    })?;
    // The workers finish what they hold within what is left of the shutdown bound.
    let bound = limits.shutdown_timeout;
    let left = bound.saturating_sub(stopped_at.get().map_or(Duration::ZERO, |t| t.elapsed()));
    // Connections cut at the bound leave no time to wait for the workers.
    let joined = workers.stop(app, if done { left } else { Duration::ZERO });
    if !done || !joined {
        note!("stopped at the shutdown bound of {} s: requests still running were cut", bound.as_secs_f64());
    } else {
        note!("stopped");
    }
    rt.shutdown_timeout(Duration::from_millis(100));
    Ok(())
}

/// A library caller gets the same checks as `vl serve`: a key some request can send, origins as
/// browsers write them.
fn checked(mut config: ServerConfig) -> Result<ServerConfig, ServerError> {
    if let Some(key) = config.api_key.as_deref() {
        crate::check_api_key(key)?;
    }
    config.cors_origins = crate::cors_origins(&config.cors_origins)?;
    Ok(config)
}

/// Every route (the web chat's when `ui`), behind the guard.
fn router(app: &Arc<App>) -> Router {
    let mut router = Router::new();
    if app.config.ui {
        router = crate::ui::routes(router);
    }
    crate::handlers::routes(router)
        .layer(axum::middleware::from_fn_with_state(app.clone(), crate::guard::guard))
        .layer(DefaultBodyLimit::disable())
        .with_state(app.clone())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}
