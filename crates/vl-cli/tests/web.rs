//! The web chat at `/`: the assets over HTTP (headers, the API key, `--no-ui`), then the page
//! in a real browser (Debian's headless Chromium through chromedriver, driven with fantoccini):
//! attach, ask, stream, a second turn, stop, new chat, markup in an answer shown as text,
//! grounding boxes drawn, no console errors, no request outside the server, a screenshot.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

fn get(url: &str, key: Option<&str>) -> (u16, String, Vec<(String, String)>) {
    let mut req = ureq::get(url).timeout(Duration::from_secs(30));
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    let resp = match req.call() {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{url}: {e}"),
    };
    let headers =
        resp.headers_names().into_iter().map(|h| (h.clone(), resp.header(&h).unwrap_or("").to_string())).collect();
    (resp.status(), resp.into_string().unwrap(), headers)
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> &'a str {
    h.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map_or("", |(_, v)| v.as_str())
}

#[test]
fn the_page_and_its_assets_are_served_without_the_key() {
    let s = common::start("tiny-a", &["--api-key", "sekret"]);
    let (status, body, h) = get(&format!("{}/", s.base), None);
    assert_eq!(status, 200);
    assert!(header(&h, "content-type").starts_with("text/html"), "{h:?}");
    let csp = header(&h, "content-security-policy");
    assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"), "{csp}");
    for id in ["attach", "prompt", "send", "stop", "new-chat", "empty-state", "empty-model", "example"] {
        assert!(body.contains(&format!("data-testid=\"{id}\"")), "the page lacks {id}");
    }
    // Every asset the page names is on this server.
    for asset in ["/ui/app.js", "/ui/app.css"] {
        assert!(body.contains(asset));
        let (status, text, h) = get(&format!("{}{asset}", s.base), None);
        assert_eq!(status, 200, "{asset}");
        assert!(!text.is_empty());
        assert_eq!(header(&h, "x-content-type-options"), "nosniff");
    }
    assert!(!body.contains("http://") && !body.contains("https://"), "the page names no outside address");
    // The API still needs the key.
    assert_eq!(get(&format!("{}/v1/models", s.base), None).0, 401);
    assert_eq!(get(&format!("{}/v1/models", s.base), Some("sekret")).0, 200);
    drop(s);
    let s = common::start("tiny-a", &["--no-ui"]);
    let (status, body, _) = get(&format!("{}/", s.base), None);
    assert_eq!(status, 404, "{body}");
}

/// chromedriver on a free loopback port, killed on drop.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn chromedriver() -> Driver {
    let bin = ["chromedriver", "/usr/bin/chromedriver"]
        .into_iter()
        .find(|b| Command::new(b).arg("--version").output().is_ok_and(|o| o.status.success()))
        .expect("chromedriver not found: install Debian's chromium and chromium-driver (.ci/run does)");
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new(bin)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromedriver");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "chromedriver did not listen in time");
        std::thread::sleep(Duration::from_millis(100));
    }
    Driver { child, url: format!("http://127.0.0.1:{port}") }
}

/// ChromeDriver's browser log (`se/log`, Chromium's extension under W3C): console messages and
/// failed loads.
#[derive(Debug)]
struct BrowserLog;

impl fantoccini::wd::WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(&self, base: &url::Url, session: Option<&str>) -> Result<url::Url, url::ParseError> {
        base.join(&format!("session/{}/se/log", session.unwrap_or_default()))
    }

    fn method_and_body(&self, _: &url::Url) -> (http::Method, Option<String>) {
        (http::Method::POST, Some(r#"{"type": "browser"}"#.into()))
    }
}

async fn js(c: &Client, script: &str) -> Value {
    c.execute(script, vec![]).await.unwrap_or_else(|e| panic!("{script}: {e}"))
}

/// Polls `script` until it returns something truthy, at most `secs` seconds.
async fn wait_for(c: &Client, script: &str, secs: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let v = js(c, script).await;
        if !(v.is_null() || v == json!(false) || v == json!(0) || v == json!("")) {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {script}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn click(c: &Client, testid: &str) {
    c.find(Locator::Css(&format!("[data-testid={testid}]"))).await.unwrap().click().await.unwrap();
}

async fn ask(c: &Client, text: &str) {
    let p = c.find(Locator::Css("[data-testid=prompt]")).await.unwrap();
    p.send_keys(text).await.unwrap();
    click(c, "send").await;
}

async fn attach(c: &Client, file: &Path) {
    let before = js(c, "return document.querySelectorAll('[data-testid=pending]').length").await;
    let input = c.find(Locator::Css("[data-testid=attach]")).await.unwrap();
    let file = std::fs::canonicalize(file).unwrap();
    input.send_keys(file.to_str().unwrap()).await.unwrap();
    let want = before.as_u64().unwrap() + 1;
    wait_for(c, &format!("return document.querySelectorAll('[data-testid=pending]').length == {want}"), 10).await;
}

const ANSWERS: &str = "document.querySelectorAll('[data-testid=answer]')";

/// Waits for answer `i` to finish; returns its text and the reason it ended.
async fn answer(c: &Client, i: usize, secs: u64) -> (String, String) {
    wait_for(c, &format!("const a = {ANSWERS}[{i}]; return a && a.dataset.done === '1'"), secs).await;
    let v = js(c, &format!("const a = {ANSWERS}[{i}]; return [a.querySelector('.body').textContent, a.dataset.finish, a.querySelector('[data-testid=stats]').textContent]")).await;
    assert_ne!(
        v[1],
        "error",
        "answer {i} failed: {v}; page error: {}",
        js(c, "return document.getElementById('error').textContent").await
    );
    (v[0].as_str().unwrap().to_string(), v[1].as_str().unwrap().to_string())
}

async fn set(c: &Client, id: &str, value: &str) {
    let script = format!(
        "const e = document.getElementById({}); e.value = {}; e.dispatchEvent(new Event('change')); return e.value",
        json!(id),
        json!(value)
    );
    assert_eq!(js(c, &script).await, json!(value));
}

fn screenshot_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("web");
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn the_page_in_a_browser() {
    let server = common::start("tiny-a", &["--api-key", "sekret"]);
    // tiny-a with the Qwen3-VL Thinking template (goldens/thinking): its answers are reasoning.
    let thinking_dir = common::tiny_a_with_template(&common::thinking_template());
    let thinking = common::start_dir(thinking_dir.path(), &[]);
    let driver = chromedriver();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(300), drive(&server.base, &thinking.base, &driver.url))
            .await
            .expect("the browser test finished within 300 s");
    });
}

async fn drive(base: &str, thinking: &str, driver: &str) {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({"args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1100,1000", "--no-first-run", "--disable-extensions",
                         "--disable-background-networking", "--disable-component-update"]}),
    );
    caps.insert("goog:loggingPrefs".into(), json!({"browser": "ALL"}));
    let c = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(driver)
        .await
        .expect("a Chromium session (Debian's chromium)");
    c.goto(&format!("{base}/")).await.unwrap();
    wait_for(&c, "return document.body.dataset.ready === '1'", 20).await;

    // The server has a key: the page asks for it, then lists the model.
    wait_for(&c, "return !document.getElementById('key-needed').hidden", 20).await;
    c.find(Locator::Css("[data-testid=key-input]")).await.unwrap().send_keys("sekret").await.unwrap();
    click(&c, "key-save").await;
    wait_for(
        &c,
        "return document.getElementById('key-needed').hidden && document.getElementById('model').textContent",
        20,
    )
    .await;

    // The empty state: the served model's id and context, what can be attached, examples that
    // fill the prompt when clicked.
    let (_, models, _) = get(&format!("{base}/v1/models"), Some("sekret"));
    let models: Value = serde_json::from_str(&models).unwrap();
    let (id, context) =
        (models["data"][0]["id"].as_str().unwrap(), models["data"][0]["context_length"].as_u64().unwrap());
    let shown = wait_for(
        &c,
        &format!("const m = document.querySelector('[data-testid=empty-model]').textContent; return m === {} && [!document.querySelector('[data-testid=empty-state]').hidden, document.querySelector('[data-testid=empty-context]').textContent, document.querySelector('[data-testid=empty-attach]').textContent]", json!(id)),
        20,
    )
    .await;
    assert_eq!(shown[0], json!(true), "the empty state is shown");
    let ctx = shown[1].as_str().unwrap().replace(',', "");
    assert!(ctx.contains(&format!("{context} tokens")), "{ctx}");
    let attach_text = shown[2].as_str().unwrap();
    assert!(["PNG", "JPEG", "WebP", "MP4", "video"].iter().all(|t| attach_text.contains(t)), "{attach_text}");
    let examples =
        js(&c, "return [...document.querySelectorAll('[data-testid=example]')].map(e => e.textContent)").await;
    let examples: Vec<String> = serde_json::from_value(examples).unwrap();
    assert!(examples.len() >= 2, "{examples:?}");
    for (i, want) in examples.iter().enumerate() {
        js(&c, &format!("document.querySelectorAll('[data-testid=example]')[{i}].click(); return 1")).await;
        let v = js(&c, "const p = document.querySelector('[data-testid=prompt]'); return [p.value, document.activeElement === p, p.value.slice(p.selectionStart, p.selectionEnd)]").await;
        assert_eq!((v[0].as_str().unwrap(), &v[1]), (want.as_str(), &json!(true)), "example {i}");
        if want.contains("<thing>") {
            assert_eq!(v[2], "<thing>", "the placeholder is selected, to type over");
        }
    }
    std::fs::write(screenshot_dir().join("web-empty.png"), c.screenshot().await.unwrap()).unwrap();
    // A real click (through the driver) on the first example fills the prompt too.
    c.find(Locator::Css("[data-testid=example]")).await.unwrap().click().await.unwrap();
    assert_eq!(js(&c, "return document.querySelector('[data-testid=prompt]').value").await, json!(examples[0]));
    set(&c, "prompt", "").await;

    // Attach an image, ask: the answer streams in (its text grows over several renders).
    set(&c, "max-tokens", "200").await;
    set(&c, "temperature", "0.8").await;
    js(&c, "window.__lens = []; new MutationObserver(() => { const a = document.querySelector('[data-testid=answer] .body'); if (a) window.__lens.push(a.textContent.length); }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); return 1").await;
    attach(&c, &common::goldens().join("images/square.png")).await;
    ask(&c, "Describe this image.").await;
    let (first, _) = answer(&c, 0, 120).await;
    assert!(!first.is_empty(), "an answer");
    let lens = js(&c, "return [...new Set(window.__lens)].filter(n => n > 0).length").await;
    assert!(lens.as_u64().unwrap() >= 3, "the answer streamed in: {lens} distinct lengths seen");
    assert_eq!(js(&c, "return document.querySelectorAll('.msg.user img').length").await, json!(1));
    assert_eq!(js(&c, "return document.querySelector('[data-testid=empty-state]').hidden").await, json!(true));

    // A second turn reuses the first's prompt from the server's cache.
    ask(&c, "And the colours?").await;
    let (second, _) = answer(&c, 1, 120).await;
    assert!(!second.is_empty());
    let stats = js(&c, &format!("return {ANSWERS}[1].querySelector('[data-testid=stats]').textContent")).await;
    let stats = stats.as_str().unwrap();
    let cached: u64 = stats.split(" cached").next().unwrap().rsplit('(').next().unwrap().parse().unwrap();
    assert!(cached > 0, "the second turn's prompt came partly from the cache: {stats}");

    // Stop mid-answer: the answer ends as stopped, shorter than it would have been, and the
    // page takes a new question.
    set(&c, "max-tokens", "1800").await;
    ask(&c, "Tell me a long story.").await;
    wait_for(&c, &format!("const a = {ANSWERS}[2]; return a && a.querySelector('.body').textContent.length > 0"), 60)
        .await;
    click(&c, "stop").await;
    let (_, finish) = answer(&c, 2, 30).await;
    assert_eq!(finish, "stopped");
    let (send_disabled, stop_disabled) = {
        let v = js(&c, "return [document.querySelector('[data-testid=send]').disabled, document.querySelector('[data-testid=stop]').disabled]").await;
        (v[0].clone(), v[1].clone())
    };
    assert_eq!((send_disabled, stop_disabled), (json!(false), json!(true)));

    // New chat: the conversation is gone.
    click(&c, "new-chat").await;
    assert_eq!(js(&c, &format!("return {ANSWERS}.length")).await, json!(0));
    let v = js(&c, "const e = document.querySelector('[data-testid=empty-state]'); return [e.hidden, e.querySelector('[data-testid=empty-model]').textContent]").await;
    assert_eq!(v, json!([false, id]), "the empty state is back");

    // Markup in an answer is text: an answer constrained to a fixed string of HTML.
    let payload = "<img src=x onerror='window.__pwned=1'><script>window.__pwned=2</script><b>bold</b>";
    set(&c, "format", "schema").await;
    set(&c, "schema", &json!({"const": payload}).to_string()).await;
    set(&c, "max-tokens", "200").await;
    ask(&c, "Say it.").await;
    let (text, _) = answer(&c, 0, 120).await;
    assert_eq!(text, json!(payload).to_string(), "the answer is the string, shown as text");
    let v = js(&c, &format!("const b = {ANSWERS}[0].querySelector('.body'); return [b.querySelectorAll('img, script, b').length, window.__pwned === undefined]")).await;
    assert_eq!(v, json!([0, true]), "no element came from the answer; nothing ran");

    // A regular-expression answer format and the sampler settings go with the request (the
    // page's bodies recorded); the answer is in the regex's language.
    click(&c, "new-chat").await;
    js(&c, "window.__bodies = []; const f = window.fetch; window.fetch = (u, o) => { if (o && o.body) window.__bodies.push(JSON.parse(o.body)); return f(u, o); }; return 1").await;
    set(&c, "format", "regex").await;
    set(&c, "rule", "(yes|no), [a-z]{2,6}").await;
    set(&c, "dry-multiplier", "0.8").await;
    set(&c, "top-k", "5").await;
    ask(&c, "Well?").await;
    let (text, _) = answer(&c, 0, 120).await;
    assert!(regex::Regex::new("^(yes|no), [a-z]{2,6}$").unwrap().is_match(&text), "{text:?}");
    let sent = js(&c, "const b = window.__bodies[window.__bodies.length - 1]; return [b.response_format, b.dry_multiplier, b.top_k, b.top_p === undefined]").await;
    assert_eq!(sent, json!([{"type": "regex", "regex": "(yes|no), [a-z]{2,6}"}, 0.8, 5, true]));
    set(&c, "dry-multiplier", "").await;
    set(&c, "top-k", "").await;

    // Grounding: an answer constrained to boxes; the page draws one box per answer box, where
    // 0..1000 of the image puts it.
    click(&c, "new-chat").await;
    set(&c, "format", "grounding").await;
    set(&c, "max-tokens", "400").await;
    attach(&c, &common::goldens().join("images/large.png")).await;
    ask(&c, "Find the objects.").await;
    let (text, _) = answer(&c, 0, 180).await;
    let boxes: Vec<Value> = serde_json::from_str(&text).expect("a JSON list of boxes");
    assert!(!boxes.is_empty());
    let drawn = js(&c, "return [...document.querySelectorAll('[data-testid=box]')].map(b => [parseFloat(b.style.left), parseFloat(b.style.top), parseFloat(b.style.width), parseFloat(b.style.height)])").await;
    let drawn = drawn.as_array().unwrap();
    assert_eq!(drawn.len(), boxes.len(), "one drawn box per answer box: {text}");
    for (d, b) in drawn.iter().zip(&boxes) {
        let q: Vec<f64> = b["bbox_2d"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        let (x1, y1, x2, y2) = (q[0].min(q[2]), q[1].min(q[3]), q[0].max(q[2]), q[1].max(q[3]));
        // Percent of the image: coordinate / 10 (pixels rounded to 0.1 of 640 x 480).
        let want = [x1 / 10.0, y1 / 10.0, (x2 - x1) / 10.0, (y2 - y1) / 10.0];
        for (got, want) in d.as_array().unwrap().iter().zip(want) {
            assert!((got.as_f64().unwrap() - want).abs() < 0.05, "drawn {d} for {b}");
        }
    }
    let png = c.screenshot().await.unwrap();
    let shot = screenshot_dir().join("web-chat.png");
    std::fs::write(&shot, &png).unwrap();
    eprintln!("screenshot: {}", shot.display());

    // No errors on the page, and every request went to this server.
    let errors = js(&c, "return window.__vl.errors").await;
    assert_eq!(errors, json!([]), "page errors");
    let log = c.issue_cmd(BrowserLog).await.unwrap();
    let severe: Vec<&Value> = log
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["level"] == "SEVERE")
        // The one refusal the page provokes on purpose: /v1/models before the key was given.
        .filter(|e| {
            !(e["message"].as_str().unwrap_or("").contains("/v1/models")
                && e["message"].as_str().unwrap_or("").contains("401"))
        })
        .collect();
    assert!(severe.is_empty(), "browser errors: {severe:?}");
    let outside = js(&c, "return [...performance.getEntriesByType('resource').map(e => e.name), location.href].filter(u => !u.startsWith(location.origin + '/'))").await;
    assert_eq!(outside, json!([]), "requests outside the server");

    // A thinking checkpoint: the reasoning shows folded above the answer (the reference's greedy
    // answer under the template is all reasoning), and the next turn sends it back.
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(common::goldens().join("thinking/thinking.json")).unwrap())
            .unwrap();
    let g = &g["greedy"];
    c.goto(&format!("{thinking}/")).await.unwrap();
    wait_for(&c, "return document.body.dataset.ready === '1'", 20).await;
    set(&c, "max-tokens", &g["ids"].as_array().unwrap().len().to_string()).await;
    set(&c, "temperature", "0").await;
    ask(&c, g["question"].as_str().unwrap()).await;
    let (text, _) = answer(&c, 0, 60).await;
    assert_eq!(text, g["content"].as_str().unwrap());
    let shown = js(&c, &format!("const a = {ANSWERS}[0]; return [a.querySelector('[data-testid=reasoning]').textContent, a.querySelector('.thinking').hidden]")).await;
    assert_eq!(shown, json!([g["reasoning"], false]));
    ask(&c, "And then?").await;
    answer(&c, 1, 60).await;
    c.close().await.unwrap();
}
