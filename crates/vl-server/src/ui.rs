//! The web chat's routes: its three files (`crates/vl-server/ui`), embedded in the binary, each
//! served with a content security policy.

use std::sync::Arc;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::state::App;

/// The web chat (`crates/vl-server/ui`), embedded: one page, its script and its style.
const UI_HTML: &str = include_str!("../ui/index.html");
const UI_JS: &str = include_str!("../ui/app.js");
const UI_CSS: &str = include_str!("../ui/app.css");
/// The page loads and calls nothing outside this server; model output never becomes markup
/// (the script only writes text nodes), and the policy would stop an injected script anyway.
const UI_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; \
    media-src 'self' data: blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// `router` with the web chat's three routes.
pub(crate) fn routes(router: Router<Arc<App>>) -> Router<Arc<App>> {
    router
        .route("/", get(|| async { page(UI_HTML, "text/html; charset=utf-8") }))
        .route("/ui/app.js", get(|| async { page(UI_JS, "text/javascript; charset=utf-8") }))
        .route("/ui/app.css", get(|| async { page(UI_CSS, "text/css; charset=utf-8") }))
}

/// The web chat's paths, served without the API key (the page asks for it).
pub(crate) fn is_ui_path(path: &str) -> bool {
    matches!(path, "/" | "/ui/app.js" | "/ui/app.css")
}

fn page(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, UI_CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}
