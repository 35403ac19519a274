//! `vl chat`'s conversation files: `/save FILE` writes the conversation as OpenAI's message list
//! (JSON, images as data URLs), `/load FILE` reads one back under the media rule (`load`: no
//! local file the user did not attach in this session, nothing from the network).

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use serde_json::{json, Value};
use vl_models::engine::{ChatMessage, Part, VideoData};
use vl_models::limits::{ImageLimits, LimitKind};

use crate::flags::check_media;

/// Largest conversation file `/load` reads (images travel inside it as data URLs).
const MAX_CONVERSATION_BYTES: u64 = 256 << 20;
/// Most messages a loaded conversation may hold.
const MAX_MESSAGES: usize = 10_000;

/// The conversation as OpenAI's message list: images as data URLs (the file stands alone),
/// videos as file URLs of their absolute paths (or data URLs). Written to a temporary name
/// beside the target, then renamed.
pub(super) fn save(path: &Path, history: &[ChatMessage]) -> Result<()> {
    let b64 = |data: &[u8]| base64::engine::general_purpose::STANDARD.encode(data);
    let mut messages = Vec::with_capacity(history.len());
    for m in history {
        let text_only = m.parts.iter().all(|p| matches!(p, Part::Text(_)));
        let content = if text_only {
            Value::String(m.parts.iter().map(|p| if let Part::Text(t) = p { t.as_str() } else { "" }).collect())
        } else {
            let mut parts = Vec::new();
            for p in &m.parts {
                parts.push(match p {
                    Part::Text(t) => json!({"type": "text", "text": t}),
                    Part::Image { data, .. } => {
                        let mime = image::guess_format(data).map(|f| f.to_mime_type()).unwrap_or("image/png");
                        json!({"type": "image_url", "image_url": {"url": format!("data:{mime};base64,{}", b64(data))}})
                    }
                    Part::Video { source: VideoData::Path(p), .. } => {
                        let abs = std::path::absolute(p).with_context(|| format!("video {}", p.display()))?;
                        json!({"type": "video_url", "video_url": {"url": format!("file://{}", abs.display())}})
                    }
                    Part::Video { source: VideoData::Bytes(b), .. } => {
                        // An animated image keeps its own type; anything else goes as video/mp4.
                        use image::ImageFormat::{Gif, Png, WebP};
                        let mime = match image::guess_format(b) {
                            Ok(f @ (Gif | Png | WebP)) => f.to_mime_type(),
                            _ => "video/mp4",
                        };
                        json!({"type": "video_url", "video_url": {"url": format!("data:{mime};base64,{}", b64(b))}})
                    }
                });
            }
            Value::Array(parts)
        };
        let mut msg = json!({"role": m.role, "content": content});
        if let Some(r) = &m.reasoning {
            msg["reasoning_content"] = json!(r);
        }
        messages.push(msg);
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    // tempfile's errors name the temporary file: only the kind is said.
    let mut tmp = tempfile::Builder::new().prefix(".vl-chat-").tempfile_in(dir).map_err(|e| {
        anyhow::anyhow!("cannot create a file in {}: {}", dir.display(), std::io::Error::from(e.kind()))
    })?;
    let mut w = std::io::BufWriter::new(tmp.as_file_mut());
    serde_json::to_writer_pretty(&mut w, &Value::Array(messages))?;
    w.flush()?;
    drop(w);
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// A conversation `save` wrote, or any OpenAI message list (`[...]` or `{"messages": [...]}`):
/// roles system, user and assistant; text, `image_url` and `video_url` parts.
///
/// The media rule (the server's, with no `--allowed-media-dir`): a loaded conversation carries
/// media as data URLs, what `save` writes: `image_url` as `data:image/*` whose bytes decode as an
/// image within `limits`, `video_url` as `data:video/*` (or `data:image/*`, an animated image).
/// Nothing is read that the user did not name in this session: a path or `file://` URL is
/// taken only when it is a file attached with `/image` or `/video` in this chat (`attached`,
/// canonical paths); any other path, `file:`, `http(s):` or other URL is refused, naming the
/// message and the scheme. On any refusal nothing of the file is kept.
pub(super) fn load(path: &Path, limits: &ImageLimits, attached: &HashSet<PathBuf>) -> Result<Vec<ChatMessage>> {
    check_media("file", path)?;
    let text = vl_models::limits::read_bytes(path, MAX_CONVERSATION_BYTES, LimitKind::Fixed)?;
    let v: Value = serde_json::from_slice(&text).context("not JSON")?;
    let list = match &v {
        Value::Array(a) => a,
        Value::Object(o) => o.get("messages").and_then(Value::as_array).context("no `messages` list")?,
        _ => bail!("expected a list of messages"),
    };
    if list.len() > MAX_MESSAGES {
        bail!("{} messages; the limit is {MAX_MESSAGES}", list.len());
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = m["role"].as_str().with_context(|| format!("{at}.role is missing"))?;
        if !["system", "user", "assistant"].contains(&role) {
            bail!("{at}.role = {role:?}: expected system, user or assistant");
        }
        let parts = match &m["content"] {
            Value::String(t) => vec![Part::Text(t.clone())],
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(j, p)| part(p, &format!("{at}.content[{j}]"), limits, attached))
                .collect::<Result<_>>()?,
            Value::Null => vec![],
            _ => bail!("{at}.content: expected a string or a list of parts"),
        };
        let mut msg = ChatMessage::new(role, parts);
        msg.reasoning = match &m["reasoning_content"] {
            Value::String(r) if role == "assistant" => Some(r.clone()),
            Value::Null => None,
            _ => bail!("{at}.reasoning_content: expected a string on an assistant message"),
        };
        out.push(msg);
    }
    Ok(out)
}

fn part(p: &Value, at: &str, limits: &ImageLimits, attached: &HashSet<PathBuf>) -> Result<Part> {
    let kind = p["type"].as_str().with_context(|| format!("{at}.type is missing"))?;
    let url = |key: &str| -> Result<String> {
        let u = &p[key];
        u.as_str().or_else(|| u["url"].as_str()).map(String::from).with_context(|| format!("{at}.{key}.url is missing"))
    };
    match kind {
        "text" => Ok(Part::Text(p["text"].as_str().with_context(|| format!("{at}.text is missing"))?.to_string())),
        "image_url" => {
            let (data, name) = match media_url(&url("image_url")?, at, "image", limits.max_file_bytes, attached)? {
                Media::Bytes(b) => (b, "data".to_string()),
                Media::Path(path) => {
                    let data = vl_models::limits::read_regular(&path, limits.max_file_bytes, LimitKind::ImageBytes)
                        .with_context(|| at.to_string())?;
                    (data, path.display().to_string())
                }
            };
            Ok(Part::Image {
                data: check_image(data, &name, limits).with_context(|| at.to_string())?,
                name: at.to_string(),
                min_pixels: None,
                max_pixels: None,
            })
        }
        "video_url" => {
            let source = match media_url(&url("video_url")?, at, "video", MAX_CONVERSATION_BYTES, attached)? {
                Media::Bytes(b) => VideoData::Bytes(b),
                Media::Path(path) => VideoData::Path(path),
            };
            Ok(Part::Video { source, name: at.to_string(), options: Default::default() })
        }
        other => bail!("{at}.type = {other:?}: expected text, image_url or video_url"),
    }
}

/// `data` as an image the engine will take: a known format whose header is within `limits` and
/// whose pixels decode. `name` stands for it in the error.
pub(super) fn check_image(data: Vec<u8>, name: &str, limits: &ImageLimits) -> Result<Vec<u8>> {
    vl_models::image_file::ImageFile::from_bytes(data.clone(), Path::new(name), limits)?.decode()?;
    Ok(data)
}

enum Media {
    Bytes(Vec<u8>),
    /// A file this session attached (canonical).
    Path(PathBuf),
}

/// The scheme of `url` (`http` of `http://...`), if it has one: letters first, then letters,
/// digits, `+`, `-` or `.`, before a colon.
fn scheme(url: &str) -> Option<&str> {
    let (s, _) = url.split_once(':')?;
    let mut chars = s.chars();
    (chars.next()?.is_ascii_alphabetic() && chars.all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))).then_some(s)
}

/// A media URL of a loaded conversation under `load`'s rule; `what` is "image" or "video".
fn media_url(url: &str, at: &str, what: &str, max_bytes: u64, attached: &HashSet<PathBuf>) -> Result<Media> {
    let rule = "a loaded conversation carries media as data URLs (what /save writes)";
    if let Some(rest) = url.get(..5).filter(|p| p.eq_ignore_ascii_case("data:")).map(|_| &url[5..]) {
        let (meta, payload) = rest.split_once(',').with_context(|| format!("{at}: a data: URL without a comma"))?;
        let Some(mime) = meta.strip_suffix(";base64") else {
            bail!("{at}: a data: URL that is not base64 (only `data:TYPE;base64,...` is read)");
        };
        let mime = mime.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        let fits = match what {
            "image" => mime.starts_with("image/"),
            _ => mime.starts_with("video/") || mime.starts_with("image/"),
        };
        if !fits {
            let want = if what == "image" {
                "an image_url carries image/* data"
            } else {
                "a video_url carries video/* or image/* data"
            };
            bail!("{at}: a data: URL of type {:?} refused: {want}", truncate(&mime, 64));
        }
        if payload.len() as u64 / 4 * 3 > max_bytes + 3 {
            bail!(
                "{at}: the {what} is about {} bytes, over the limit of {max_bytes} bytes",
                payload.len() as u64 / 4 * 3
            );
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(payload.trim())
            .with_context(|| format!("{at}: invalid base64 in the data: URL"))?;
        if bytes.is_empty() {
            bail!("{at}: an empty data: URL");
        }
        return Ok(Media::Bytes(bytes));
    }
    let (local, how) = match scheme(url) {
        Some(s) if s.eq_ignore_ascii_case("file") => {
            match url.get(7..).filter(|_| url[..7].eq_ignore_ascii_case("file://")) {
                Some(p) => (p, "a file: URL"),
                None => bail!("{at}: a malformed file: URL refused: {rule}"),
            }
        }
        Some(s) if s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https") => {
            bail!("{at}: an {}: URL refused: {rule}; vl chat reads nothing from the network", s.to_ascii_lowercase())
        }
        Some(s) => bail!("{at}: a {}: URL refused: {rule}", truncate(&s.to_ascii_lowercase(), 32)),
        None => (url, "a local path (no URL scheme)"),
    };
    // Only a file the user attached in this session: compared after resolving links, and the
    // same answer whether or not the path exists.
    match std::fs::canonicalize(local) {
        Ok(real) if !local.is_empty() && attached.contains(&real) => Ok(Media::Path(real)),
        _ => bail!(
            "{at}: {how} refused: {rule}; a local {what} is read only when attached in this chat with /{what} PATH ({:?})",
            truncate(local, 200)
        ),
    }
}

/// `s` cut to at most `n` characters (for echoing untrusted text in one line).
fn truncate(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden_image(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../goldens/images").join(name)
    }

    fn b64(data: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(data)
    }

    /// A conversation of one user message: a `kind` part (`image_url`, `video_url`) with `url`,
    /// then text; loaded as `/load` loads it.
    fn load_one(kind: &str, url: &str, attached: &HashSet<PathBuf>) -> Result<Vec<ChatMessage>> {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("conv.json");
        let conv = json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": kind, kind: {"url": url}}, {"type": "text", "text": "hi"}]},
        ]);
        std::fs::write(&file, conv.to_string()).unwrap();
        load(&file, &ImageLimits::default(), attached)
    }

    /// The error as the chat prints it: one line.
    fn refusal(kind: &str, url: &str, attached: &HashSet<PathBuf>) -> String {
        let e = match load_one(kind, url, attached) {
            Ok(m) => panic!("{kind} {:?} was accepted: {} messages", truncate(url, 80), m.len()),
            Err(e) => format!("{e:#}"),
        };
        assert!(!e.contains('\n'), "{e:?}");
        assert!(e.starts_with("messages[1].content[0]"), "{e}");
        e
    }

    /// Bytes from a fixed-seed generator (xorshift), for garbage images.
    fn noise(seed: u64, n: usize) -> Vec<u8> {
        let mut x = seed.max(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn load_refuses_local_files_and_urls_it_was_not_given() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret.png");
        std::fs::copy(golden_image("square.png"), &secret).unwrap();
        let s = secret.display().to_string();
        // Nothing attached in this session.
        let none = HashSet::new();
        let cases = [
            ("file:///etc/passwd".to_string(), "a file: URL refused"),
            (format!("file://{s}"), "a file: URL refused"),
            ("FILE:///etc/passwd".to_string(), "a file: URL refused"),
            ("file:/etc/passwd".to_string(), "a malformed file: URL refused"),
            ("/etc/passwd".to_string(), "a local path (no URL scheme) refused"),
            (s.clone(), "a local path (no URL scheme) refused"),
            ("secret.png".to_string(), "a local path (no URL scheme) refused"),
            ("../../goldens/images/square.png".to_string(), "a local path (no URL scheme) refused"),
            ("/no/such/file.png".to_string(), "a local path (no URL scheme) refused"),
            ("http://127.0.0.1:9/x.png".to_string(), "an http: URL refused"),
            ("https://example.invalid/x.png".to_string(), "an https: URL refused"),
            ("ftp://example.invalid/x.png".to_string(), "a ftp: URL refused"),
        ];
        for kind in ["image_url", "video_url"] {
            for (url, want) in &cases {
                let e = refusal(kind, url, &none);
                assert!(e.contains(want), "{kind} {url}: {e}");
                assert!(e.contains("data URLs"), "{kind} {url}: {e}");
            }
        }
        // The same path attached as another file is still refused: only the attached file counts.
        let other = dir.path().join("other.png");
        std::fs::copy(golden_image("square.png"), &other).unwrap();
        let attached: HashSet<PathBuf> = [std::fs::canonicalize(&other).unwrap()].into();
        assert!(refusal("image_url", &format!("file://{s}"), &attached).contains("a file: URL refused"));
    }

    #[test]
    fn load_refuses_data_urls_that_are_not_media_that_decode() {
        let none = HashSet::new();
        let png = std::fs::read(golden_image("square.png")).unwrap();
        let mut cases: Vec<(String, &str, &str)> = vec![
            (format!("data:text/plain;base64,{}", b64(b"hello")), "image_url", "of type \"text/plain\" refused"),
            (format!("data:text/plain;base64,{}", b64(b"hello")), "video_url", "of type \"text/plain\" refused"),
            (
                format!("data:application/json;base64,{}", b64(b"{}")),
                "image_url",
                "refused: an image_url carries image/*",
            ),
            (format!("data:;base64,{}", b64(&png)), "image_url", "of type \"\" refused"),
            (format!("data:video/mp4;base64,{}", b64(&png)), "image_url", "of type \"video/mp4\" refused"),
            ("data:image/png,not-base64".into(), "image_url", "not base64"),
            ("data:image/png;base64".into(), "image_url", "without a comma"),
            ("data:image/png;base64,!!!!".into(), "image_url", "invalid base64"),
            ("data:image/png;base64,".into(), "image_url", "empty data: URL"),
            ("data:video/mp4;base64,".into(), "video_url", "empty data: URL"),
        ];
        // Garbage under an image type: seeded noise, noise after a PNG signature, and a real PNG
        // cut short at a few lengths.
        let mut garbage: Vec<Vec<u8>> = (1..=4u64).map(|seed| noise(seed, 64 << seed)).collect();
        for seed in 5..=7u64 {
            let mut b = png[..8].to_vec();
            b.extend(noise(seed, 512));
            garbage.push(b);
        }
        for cut in [16, 33, png.len() / 2, png.len() - 13] {
            garbage.push(png[..cut].to_vec());
        }
        let urls: Vec<String> = garbage.iter().map(|g| format!("data:image/png;base64,{}", b64(g))).collect();
        for url in &urls {
            cases.push((url.clone(), "image_url", "messages[1].content[0]: image data: "));
        }
        for (url, kind, want) in &cases {
            let e = refusal(kind, url, &none);
            assert!(e.contains(want), "{kind} {}: {e}", truncate(url, 60));
        }
    }

    #[test]
    fn load_takes_data_urls_and_the_files_attached_in_this_session() {
        let none = HashSet::new();
        let png = std::fs::read(golden_image("square.png")).unwrap();
        let gif = std::fs::read(golden_image("anim.gif")).unwrap();
        let m = load_one("image_url", &format!("data:image/png;base64,{}", b64(&png)), &none).unwrap();
        assert!(matches!(&m[1].parts[0], Part::Image { data, .. } if *data == png));
        // The type names an image; the bytes decide which (as the engine decodes them).
        let m = load_one("image_url", &format!("data:image/jpeg;base64,{}", b64(&png)), &none).unwrap();
        assert!(matches!(&m[1].parts[0], Part::Image { .. }));
        let m = load_one("video_url", &format!("data:video/mp4;base64,{}", b64(b"\0\0\0\x18ftypmp42")), &none).unwrap();
        assert!(matches!(&m[1].parts[0], Part::Video { source: VideoData::Bytes(_), .. }));
        let m = load_one("video_url", &format!("data:image/gif;base64,{}", b64(&gif)), &none).unwrap();
        assert!(matches!(&m[1].parts[0], Part::Video { source: VideoData::Bytes(b), .. } if *b == gif));
        // A file attached with /image (or /video) in this session: by path, file URL or a link.
        let dir = tempfile::tempdir().unwrap();
        let pic = dir.path().join("pic.png");
        std::fs::write(&pic, &png).unwrap();
        std::os::unix::fs::symlink(&pic, dir.path().join("link.png")).unwrap();
        let attached: HashSet<PathBuf> = [std::fs::canonicalize(&pic).unwrap()].into();
        for url in [
            pic.display().to_string(),
            format!("file://{}", pic.display()),
            dir.path().join("link.png").display().to_string(),
        ] {
            let m = load_one("image_url", &url, &attached).unwrap();
            assert!(matches!(&m[1].parts[0], Part::Image { data, .. } if *data == png), "{url}");
            let m = load_one("video_url", &url, &attached).unwrap();
            assert!(matches!(&m[1].parts[0], Part::Video { source: VideoData::Path(_), .. }), "{url}");
        }
    }

    #[test]
    fn save_writes_what_load_takes_back() {
        let png = std::fs::read(golden_image("square.png")).unwrap();
        let gif = std::fs::read(golden_image("anim.gif")).unwrap();
        let history = vec![
            ChatMessage::new(
                "user",
                vec![
                    Part::Image { data: png.clone(), name: "x".into(), min_pixels: None, max_pixels: None },
                    Part::Video {
                        source: VideoData::Bytes(gif.clone()),
                        name: "y".into(),
                        options: Default::default(),
                    },
                    Part::Text("hi".into()),
                ],
            ),
            ChatMessage::text("assistant", "hello"),
        ];
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("conv.json");
        save(&file, &history).unwrap();
        // Only the file: no temporary one left beside it.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        let back = load(&file, &ImageLimits::default(), &HashSet::new()).unwrap();
        assert_eq!(back.len(), 2);
        assert!(matches!(&back[0].parts[0], Part::Image { data, .. } if *data == png));
        assert!(matches!(&back[0].parts[1], Part::Video { source: VideoData::Bytes(b), .. } if *b == gif));
        // Into a missing directory: one line, no temporary file's name in it.
        let e = format!("{:#}", save(&dir.path().join("none/conv.json"), &history).unwrap_err());
        assert!(e.starts_with("cannot create a file in") && !e.contains(".vl-chat-") && !e.contains('\n'), "{e}");
    }
}
