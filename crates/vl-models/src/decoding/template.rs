//! Chat templates, family-agnostic: a checkpoint's Jinja template found where transformers
//! looks for it (chat_template.jinja, chat_template.json, tokenizer_config.json) and rendered with
//! minijinja as transformers renders it (trim_blocks, lstrip_blocks, Python string methods,
//! Python's `json.dumps` as `tojson`, `raise_exception`), with messages, tools and the
//! generation prompt.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::limits::{read_text, MAX_METADATA_FILE_BYTES};

thread_local! {
    /// Templates this thread has rendered (see `renders_in_this_thread`).
    static RENDERS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many chat templates this thread has rendered: a request's preparation runs in its
/// caller's thread, so a test reads what one request cost.
#[doc(hidden)]
pub fn renders_in_this_thread() -> usize {
    RENDERS.with(|n| n.get())
}

/// One part of a message.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Content {
    Text { text: String },
    Image { image: String },
    Video { video: String },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Message {
    pub role: String,
    /// Rendered as a string when every part is text (templates written for text models, e.g.
    /// the Qwen3 template some GGUF files carry, call string methods on it); as the list of
    /// parts otherwise. Templates that take both render the same text either way.
    #[serde(serialize_with = "content_value")]
    pub content: Vec<Content>,
    /// An assistant message's tool calls, as the OpenAI API and transformers' templates
    /// shape them: `{"type": "function", "function": {"name", "arguments"}}`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<TemplateToolCall>,
    /// An assistant turn's reasoning, as OpenAI-style clients send it back
    /// (`reasoning_content`); thinking templates decide whether it is shown again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// One function call of an assistant message. `arguments` is the JSON text the model wrote (a
/// string, as OpenAI clients send it back) or an object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TemplateToolCall {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: serde_json::Value,
}

fn content_value<S: serde::Serializer>(content: &[Content], s: S) -> std::result::Result<S::Ok, S::Error> {
    if content.iter().all(|c| matches!(c, Content::Text { .. })) {
        let text: String = content
            .iter()
            .map(|c| match c {
                Content::Text { text } => text.as_str(),
                _ => "",
            })
            .collect();
        s.serialize_str(&text)
    } else {
        content.serialize(s)
    }
}

impl TemplateToolCall {
    pub fn function(name: &str, arguments: serde_json::Value) -> Self {
        Self { kind: "function", function: FunctionCall { name: name.into(), arguments } }
    }
}

impl Message {
    pub fn new(role: &str, content: Vec<Content>) -> Self {
        Self { role: role.into(), content, tool_calls: vec![], reasoning_content: None }
    }
    pub fn text(role: &str, text: &str) -> Self {
        Self::new(role, vec![Content::Text { text: text.into() }])
    }
}

/// Where a template came from, for messages and `vl inspect`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateSource {
    File(PathBuf),
    BuiltIn,
}

/// Instructions one render may execute: a template is a program a checkpoint (or a GGUF file)
/// ships, and a loop that never ends must not hold the engine (50 M instructions: about 1.7 s on
/// a 2-vCPU EPYC). minijinja also refuses a `range` over 100,000 elements and a string repeated
/// past 100 MB.
pub const TEMPLATE_FUEL: u64 = 50_000_000;
/// Template variables a request sets itself: `chat_template_kwargs` may not.
pub const RESERVED_TEMPLATE_VARIABLES: [&str; 3] = ["messages", "tools", "add_generation_prompt"];

/// Bytes one render may write (a prompt far larger cannot fit any context).
pub const MAX_RENDER_BYTES: usize = 64 << 20;
/// Nesting depth of macro calls and includes.
const TEMPLATE_RECURSION: usize = 64;

/// A writer that refuses past `MAX_RENDER_BYTES`.
struct Bounded(Vec<u8>);

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_RENDER_BYTES {
            return Err(std::io::Error::other(format!("the rendered prompt is over {MAX_RENDER_BYTES} bytes")));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    pub source: TemplateSource,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// The checkpoint's template: chat_template.jinja, chat_template.json, then
    /// tokenizer_config.json's `chat_template`; the family's `builtin` template otherwise.
    pub fn from_dir(dir: &Path, builtin: &str) -> Result<Self> {
        let tc_path = dir.join("tokenizer_config.json");
        let tc: serde_json::Value = if tc_path.is_file() {
            let t = read_text(&tc_path, MAX_METADATA_FILE_BYTES)?;
            serde_json::from_str(&t).map_err(|source| Error::Json { path: tc_path.clone(), source })?
        } else {
            serde_json::Value::Null
        };
        let token = |k: &str| match &tc[k] {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
            _ => None,
        };
        let (src, source) = find_template(dir, &tc, &tc_path, builtin)?;
        Self::new(src, source, token("bos_token"), token("eos_token"))
    }

    pub fn new(
        src: String,
        source: TemplateSource,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(TEMPLATE_RECURSION);
        // transformers' `tojson`: Python's json.dumps (", " and ": " separators, non-ASCII kept,
        // key order kept), not minijinja's HTML-safe compact form.
        env.add_filter("tojson", crate::tool_calls::py_tojson);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        let name = match &source {
            TemplateSource::File(p) => p.display().to_string(),
            TemplateSource::BuiltIn => "built-in chat template".into(),
        };
        env.add_template_owned("chat", src)
            .map_err(|e| Error::Input { what: name.clone(), message: format!("invalid chat template: {e}") })?;
        Ok(Self { env, source, bos_token, eos_token })
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, None, add_generation_prompt)
    }

    /// The template's source text.
    pub fn source_text(&self) -> String {
        self.env.get_template("chat").expect("added in new").source().to_string()
    }

    /// Whether the template reads a `tools` variable (function definitions for tool calling).
    pub fn takes_tools(&self) -> bool {
        let tmpl = self.env.get_template("chat").expect("added in new");
        tmpl.undeclared_variables(false).contains("tools")
    }

    /// Renders with function definitions (`tools`, as the OpenAI API sends them); a template
    /// that has no `tools` variable refuses them.
    pub fn render_with(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_kw(messages, tools, &serde_json::Map::new(), add_generation_prompt)
    }

    /// `render_with` and extra variables for the template (`chat_template_kwargs`, e.g.
    /// `enable_thinking`): they may set `add_vision_id`, `bos_token` and `eos_token`; the names
    /// in `RESERVED_TEMPLATE_VARIABLES` are refused.
    pub fn render_kw(
        &self,
        messages: &[Message],
        tools: Option<&[serde_json::Value]>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        if let Some(k) = kwargs.keys().find(|k| RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str())) {
            return Err(Error::Input {
                what: "chat_template_kwargs".into(),
                message: format!("`{k}` is set by the request itself, not by template arguments"),
            });
        }
        if tools.is_some_and(|t| !t.is_empty()) && !self.takes_tools() {
            return Err(Error::Input {
                what: "tools".into(),
                message: "this checkpoint's chat template has no `tools` variable: it cannot offer functions".into(),
            });
        }
        let mut ctx = serde_json::json!({
            "add_vision_id": false,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        });
        let o = ctx.as_object_mut().expect("an object");
        o.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
        o.insert("tools".into(), serde_json::json!(tools.filter(|t| !t.is_empty())));
        o.insert(
            "messages".into(),
            serde_json::to_value(messages)
                .map_err(|e| Error::Input { what: "messages".into(), message: e.to_string() })?,
        );
        o.insert("add_generation_prompt".into(), add_generation_prompt.into());
        RENDERS.with(|n| n.set(n.get() + 1));
        match RENDERER.get() {
            Some(exe) => self.render_in_child(exe, ctx),
            None => self.render_here(&ctx),
        }
    }

    fn what(&self) -> String {
        match &self.source {
            TemplateSource::File(p) => format!("chat template {}", p.display()),
            TemplateSource::BuiltIn => "chat template".into(),
        }
    }

    /// Renders in this process (fuel, output and recursion bounds; no memory bound).
    fn render_here(&self, ctx: &serde_json::Value) -> Result<String> {
        let tmpl = self.env.get_template("chat").expect("added in new");
        let mut out = Bounded(Vec::new());
        let what = self.what();
        tmpl.render_captured_to(minijinja::Value::from_serialize(ctx), &mut out).map_err(|e| {
            let message = match e.kind() {
                minijinja::ErrorKind::OutOfFuel => format!(
                    "render stopped: the template ran past {TEMPLATE_FUEL} instructions (a loop that does not end?)"
                ),
                minijinja::ErrorKind::WriteFailure => {
                    format!("render stopped: the rendered prompt is over {MAX_RENDER_BYTES} bytes")
                }
                _ => format!("render failed: {e}"),
            };
            Error::Input { what: what.clone(), message }
        })?;
        String::from_utf8(out.0).map_err(|_| Error::Input { what, message: "rendered text is not UTF-8".into() })
    }

    /// Renders in a child process of `exe` (started as a renderer, see `renderer_main`) with
    /// its address space limited to `RENDER_MEMORY` and its wall time to `RENDER_TIME`: a
    /// template that doubles a string in a loop, or runs long, costs that child, not this
    /// process.
    fn render_in_child(&self, exe: &Path, ctx: serde_json::Value) -> Result<String> {
        use std::io::{Read, Write};
        use std::process::{Command, Stdio};
        let what = self.what();
        let fail = |message: String| Error::Input { what: what.clone(), message };
        let job = serde_json::json!({
            "source": self.source_text(),
            "file": match &self.source { TemplateSource::File(p) => Some(p.clone()), TemplateSource::BuiltIn => None },
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "context": ctx,
        });
        let job = serde_json::to_vec(&job).map_err(|e| fail(format!("cannot pass the render its input: {e}")))?;
        let mut child = Command::new(exe)
            .env(RENDER_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| fail(format!("cannot start the template renderer {}: {e}", exe.display())))?;
        let mut stdin = child.stdin.take().expect("piped");
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(&job);
        });
        let watchdog = crate::limits::Watchdog::start(&child, Some(RENDER_TIME));
        let mut out = Vec::new();
        let read = child.stdout.take().expect("piped").take(MAX_RENDER_BYTES as u64 + 4096).read_to_end(&mut out);
        let timed_out = watchdog.stop();
        let _ = child.kill();
        let status = child.wait().map_err(|e| fail(format!("the template renderer: {e}")))?;
        let _ = writer.join();
        if timed_out {
            return Err(fail(format!("render stopped: the template ran longer than {} s", RENDER_TIME.as_secs())));
        }
        read.map_err(|e| fail(format!("the template renderer: {e}")))?;
        let text = String::from_utf8(out).map_err(|_| fail("rendered text is not UTF-8".into()))?;
        match status.code() {
            Some(0) => Ok(text),
            Some(RENDER_FAILED) => Err(fail(text)),
            _ => Err(fail(format!(
                "render stopped: the template used more than {} MiB of memory, or its renderer crashed ({status})",
                RENDER_MEMORY >> 20
            ))),
        }
    }
}

/// The program chat templates render in, when set (`render_in_child_processes`).
static RENDERER: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
/// The environment variable that makes a binary a template renderer (`renderer_main`).
const RENDER_ENV: &str = "__VL_RENDER_TEMPLATE";
/// Address space a render's child process may use: templates build strings with no other
/// bound (a string doubled in a loop through `namespace()` reaches gigabytes in 32 steps).
pub const RENDER_MEMORY: u64 = 256 << 20;
/// Wall time a render's child process may take.
pub const RENDER_TIME: std::time::Duration = std::time::Duration::from_secs(10);
/// The renderer's exit code for a render error (its message on stdout).
const RENDER_FAILED: i32 = 3;

/// From now on every chat template renders in a child process of `exe`, bounded in memory and
/// time. `exe` must call `renderer_main` first thing (the `vl` binary does); a library user
/// that does not call this renders in its own process, bounded by fuel, output size and
/// recursion only.
pub fn render_in_child_processes(exe: PathBuf) {
    let _ = RENDERER.set(exe);
}

/// Call first thing in `main`: when this process was started as a template renderer, it reads
/// one render job on stdin, writes the text (or the error) on stdout and exits; otherwise it
/// returns at once.
pub fn renderer_main() {
    if std::env::var_os(RENDER_ENV).is_none() {
        return;
    }
    #[cfg(unix)]
    // SAFETY: setrlimit on this process, before any other thread exists.
    unsafe {
        let lim = libc::rlimit { rlim_cur: RENDER_MEMORY as libc::rlim_t, rlim_max: RENDER_MEMORY as libc::rlim_t };
        libc::setrlimit(libc::RLIMIT_AS, &lim);
    }
    let code = match render_job() {
        Ok(text) => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(text.as_bytes());
            let _ = out.flush();
            0
        }
        Err(e) => {
            let message = match e {
                Error::Input { message, .. } => message,
                other => other.to_string(),
            };
            print!("{message}");
            RENDER_FAILED
        }
    };
    std::process::exit(code);
}

fn render_job() -> Result<String> {
    use std::io::Read;
    let mut job = Vec::new();
    std::io::stdin()
        .take(1 << 30)
        .read_to_end(&mut job)
        .map_err(|e| Error::Input { what: "render job".into(), message: e.to_string() })?;
    let job: serde_json::Value = serde_json::from_slice(&job)
        .map_err(|e| Error::Input { what: "render job".into(), message: format!("unreadable: {e}") })?;
    let text = |k: &str| job[k].as_str().map(String::from);
    let source = match text("file") {
        Some(f) => TemplateSource::File(f.into()),
        None => TemplateSource::BuiltIn,
    };
    let template = ChatTemplate::new(text("source").unwrap_or_default(), source, text("bos_token"), text("eos_token"))?;
    template.render_here(&job["context"])
}

fn find_template(
    dir: &Path,
    tc: &serde_json::Value,
    tc_path: &Path,
    builtin: &str,
) -> Result<(String, TemplateSource)> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let s = read_text(&jinja, MAX_METADATA_FILE_BYTES)?;
        return Ok((s, TemplateSource::File(jinja)));
    }
    let json = dir.join("chat_template.json");
    if json.is_file() {
        let s = read_text(&json, MAX_METADATA_FILE_BYTES)?;
        let v: serde_json::Value =
            serde_json::from_str(&s).map_err(|source| Error::Json { path: json.clone(), source })?;
        let t = v["chat_template"].as_str().ok_or_else(|| Error::Config {
            path: json.clone(),
            field: "chat_template".into(),
            message: "missing or not a string".into(),
        })?;
        return Ok((t.to_string(), TemplateSource::File(json)));
    }
    match &tc["chat_template"] {
        serde_json::Value::String(s) => Ok((s.clone(), TemplateSource::File(tc_path.to_path_buf()))),
        // A list of named templates: take "default".
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(|s| (s.to_string(), TemplateSource::File(tc_path.to_path_buf())))
            .ok_or_else(|| Error::Config {
                path: tc_path.to_path_buf(),
                field: "chat_template".into(),
                message: "no template named \"default\"".into(),
            }),
        _ => Ok((builtin.to_string(), TemplateSource::BuiltIn)),
    }
}
