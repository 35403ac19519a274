//! A message part's media: text, images and videos from data URLs, http(s) URLs (with
//! `allow_remote_media`, bounded in bytes and time) or local paths under `allowed_media_dir`.
//! Parts are walked as JSON (their shapes vary across clients: a URL as a string or an object,
//! budgets beside or inside it).

use std::path::PathBuf;
use std::time::Duration;

use axum::http::StatusCode;
use base64::Engine as _;
use serde_json::Value;
use vl_models::engine::{Part, VideoData};
use vl_models::limits::LimitKind;

use crate::error::ApiError;
use crate::router::App;

fn field<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.get(name).filter(|x| !x.is_null())
}

pub(crate) fn part(app: &App, p: &Value, at: &str) -> std::result::Result<Part, ApiError> {
    let kind =
        p.get("type").and_then(Value::as_str).ok_or_else(|| ApiError::bad(format!("`{at}.type` must be a string")))?;
    match kind {
        "text" => Ok(Part::Text(
            p.get("text")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad(format!("`{at}.text` must be a string")))?
                .into(),
        )),
        "image_url" | "image" => {
            let iu = p.get("image_url").or_else(|| p.get("image"));
            let url = match iu {
                Some(Value::String(s)) => s.as_str(),
                Some(o @ Value::Object(_)) => o
                    .get("url")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::bad(format!("`{at}.image_url.url` must be a string")))?,
                _ => return Err(ApiError::bad(format!("`{at}.image_url` must be an object with a `url`"))),
            };
            let budget = |name: &str| -> std::result::Result<Option<usize>, ApiError> {
                let from = [Some(p), iu].into_iter().flatten().find_map(|o| field(o, name));
                match from {
                    None => Ok(None),
                    Some(x) => x
                        .as_u64()
                        .map(|n| Some(n as usize))
                        .ok_or_else(|| ApiError::bad(format!("`{at}.{name}` must be a positive integer"))),
                }
            };
            let (min_pixels, max_pixels) = (budget("min_pixels")?, budget("max_pixels")?);
            let (data, name) = media_bytes(app, url, at, "image")?;
            Ok(Part::Image { data, name, min_pixels, max_pixels })
        }
        "video_url" | "video" | "input_video" => video_part(app, p, kind, at),
        other => Err(ApiError::bad(format!(
            "`{at}.type` = {other:?}: expected `text`, `image_url`, `video_url` or `input_video`"
        ))),
    }
}

/// A video part: `{"type": "video_url", "video_url": {"url": ...}}` (data URL, http(s) URL with
/// --allow-remote-media, or a path under --allowed-media-dir: a file or a directory of frames)
/// or `{"type": "input_video", "input_video": {"data": BASE64}}` (or `{"url": ...}`), with
/// optional `fps`, `max_frames`, `max_pixels` beside or inside the object.
fn video_part(app: &App, p: &Value, kind: &str, at: &str) -> std::result::Result<Part, ApiError> {
    let inner = p.get(kind);
    let (url, data) = match inner {
        Some(Value::String(s)) => (Some(s.as_str()), None),
        Some(o @ Value::Object(_)) => (o.get("url").and_then(Value::as_str), o.get("data").and_then(Value::as_str)),
        _ => return Err(ApiError::bad(format!("`{at}.{kind}` must be an object with a `url` (or `data`)"))),
    };
    let from = |name: &str| [Some(p), inner].into_iter().flatten().find_map(|o| field(o, name));
    let count = |name: &str| -> std::result::Result<Option<usize>, ApiError> {
        from(name)
            .map(|x| {
                x.as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| ApiError::bad(format!("`{at}.{name}` must be a positive integer")))
            })
            .transpose()
    };
    let fps = from("fps")
        .map(|x| x.as_f64().ok_or_else(|| ApiError::bad(format!("`{at}.fps` must be a number"))))
        .transpose()?;
    let options = vl_models::video::VideoOptions {
        fps,
        max_frames: count("max_frames")?,
        max_pixels: count("max_pixels")?,
        ..Default::default()
    };
    let (source, name) = match (data, url) {
        (Some(b64), _) => {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|e| ApiError::bad(format!("`{at}`: invalid base64 video data: {e}")))?;
            (VideoData::Bytes(bytes), format!("{at} (data)"))
        }
        (None, Some(url)) if url.starts_with("data:") || url.starts_with("http://") || url.starts_with("https://") => {
            let (bytes, name) = media_bytes(app, url, at, "video")?;
            (VideoData::Bytes(bytes), name)
        }
        (None, Some(url)) => {
            let path = url.strip_prefix("file://").unwrap_or(url);
            (VideoData::Path(allowed_path(app, path, at, "video")?), path.to_string())
        }
        (None, None) => return Err(ApiError::bad(format!("`{at}.{kind}` needs a `url` or `data`"))),
    };
    Ok(Part::Video { source, name, options })
}

/// `path` resolved, when it lies under --allowed-media-dir and is a regular file (or, for a
/// video, a directory of frames).
///
/// A path outside the directory gets one answer whether or not it exists: it is first checked
/// as written (made absolute, `.` and `..` taken lexically), without asking the filesystem, so a
/// client cannot probe which files exist elsewhere. Only a path inside is resolved; one whose
/// links lead outside gets that same answer.
fn allowed_path(app: &App, path: &str, at: &str, what: &str) -> std::result::Result<PathBuf, ApiError> {
    let Some(root) = &app.config.allowed_media_dir else {
        return Err(ApiError::bad(format!(
            "`{at}`: local {what} paths are disabled; start the server with --allowed-media-dir DIR or send a data URL"
        )));
    };
    let outside = || {
        ApiError::with(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            "media_not_allowed",
            format!("`{at}`: {path} is outside the allowed media directory"),
        )
    };
    let written = lexical(std::path::Path::new(path));
    if !written.starts_with(&root.written) && !written.starts_with(&root.real) {
        return Err(outside());
    }
    let real = written.canonicalize().map_err(|e| ApiError::bad(format!("`{at}`: cannot open {path}: {e}")))?;
    if !real.starts_with(&root.real) {
        return Err(outside());
    }
    let meta = std::fs::metadata(&real).map_err(|e| ApiError::bad(format!("`{at}`: cannot open {path}: {e}")))?;
    if !(meta.is_file() || (what == "video" && meta.is_dir())) {
        let kind = if meta.is_dir() { "a directory" } else { "not a regular file (a FIFO, device or socket)" };
        return Err(ApiError::bad(format!("`{at}`: {path} is {kind}: only files are read as {what}s")));
    }
    Ok(real)
}

/// `path` made absolute (against the working directory) with `.` and `..` resolved as written,
/// without touching the filesystem.
pub(crate) fn lexical(path: &std::path::Path) -> PathBuf {
    use std::path::Component;
    let base = if path.is_absolute() { PathBuf::new() } else { std::env::current_dir().unwrap_or_default() };
    let mut out = PathBuf::new();
    for c in base.components().chain(path.components()) {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

enum Fetch {
    TooLarge(u64),
    Failed(String),
}

/// Redirects a remote media fetch follows at most.
const MAX_REDIRECTS: usize = 3;

/// GETs `url` within `timeout` in all and at most `max` bytes (an announced or actual larger
/// body is refused without reading it all). Redirects are followed here, at most
/// `MAX_REDIRECTS`, and only to http(s) URLs (a redirect to `file://` or any other scheme is
/// refused by name).
fn fetch(url: &str, timeout: Duration, max: u64) -> std::result::Result<Vec<u8>, Fetch> {
    use std::io::Read;
    let deadline = std::time::Instant::now() + timeout;
    let agent = ureq::AgentBuilder::new().redirects(0).build();
    let mut at = url::Url::parse(url).map_err(|e| Fetch::Failed(format!("invalid URL: {e}")))?;
    let mut hops = 0;
    let resp = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(Fetch::Failed(format!("no answer within {} s", timeout.as_secs_f64())));
        }
        let resp = agent.request_url("GET", &at).timeout(left).call().map_err(|e| Fetch::Failed(e.to_string()))?;
        if !(300..400).contains(&resp.status()) {
            break resp;
        }
        let location = resp
            .header("location")
            .ok_or_else(|| Fetch::Failed(format!("{} {} without a Location", resp.status(), resp.status_text())))?;
        let next = at.join(location).map_err(|e| Fetch::Failed(format!("redirect to {location:?}: {e}")))?;
        if !matches!(next.scheme(), "http" | "https") {
            return Err(Fetch::Failed(format!(
                "redirect to a {}: URL refused (only http and https are followed)",
                next.scheme()
            )));
        }
        hops += 1;
        if hops > MAX_REDIRECTS {
            return Err(Fetch::Failed(format!("more than {MAX_REDIRECTS} redirects")));
        }
        at = next;
    };
    if let Some(n) = resp.header("content-length").and_then(|v| v.parse::<u64>().ok()) {
        if n > max {
            return Err(Fetch::TooLarge(n));
        }
    }
    let mut data = Vec::new();
    resp.into_reader().take(max + 1).read_to_end(&mut data).map_err(|e| Fetch::Failed(e.to_string()))?;
    if data.len() as u64 > max {
        return Err(Fetch::TooLarge(data.len() as u64));
    }
    Ok(data)
}

/// An image's (a video's) bytes from a data URL, an http(s) URL (with --allow-remote-media) or, under
/// --allowed-media-dir, a local path.
fn media_bytes(app: &App, url: &str, at: &str, what: &str) -> std::result::Result<(Vec<u8>, String), ApiError> {
    let too_big = |n: u64| {
        ApiError::with(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            if what == "video" { "video_too_large" } else { "image_too_large" },
            format!("`{at}`: the {what} is {n} bytes, over the server's limit of {} bytes", app.config.max_image_bytes),
        )
    };
    if let Some(rest) = url.strip_prefix("data:") {
        let (meta, payload) =
            rest.split_once(',').ok_or_else(|| ApiError::bad(format!("`{at}`: malformed data URL")))?;
        if !meta.ends_with(";base64") {
            return Err(ApiError::bad(format!("`{at}`: only base64 data URLs are supported")));
        }
        if payload.len() as u64 / 4 * 3 > app.config.max_image_bytes + 3 {
            return Err(too_big(payload.len() as u64 / 4 * 3));
        }
        let data = base64::engine::general_purpose::STANDARD
            .decode(payload.trim())
            .map_err(|e| ApiError::bad(format!("`{at}`: invalid base64 {what} data: {e}")))?;
        return Ok((data, format!("{at} (data URL)")));
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        let Some(timeout) = app.config.remote_media else {
            return Err(ApiError::bad(format!(
                "`{at}`: remote {what} URLs are disabled; start the server with --allow-remote-media or send a base64 data URL"
            )));
        };
        // Off the runtime's threads: request parsing runs in `block_in_place`.
        let data = fetch(url, timeout, app.config.max_image_bytes).map_err(|e| match e {
            Fetch::TooLarge(n) => too_big(n),
            Fetch::Failed(m) => ApiError::bad(format!("`{at}`: cannot fetch {url}: {m}")),
        })?;
        return Ok((data, url.to_string()));
    }
    let path = url.strip_prefix("file://").unwrap_or(url);
    let real = allowed_path(app, path, at, "image")?;
    let data = vl_models::limits::read_regular(&real, app.config.max_image_bytes, LimitKind::ImageBytes).map_err(
        |e| match e {
            vl_models::Error::Limit { .. } => too_big(std::fs::metadata(&real).map_or(0, |m| m.len())),
            other => ApiError::bad(format!("`{at}`: {other}")),
        },
    )?;
    Ok((data, path.to_string()))
}
