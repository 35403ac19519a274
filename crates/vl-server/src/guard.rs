//! The guard every request passes: CORS (preflights answered, allowed origins echoed), the API
//! key (not on the web chat's files, nor /health), one log line per request with the client's
//! text escaped; the request body read within its size limit and timeout; and the startup checks
//! of the origins and key the server is told.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use vl_models::engine::Completion;

use crate::error::ApiError;
use crate::state::App;
use crate::ServerError;

/// Every request: CORS preflight answered, the API key checked, CORS headers added, and one
/// log line on stderr (a chat completion answered 200 logs its own line with token counts when
/// its answer ends).
pub(crate) async fn guard(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let t = Instant::now();
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let origin = req.headers().get(header::ORIGIN).and_then(|o| o.to_str().ok()).map(String::from);
    let allowed = origin.filter(|o| app.config.cors_origins.iter().any(|a| a == "*" || a.eq_ignore_ascii_case(o)));
    let preflight = method == axum::http::Method::OPTIONS;
    let mut resp = if preflight {
        preflight_answer(allowed.is_some(), req.headers())
    } else if needs_key(&app, &path) && !authorized(&app, req.headers()) {
        unauthorized(&app, req).await
    } else {
        next.run(req).await
    };
    if let Some(o) = allowed.and_then(|o| header::HeaderValue::from_str(&o).ok()) {
        allow_origin(&mut resp, o, preflight);
    }
    log_request(&method, &path, resp.status(), t);
    resp
}

/// The answer to a CORS preflight: 204, with what it may send when its origin is `allowed`.
fn preflight_answer(allowed: bool, headers: &axum::http::HeaderMap) -> Response {
    let mut r = StatusCode::NO_CONTENT.into_response();
    if allowed {
        // The headers the page asks to send (the openai SDK's `x-stainless-*` ones, ...),
        // echoed when each is a header name; the usual two otherwise.
        let asked = headers.get(header::ACCESS_CONTROL_REQUEST_HEADERS).and_then(requested_headers);
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, header::HeaderValue::from_static("GET, POST, OPTIONS"));
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            asked.unwrap_or(header::HeaderValue::from_static("authorization, content-type")),
        );
        h.insert(header::ACCESS_CONTROL_MAX_AGE, header::HeaderValue::from_static("600"));
    }
    r
}

/// Whether `path` needs the API key: all but /health and the web chat's files.
fn needs_key(app: &App, path: &str) -> bool {
    path != "/health" && !(app.config.ui && crate::ui::is_ui_path(path))
}

/// The 401 of a request without the key. The body is read (within the size limit) before the
/// answer, so that a client still sending it gets the 401 rather than a broken connection.
async fn unauthorized(app: &App, req: axum::extract::Request) -> Response {
    let anthropic = req.uri().path().starts_with("/v1/messages");
    let _ = axum::body::to_bytes(req.into_body(), app.config.max_body_bytes).await;
    let e = ApiError::with(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        "invalid_api_key",
        "missing or wrong API key: send the header `Authorization: Bearer KEY` (or `x-api-key: KEY`)",
    );
    if anthropic {
        return e.anthropic_response();
    }
    e.into_response()
}

/// The CORS headers of an answer to an allowed `origin`.
fn allow_origin(resp: &mut Response, origin: header::HeaderValue, preflight: bool) {
    resp.headers_mut().insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    let vary =
        if preflight { "origin, access-control-request-method, access-control-request-headers" } else { "origin" };
    resp.headers_mut().insert(header::VARY, header::HeaderValue::from_static(vary));
}

/// The request's log line, but for an answered completion, which logs its own line with its
/// token counts when its answer ends.
fn log_request(method: &axum::http::Method, path: &str, status: StatusCode, t: Instant) {
    let answers = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"];
    if answers.contains(&path) && status == StatusCode::OK {
        return;
    }
    // The method and path are the client's: escaped, so they cannot forge or hide log text.
    let (method, path) = (escape_log(method.as_str()), escape_log(path));
    note!("{method} {path} {} total={:.3}s", status.as_u16(), t.elapsed().as_secs_f64());
}

/// Whether the request carries the server's key (always, when it has none): `Authorization:
/// Bearer KEY`, the scheme in any case and the blanks around it and the key free (RFC 7235), or
/// Anthropic's `x-api-key: KEY`.
fn authorized(app: &App, headers: &axum::http::HeaderMap) -> bool {
    let Some(key) = &app.config.api_key else { return true };
    let blank = [' ', '\t'];
    let sent = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, credentials) = v.trim_matches(blank).split_once(blank)?;
        scheme.eq_ignore_ascii_case("bearer").then(|| credentials.trim_matches(blank))
    });
    let sent = sent.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(|v| v.trim_matches(blank)));
    // Compared in full whatever the first difference, so the time taken says nothing of the key.
    sent.is_some_and(|s| s.len() == key.len() && s.bytes().zip(key.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0)
}

/// Most header names a preflight's `Access-Control-Request-Headers` may list, and its length, for
/// the list to be echoed.
const MAX_REQUESTED_HEADERS: usize = 64;
const MAX_REQUESTED_HEADERS_BYTES: usize = 4096;

/// A preflight's `Access-Control-Request-Headers` as the `Access-Control-Allow-Headers` to
/// answer: the names lowercased, when every one is an HTTP token (RFC 9110 `tchar`s) and there
/// are at most `MAX_REQUESTED_HEADERS` in `MAX_REQUESTED_HEADERS_BYTES`; None otherwise.
fn requested_headers(v: &header::HeaderValue) -> Option<header::HeaderValue> {
    let v = v.to_str().ok().filter(|v| v.len() <= MAX_REQUESTED_HEADERS_BYTES)?;
    let tchar = |c: u8| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c);
    let names: Vec<&str> = v.split(',').map(|n| n.trim_matches([' ', '\t'])).collect();
    let ok = names.len() <= MAX_REQUESTED_HEADERS && names.iter().all(|n| !n.is_empty() && n.bytes().all(tchar));
    if !ok {
        return None;
    }
    header::HeaderValue::from_str(&names.join(", ").to_ascii_lowercase()).ok()
}

/// Client-controlled text as it goes into a log line: every control and format character
/// (Unicode categories Cc, Cf, Zl, Zp: C0 and C1 controls, bidi overrides and isolates, zero-width
/// characters, line and paragraph separators) and the backslash written as `\u{XXXX}`, so a request
/// can neither break a line nor make one read otherwise than it is.
pub(crate) fn escape_log(s: &str) -> std::borrow::Cow<'_, str> {
    fn format_char(c: char) -> bool {
        matches!(c as u32,
            0xAD | 0x600..=0x605 | 0x61C | 0x6DD | 0x70F | 0x890..=0x891 | 0x8E2 | 0x180E
            | 0x200B..=0x200F | 0x2028..=0x202E | 0x2060..=0x2064 | 0x2066..=0x206F | 0xFEFF
            | 0xFFF9..=0xFFFB | 0x110BD | 0x110CD | 0x13430..=0x1343F | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A | 0xE0001 | 0xE0020..=0xE007F)
    }
    let escaped = |c: char| c.is_control() || c == '\\' || format_char(c);
    if !s.chars().any(escaped) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if escaped(c) {
            out.push_str(&format!("\\u{{{:04X}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The log line of an answered request to `path`.
pub(crate) fn log_answer(path: &str, all: &[Completion], started: Instant) {
    let c = &all[0];
    note!(
        "POST {path} 200 prompt={} cached={} completion={} ttft={:.3}s total={:.3}s",
        c.prompt_tokens,
        c.cached_tokens,
        all.iter().map(|c| c.token_ids.len()).sum::<usize>(),
        c.time_to_first_token.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}

/// The body within the size limit; a body announced over it is refused before it is read.
pub(crate) async fn read_body(app: &App, req: axum::extract::Request) -> Result<Bytes, ApiError> {
    let too_large = |n: String| {
        ApiError::with(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("the request body is {n} bytes, over the server's limit of {} bytes", app.config.max_body_bytes),
        )
    };
    let announced = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(n) = announced.filter(|&n| n > app.config.max_body_bytes as u64) {
        return Err(too_large(n.to_string()));
    }
    let timeout = app.config.connections.body_timeout;
    let read = tokio::time::timeout(timeout, axum::body::to_bytes(req.into_body(), app.config.max_body_bytes));
    let Ok(read) = read.await else {
        return Err(ApiError::with(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "body_timeout",
            format!(
                "the request body did not arrive within {} s (--body-timeout){}",
                timeout.as_secs_f64(),
                announced.map(|n| format!("; Content-Length {n}")).unwrap_or_default()
            ),
        ));
    };
    read.map_err(|e| {
        // Over the limit, or a body that broke off (shorter than its Content-Length, a
        // connection closed mid-body): only the first is a 413.
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        let mut over = false;
        while let Some(s) = source {
            over |= s.to_string().contains("length limit exceeded");
            source = s.source();
        }
        if over {
            too_large(format!("more than {}", app.config.max_body_bytes))
        } else {
            let told = announced.map(|n| format!(" (Content-Length {n})")).unwrap_or_default();
            ApiError::with(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "incomplete_body",
                format!("the request body ended before it was complete{told}: {e}"),
            )
        }
    })
}

/// `--cors-origins` entries as the server compares them: each trimmed, and each `*` or an
/// origin `scheme://host[:port]` (no path, no slash after it) as a browser sends it: lowercased,
/// the scheme's default port dropped. An empty or malformed entry is an error naming it.
pub fn cors_origins(entries: &[String]) -> Result<Vec<String>, ServerError> {
    entries.iter().map(|e| origin(e.trim()).ok_or_else(|| ServerError::Config(origin_error(e)))).collect()
}

fn origin_error(entry: &str) -> String {
    if entry.trim().is_empty() {
        "an empty entry (two commas in a row, or one at an end)".into()
    } else {
        format!("{entry:?} is not an origin: expected `*` or scheme://host[:port], without a path")
    }
}

/// `e` as an origin, or None when it is not `*` or `scheme://host[:port]`.
fn origin(e: &str) -> Option<String> {
    if e == "*" {
        return Some(e.into());
    }
    let (scheme, authority) = e.split_once("://")?;
    let scheme_ok = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    let (host, port) = match authority.strip_prefix('[') {
        // An IPv6 literal.
        Some(rest) => {
            let (ip, after) = rest.split_once(']')?;
            if ip.is_empty() || !ip.chars().all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.') {
                return None;
            }
            let port = if after.is_empty() { None } else { Some(after.strip_prefix(':')?) };
            (format!("[{ip}]"), port)
        }
        None => {
            let (h, port) = match authority.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            };
            if h.is_empty() || !h.chars().all(|c| c.is_ascii_alphanumeric() || "-._~".contains(c)) {
                return None;
            }
            (h.to_string(), port)
        }
    };
    let port = match port {
        None => None,
        Some(p) if (1..=5).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()) => Some(p.parse::<u16>().ok()?),
        Some(_) => return None,
    };
    if !scheme_ok {
        return None;
    }
    let scheme = scheme.to_ascii_lowercase();
    let default = match scheme.as_str() {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    };
    let host = host.to_ascii_lowercase();
    Some(match port.filter(|&p| Some(p) != default) {
        Some(p) => format!("{scheme}://{host}:{p}"),
        None => format!("{scheme}://{host}"),
    })
}

/// Refuses an API key no request could send: empty, or with a character outside visible ASCII
/// (bytes 0x21-0x7E; an HTTP header value carries nothing else, and blanks around a key are not
/// part of it).
pub fn check_api_key(key: &str) -> Result<(), ServerError> {
    if key.is_empty() {
        return Err(ServerError::Config("the key is empty".into()));
    }
    if let Some(i) = key.chars().position(|c| !c.is_ascii_graphic()) {
        return Err(ServerError::Config(format!(
            "the key's character {} is not visible ASCII (0x21-0x7E): no HTTP Authorization header could carry it",
            i + 1
        )));
    }
    Ok(())
}
