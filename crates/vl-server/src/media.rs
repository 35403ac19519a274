//! A message part's media: text, images and videos from data URLs, http(s) URLs (with
//! `allow_remote_media`, bounded in bytes and time) or local paths under `allowed_media_dir`.
//! Parts are walked as JSON (their shapes vary across clients: a URL as a string or an object,
//! budgets beside or inside it).

use std::path::PathBuf;
use std::time::Duration;

use axum::http::StatusCode;
use base64::Engine as _;
use serde_json::{Map, Value};
use vl_models::engine::{Part, VideoData};
use vl_models::limits::LimitKind;

use crate::error::ApiError;
use crate::fields::{known_keys, opt_str, typed_field};
use crate::state::App;

/// Pixels of an image sent with `detail: "low"`: OpenAI's low detail is a 512x512 image.
pub(crate) const LOW_DETAIL_PIXELS: usize = 512 * 512;

/// The fields a part of each type may carry beside `type` (and `cache_control`), and inside its
/// media object. Anything else is refused, named with its path.
const TEXT_KEYS: [&str; 3] = ["type", "text", "cache_control"];
const IMAGE_KEYS: [&str; 6] = ["type", "image_url", "image", "min_pixels", "max_pixels", "cache_control"];
const IMAGE_URL_KEYS: [&str; 4] = ["url", "detail", "min_pixels", "max_pixels"];
const VIDEO_KEYS: [&str; 5] = ["type", "fps", "max_frames", "max_pixels", "cache_control"];
const VIDEO_URL_KEYS: [&str; 5] = ["url", "data", "fps", "max_frames", "max_pixels"];

/// `cache_control`, Anthropic's prompt-caching hint (`{"type": "ephemeral", "ttl": ...}`), as
/// LiteLLM- and OpenRouter-style clients put it on a part: accepted and ignored, because the
/// prefix cache reuses every prompt's longest cached prefix without being asked (docs/serving.md);
/// checked for its shape all the same.
fn cache_control(o: &Map<String, Value>, at: &str) -> std::result::Result<(), ApiError> {
    let Some(c) = o.get("cache_control").filter(|c| !c.is_null()) else { return Ok(()) };
    let at = format!("{at}.cache_control");
    let bad =
        || ApiError::bad_at(at.clone(), format!("`{at}` must be {{\"type\": \"ephemeral\"}} (with an optional `ttl`)"));
    let co = c.as_object().ok_or_else(bad)?;
    known_keys(co, &["type", "ttl"], &at)?;
    if co.get("type").and_then(Value::as_str) != Some("ephemeral") {
        return Err(bad());
    }
    opt_str(co, "ttl", &at)?;
    Ok(())
}

/// A count `name` of `o` (at `at`), pixels or frames, when set: a positive integer.
fn positive(o: &Map<String, Value>, name: &str, at: &str) -> std::result::Result<Option<usize>, ApiError> {
    typed_field(o, name, at, "a positive integer", |x| x.as_u64().filter(|&n| n > 0).map(|n| n as usize))
}

/// The pixel budget of an image sent with `detail: "low"`: `LOW_DETAIL_PIXELS` (at least the
/// server's `--min-pixels`), or None when the server's own budget is no larger already.
fn low_detail_budget(app: &App) -> Option<usize> {
    let low = LOW_DETAIL_PIXELS.max(app.engine.options().model.min_pixels.unwrap_or(0));
    // The server's largest image: a very large square sized under its budget.
    let most = app.engine.family().image_sizing(1 << 14, 1 << 14).ok().map(|s| s.ours.resized.0 * s.ours.resized.1)?;
    (low < most).then_some(low)
}

pub(crate) fn part(app: &App, p: &Value, at: &str) -> std::result::Result<Part, ApiError> {
    let Some(o) = p.as_object() else {
        return Err(ApiError::bad_at(at, format!("`{at}` must be an object with a `type`")));
    };
    let kind = o
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_at(format!("{at}.type"), format!("`{at}.type` must be a string")))?;
    match kind {
        "text" => {
            known_keys(o, &TEXT_KEYS, at)?;
            cache_control(o, at)?;
            let text = o
                .get("text")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad_at(format!("{at}.text"), format!("`{at}.text` must be a string")))?;
            Ok(Part::Text(text.into()))
        }
        "image_url" | "image" => {
            known_keys(o, &IMAGE_KEYS, at)?;
            cache_control(o, at)?;
            if o.contains_key("image_url") && o.contains_key("image") {
                return Err(ApiError::bad_at(at, format!("`{at}`: send one of `image_url` and `image`, not both")));
            }
            let key = if o.contains_key("image") { "image" } else { "image_url" };
            let inner = format!("{at}.{key}");
            let (url, io) = match o.get(key) {
                Some(Value::String(s)) => (s.as_str(), None),
                Some(Value::Object(io)) => {
                    known_keys(io, &IMAGE_URL_KEYS, &inner)?;
                    let url = opt_str(io, "url", &inner)?.ok_or_else(|| {
                        ApiError::bad_at(format!("{inner}.url"), format!("`{inner}.url` must be a string"))
                    })?;
                    (url, Some(io))
                }
                _ => return Err(ApiError::bad_at(inner.clone(), format!("`{inner}` must be an object with a `url`"))),
            };
            // A budget beside the object wins over one inside it; both are checked.
            let budget = |name: &str| -> std::result::Result<Option<usize>, ApiError> {
                let inside = io.map(|io| positive(io, name, &inner)).transpose()?.flatten();
                Ok(positive(o, name, at)?.or(inside))
            };
            let (min_pixels, mut max_pixels) = (budget("min_pixels")?, budget("max_pixels")?);
            match io.and_then(|io| io.get("detail")).filter(|d| !d.is_null()) {
                None => {}
                Some(Value::String(d)) if d == "high" || d == "auto" => {}
                Some(Value::String(d)) if d == "low" => {
                    if let Some(low) = low_detail_budget(app) {
                        max_pixels = Some(max_pixels.map_or(low, |m| m.min(low)));
                    }
                }
                Some(d) => {
                    return Err(ApiError::bad_at(
                        format!("{inner}.detail"),
                        format!("`{inner}.detail` = {d}: expected \"low\", \"high\" or \"auto\""),
                    ))
                }
            }
            let MediaBytes { data, name } = media_bytes(app, url, at, "image")?;
            Ok(Part::Image { data, name, min_pixels, max_pixels })
        }
        "video_url" | "video" | "input_video" => video_part(app, o, kind, at),
        other => Err(ApiError::bad_at(
            format!("{at}.type"),
            format!("`{at}.type` = {other:?}: expected `text`, `image_url`, `video_url` or `input_video`"),
        )),
    }
}

/// A video part: `{"type": "video_url", "video_url": {"url": ...}}` (data URL, http(s) URL with
/// --allow-remote-media, or a path under --allowed-media-dir: a file or a directory of frames)
/// or `{"type": "input_video", "input_video": {"data": BASE64}}` (or `{"url": ...}`), with
/// optional `fps`, `max_frames`, `max_pixels` beside or inside the object.
fn video_part(app: &App, p: &Map<String, Value>, kind: &str, at: &str) -> std::result::Result<Part, ApiError> {
    let mut keys = VIDEO_KEYS.to_vec();
    keys.push(kind);
    known_keys(p, &keys, at)?;
    cache_control(p, at)?;
    let inner_at = format!("{at}.{kind}");
    let (url, data, inner) = match p.get(kind) {
        Some(Value::String(s)) => (Some(s.as_str()), None, None),
        Some(Value::Object(io)) => {
            known_keys(io, &VIDEO_URL_KEYS, &inner_at)?;
            (opt_str(io, "url", &inner_at)?, opt_str(io, "data", &inner_at)?, Some(io))
        }
        _ => {
            return Err(ApiError::bad_at(
                inner_at.clone(),
                format!("`{at}.{kind}` must be an object with a `url` (or `data`)"),
            ))
        }
    };
    // A setting beside the object wins over one inside it; both are checked.
    let count = |name: &str| -> std::result::Result<Option<usize>, ApiError> {
        let inside = inner.map(|io| positive(io, name, &inner_at)).transpose()?.flatten();
        Ok(positive(p, name, at)?.or(inside))
    };
    let fps = {
        let number = |o: &Map<String, Value>, at: &str| typed_field(o, "fps", at, "a number", Value::as_f64);
        let inside = inner.map(|io| number(io, &inner_at)).transpose()?.flatten();
        number(p, at)?.or(inside)
    };
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
            let MediaBytes { data, name } = media_bytes(app, url, at, "video")?;
            (VideoData::Bytes(data), name)
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
    let written = crate::state::lexical(std::path::Path::new(path));
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

/// A medium's bytes and the name its errors and logs give it.
struct MediaBytes {
    data: Vec<u8>,
    /// The path or URL as sent, or `AT (data URL)`.
    name: String,
}

/// An image's (a video's) bytes from a data URL, an http(s) URL (with --allow-remote-media) or, under
/// --allowed-media-dir, a local path.
fn media_bytes(app: &App, url: &str, at: &str, what: &str) -> std::result::Result<MediaBytes, ApiError> {
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
        return Ok(MediaBytes { data, name: format!("{at} (data URL)") });
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
        return Ok(MediaBytes { data, name: url.to_string() });
    }
    let path = url.strip_prefix("file://").unwrap_or(url);
    let real = allowed_path(app, path, at, "image")?;
    let data = vl_models::limits::read_regular(&real, app.config.max_image_bytes, LimitKind::ImageBytes).map_err(
        |e| match e {
            vl_models::Error::Limit { .. } => too_big(std::fs::metadata(&real).map_or(0, |m| m.len())),
            other => ApiError::bad(format!("`{at}`: {other}")),
        },
    )?;
    Ok(MediaBytes { data, name: path.to_string() })
}
