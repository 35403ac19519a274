//! Replicas behind a router: three `vl serve` replicas of tiny-a behind each of two routers
//! (pinned in tools/py-clients), all on loopback: vLLM's production-stack router (`vllm-router`)
//! with its consistent-hash policy on a conversation key (the `X-Session-ID` header), and
//! SGLang's (`sglang-router`) with its cache-aware policy (a prefix tree of the requests' text:
//! no key from the client). Twelve conversations of five
//! turns are asked together, a turn at a time; during the third turn one replica is killed. Every
//! request is answered (the router retries the killed replica's on the others), every later turn
//! of a conversation whose replica lives is served from its prefix (its cached tokens cover the
//! previous turn's prompt), every conversation is again from its fifth turn (the router rebuilds
//! its ring at the fourth), every answer equals a single server's, and an answer streamed
//! through the router (SSE) equals the whole one.

mod common;

use std::io::Read;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{start, Server};
use serde_json::{json, Value};

const CONVERSATIONS: usize = 12;
const TURNS: usize = 5;
/// The turn during which a replica is killed.
const KILL_AT: usize = 2;

struct Router {
    child: Child,
    base: String,
    log: tempfile::NamedTempFile,
}

impl Router {
    fn log(&self) -> String {
        let mut s = String::new();
        let _ = std::fs::File::open(self.log.path()).and_then(|mut f| f.read_to_string(&mut s));
        s.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A replica's requests in flight (`vl_requests_running` in its `/metrics`).
fn running(s: &Server) -> u64 {
    let Ok(resp) = agent().get(&format!("{}/metrics", s.base)).call() else { return 0 };
    let text = resp.into_string().unwrap_or_default();
    text.lines().find_map(|l| l.strip_prefix("vl_requests_running ")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(Duration::from_secs(120)).build()
}

/// A router and the policy it runs.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// vllm-router, `consistent_hash` on the `X-Session-ID` header.
    Vllm,
    /// sglang-router, `cache_aware`.
    Sglang,
}

/// The router in front of `workers`, once it answers `/workers` with all of them healthy.
fn router(kind: Kind, workers: &[&Server]) -> Router {
    let port = free_port();
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = Command::new(common::py_clients_python());
    let (module, policy, quiet) = match kind {
        Kind::Vllm => ("vllm_router.launch_router", "consistent_hash", "warning"),
        Kind::Sglang => ("sglang_router.launch_router", "cache_aware", "warn"),
    };
    cmd.args(["-m", module, "--worker-urls"]);
    cmd.args(workers.iter().map(|w| w.base.as_str()));
    cmd.args(["--policy", policy, "--host", "127.0.0.1"]);
    cmd.args(["--port", &port.to_string(), "--prometheus-host", "127.0.0.1"]);
    cmd.args(["--prometheus-port", &free_port().to_string()]);
    // A dead replica is found within a second or two, and a request it held is retried for
    // longer than that (0.2 s, then doubling: 6 s over 5 retries); with the defaults (checks a
    // minute apart, 0.66 s of retries) the retries all go to the dead replica.
    cmd.args(["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]);
    cmd.args(["--retry-max-retries", "5", "--retry-initial-backoff-ms", "200", "--retry-backoff-multiplier", "2"]);
    cmd.args(["--log-level", quiet]);
    let child = cmd
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("HTTP_PROXY", "http://127.0.0.1:9")
        .env("HTTPS_PROXY", "http://127.0.0.1:9")
        .stdin(Stdio::null())
        .stdout(log.reopen().unwrap())
        .stderr(log.reopen().unwrap())
        .spawn()
        .expect("start vllm-router (tools/py-clients)");
    let r = Router { child, base: format!("http://127.0.0.1:{port}"), log };
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        assert!(Instant::now() < deadline, "the router did not come up\n{}", r.log());
        if healthy_workers(&r).len() == workers.len() {
            return r;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The workers the router counts healthy (empty while it is not answering).
fn healthy_workers(r: &Router) -> Vec<String> {
    let Ok(resp) = agent().get(&format!("{}/workers", r.base)).call() else { return vec![] };
    let v: Value = serde_json::from_str(&resp.into_string().unwrap()).unwrap();
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["is_healthy"] == true)
        .map(|w| w["url"].as_str().unwrap().trim_end_matches('/').to_string())
        .collect()
}

/// A conversation's next user message: the first carries a note of its own (60 words, picked
/// by a generator seeded with the conversation's number), as a conversation about a document
/// does; no two conversations share a prefix past the template's first tokens.
fn user_turn(c: usize, t: usize) -> String {
    const WORDS: [&str; 12] = [
        "river", "stone", "maple", "quartz", "harbor", "glacier", "ember", "violet", "tundra", "saffron", "cloud",
        "anchor",
    ];
    if t > 0 {
        return format!("Turn {t}: tell me more about {}.", WORDS[(c + t) % WORDS.len()]);
    }
    let mut x = c as u64 * 0x9E37_79B9_7F4A_7C15 + 1;
    let note: Vec<&str> = (0..60)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            WORDS[(x >> 33) as usize % WORDS.len()]
        })
        .collect();
    format!("Conversation {c}. A note: {}. What is it about?", note.join(" "))
}

/// One turn: (the answer's text, prompt tokens, cached prompt tokens), or what went wrong.
fn ask(base: &str, c: usize, history: &[Value]) -> Result<(String, u64, u64), String> {
    let body = json!({"model": "tiny-a", "messages": history, "max_tokens": 24});
    let resp = agent()
        .post(&format!("{base}/v1/chat/completions"))
        .set("Content-Type", "application/json")
        .set("X-Session-ID", &format!("conversation-{c}"))
        .send_string(&body.to_string())
        .map_err(|e| format!("conversation {c}, turn {}: {e}", history.len() / 2))?;
    let v: Value = serde_json::from_str(&resp.into_string().unwrap()).unwrap();
    let usage = &v["usage"];
    Ok((
        v["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
    ))
}

/// Every conversation's turns through `base`, a turn of all conversations at a time (asked
/// together); `during(t)` runs while turn t's requests are in flight. Per conversation, per turn:
/// (answer, prompt tokens, cached tokens).
fn converse(base: &str, during: &mut dyn FnMut(usize), context: &dyn Fn() -> String) -> Vec<Vec<(String, u64, u64)>> {
    let mut histories: Vec<Vec<Value>> = vec![vec![]; CONVERSATIONS];
    let mut out = vec![Vec::new(); CONVERSATIONS];
    for t in 0..TURNS {
        for (c, h) in histories.iter_mut().enumerate() {
            h.push(json!({"role": "user", "content": user_turn(c, t)}));
        }
        let answers = std::thread::scope(|s| {
            let asks: Vec<_> = histories.iter().enumerate().map(|(c, h)| s.spawn(move || ask(base, c, h))).collect();
            during(t);
            asks.into_iter().map(|a| a.join().unwrap()).collect::<Vec<_>>()
        });
        let answers: Vec<_> =
            answers.into_iter().collect::<Result<_, _>>().unwrap_or_else(|e| panic!("{e}\n{}", context()));
        for (c, a) in answers.into_iter().enumerate() {
            histories[c].push(json!({"role": "assistant", "content": a.0}));
            out[c].push(a);
        }
    }
    out
}

#[test]
fn three_replicas_behind_vllm_router_keep_conversations_on_their_prefix_and_survive_a_kill() {
    replicas_behind(Kind::Vllm);
}

#[test]
fn three_replicas_behind_sglang_router_keep_conversations_on_their_prefix_and_survive_a_kill() {
    replicas_behind(Kind::Sglang);
}

fn replicas_behind(kind: Kind) {
    let args = ["--parallel", "2"];
    let mut replicas = [start("tiny-a", &args), start("tiny-a", &args), start("tiny-a", &args)];
    let r = router(kind, &replicas.iter().collect::<Vec<_>>());
    let mut killed = String::new();
    let mut kill = |t: usize| {
        if t != KILL_AT {
            return;
        }
        // Mid-turn: the first replica seen answering a request of this turn is killed.
        let deadline = Instant::now() + Duration::from_secs(60);
        let i = loop {
            assert!(Instant::now() < deadline, "no replica was seen answering");
            if let Some(i) = replicas.iter().position(|s| running(s) > 0) {
                break i;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        let _ = replicas[i].child.kill();
        let _ = replicas[i].child.wait();
        killed = replicas[i].base.clone();
        // The router marks it down within seconds (its health checks).
        let deadline = Instant::now() + Duration::from_secs(60);
        while healthy_workers(&r).contains(&killed) {
            assert!(Instant::now() < deadline, "the router never marked {killed} down\n{}", r.log());
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let routed = converse(&r.base, &mut kill, &|| r.log());
    assert_eq!(healthy_workers(&r).len(), 2, "{}", r.log());

    // An answer streamed through the router (SSE) is the same answer, piece by piece.
    let body = json!({"model": "tiny-a", "messages": [{"role": "user", "content": user_turn(0, 0)}],
        "max_tokens": 24, "stream": true});
    let sse = agent()
        .post(&format!("{}/v1/chat/completions", r.base))
        .set("Content-Type", "application/json")
        .set("X-Session-ID", "conversation-0")
        .send_string(&body.to_string())
        .unwrap()
        .into_string()
        .unwrap();
    let mut streamed = String::new();
    for line in sse.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|l| *l != "[DONE]") {
        let v: Value = serde_json::from_str(line).unwrap();
        streamed.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    assert!(sse.trim_end().ends_with("data: [DONE]"), "{kind:?}: {sse}");
    assert_eq!(streamed, routed[0][0].0, "{kind:?}: the streamed answer differs from the whole one");

    // A single server's answers to the same conversations.
    let single = start("tiny-a", &[]);
    let alone = converse(&single.base, &mut |_| {}, &String::new);
    for c in 0..CONVERSATIONS {
        let a: Vec<&str> = routed[c].iter().map(|x| x.0.as_str()).collect();
        let b: Vec<&str> = alone[c].iter().map(|x| x.0.as_str()).collect();
        assert_eq!(a, b, "conversation {c}: the routed answers differ from a single server's");
    }

    // Turns after the first reuse the previous turn's prompt (all of it but its last position)
    // on the replica that served it. Every conversation does at turn 1, and at the kill's turn
    // all but those the killed replica held (at least one of the twelve). At the next turn the
    // router has rebuilt its hash ring from the live replicas, which moves some conversations
    // of live replicas too (and a retried request went wherever the retry went): no claim there.
    // From the turn after, every conversation is served from its prefix again.
    let mut moved = vec![];
    for (c, turns) in routed.iter().enumerate() {
        for t in 1..TURNS {
            let (prev_prompt, cached) = (turns[t - 1].1, turns[t].2);
            let hit = cached + 1 >= prev_prompt;
            if t == KILL_AT && !hit {
                moved.push(c);
                continue;
            }
            if t == KILL_AT + 1 {
                continue;
            }
            assert!(
                hit,
                "{kind:?}: conversation {c}, turn {t}: {cached} cached tokens, the previous prompt had {prev_prompt}"
            );
        }
    }
    let moved = moved.len();
    assert!(moved >= 1, "no conversation was on the killed replica: the kill was not tested");
    assert!(moved < CONVERSATIONS, "every conversation moved");
}

/// POSTs `body` to the chat endpoint: (status, JSON answer).
fn chat(s: &Server, body: Value) -> (u16, Value) {
    let r = agent().post(&format!("{}/v1/chat/completions", s.base)).send_string(&body.to_string());
    let resp = match r {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{e}"),
    };
    (resp.status(), serde_json::from_str(&resp.into_string().unwrap()).unwrap())
}

/// The decoding switches vLLM's and SGLang's routers write into every request they forward
/// (vllm-router 0.1.17's and sglang-router 0.3.2's bodies, as a worker receives them): the
/// defaults are accepted, `ignore_eos` and keeping the stop string are honoured, and the other
/// switches' other values are refused by name.
#[test]
fn the_fields_routers_forward_are_honoured_or_refused() {
    let s = start("tiny-a", &[]);
    let messages = json!([{"role": "user", "content": "Say something"}]);
    let plain = chat(&s, json!({"messages": messages, "max_tokens": 16}));
    assert_eq!(plain.0, 200, "{}", plain.1);
    let text = plain.1["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    // As vllm-router forwards a request.
    let forwarded = json!({
        "model": "m", "messages": messages, "stream": false, "max_tokens": 16, "logprobs": false,
        "no_stop_trim": false, "ignore_eos": false, "continue_final_message": false,
        "skip_special_tokens": true, "separate_reasoning": true, "stream_reasoning": true,
        "return_hidden_states": false, "include_reasoning": true, "prompt_cache_key": "k1",
        "spaces_between_special_tokens": false, "add_generation_prompt": true,
        "include_stop_str_in_output": false
    });
    let (status, v) = chat(&s, forwarded);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], text.as_str());

    // A stop string from inside the answer: cut before it, or kept with either name.
    let at = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[at..].chars().take(3).collect();
    let before = &text[..text.find(&stop).unwrap()];
    for (field, kept) in [(None, false), (Some("include_stop_str_in_output"), true), (Some("no_stop_trim"), true)] {
        let mut body = json!({"messages": messages, "max_tokens": 16, "stop": [stop]});
        if let Some(f) = field {
            body[f] = json!(true);
        }
        let (status, v) = chat(&s, body);
        assert_eq!(status, 200, "{v}");
        let want = if kept { format!("{before}{stop}") } else { before.to_string() };
        assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "{field:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }

    // The end-of-sequence token made certain (logit_bias): the answer ends at its first token
    // (counted), unless
    // `ignore_eos`, which runs it to max_tokens.
    let eos = json!({"151645": 100});
    let (status, v) = chat(&s, json!({"messages": messages, "max_tokens": 8, "logit_bias": eos}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["usage"]["completion_tokens"].as_u64(), v["choices"][0]["finish_reason"].as_str()),
        (Some(1), Some("stop"))
    );
    let (status, v) = chat(&s, json!({"messages": messages, "max_tokens": 8, "logit_bias": eos, "ignore_eos": true}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["usage"]["completion_tokens"].as_u64(), v["choices"][0]["finish_reason"].as_str()),
        (Some(8), Some("length"))
    );

    for (field, value) in [
        ("skip_special_tokens", false),
        ("continue_final_message", true),
        ("add_generation_prompt", false),
        ("separate_reasoning", false),
        ("stream_reasoning", false),
        ("include_reasoning", false),
        ("return_hidden_states", true),
    ] {
        let (status, v) = chat(&s, json!({"messages": messages, "max_tokens": 4, field: value}));
        assert_eq!(status, 400, "{field}: {v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.starts_with(&format!("`{field}` = {value} is not supported")), "{m}");
    }
}

/// deploy/kubernetes/vl.yaml passes the Kubernetes API's schemas strictly (kubernetes-validate,
/// pinned in tools/py-clients), a copy with a misspelled field does not, and every flag the
/// manifest gives `vl serve` and vllm-router is one they take.
#[test]
fn the_kubernetes_manifests_pass_the_api_schemas_and_name_real_flags() {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes/vl.yaml");
    let python = common::py_clients_python();
    let validate = |path: &std::path::Path| {
        Command::new(python.with_file_name("kubernetes-validate"))
            .args(["--strict", "--quiet"])
            .arg(path)
            .output()
            .expect("run kubernetes-validate (tools/py-clients)")
    };
    let out = validate(&manifest);
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&manifest).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let broken = dir.path().join("broken.yaml");
    std::fs::write(&broken, text.replacen("readinessProbe:", "readinesProbe:", 1)).unwrap();
    let out = validate(&broken);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("'readinesProbe' was unexpected"));

    // The containers' command lines as the manifest gives them (the router's from its module on).
    let script = "import json, sys, yaml\n\
        for d in yaml.safe_load_all(open(sys.argv[1])):\n\
        \x20   if d['kind'] == 'Deployment':\n\
        \x20       c = d['spec']['template']['spec']['containers'][0]\n\
        \x20       words = c.get('args', []) + ' '.join(c.get('command', [])).split()\n\
        \x20       if 'vllm_router.launch_router' in words:\n\
        \x20           words = words[words.index('vllm_router.launch_router'):]\n\
        \x20       print(json.dumps({'name': c['name'], 'words': words}))\n";
    let out = Command::new(&python).args(["-c", script]).arg(&manifest).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let help = |cmd: &mut Command| String::from_utf8(cmd.output().unwrap().stdout).unwrap();
    let vl_help = help(Command::new(env!("CARGO_BIN_EXE_vl")).args(["serve", "--help"]));
    let router_help = help(Command::new(&python).args(["-m", "vllm_router.launch_router", "--help"]));
    let mut checked = 0;
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        let c: Value = serde_json::from_str(line).unwrap();
        let help = if c["name"] == "vl" { &vl_help } else { &router_help };
        for w in c["words"].as_array().unwrap().iter().filter_map(Value::as_str).filter(|w| w.starts_with("--")) {
            assert!(
                help.contains(&format!("{w} ")) || help.contains(&format!("{w}\n")),
                "{}: {w} is not a flag",
                c["name"]
            );
            checked += 1;
        }
    }
    assert!(checked >= 15, "{checked} flags checked");
}
