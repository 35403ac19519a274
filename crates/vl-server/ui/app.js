// vl's web chat: one page over the server's own OpenAI API (/v1/models, /v1/chat/completions).
// Model output is only ever put into the page as text nodes (textContent); nothing it says
// becomes markup. The page loads nothing from outside the server (the CSP says so too).
"use strict";

// What went wrong on the page, for the browser tests (and for anyone debugging): uncaught
// errors, rejected promises, console.error calls, CSP violations.
const vlDiag = { errors: [] };
window.__vl = vlDiag;
window.addEventListener("error", (e) => vlDiag.errors.push("error: " + (e.message || e.type)));
window.addEventListener("unhandledrejection", (e) => vlDiag.errors.push("rejection: " + String(e.reason)));
document.addEventListener("securitypolicyviolation", (e) => vlDiag.errors.push("csp: " + e.violatedDirective));
const consoleError = console.error.bind(console);
console.error = (...a) => { vlDiag.errors.push("console: " + a.join(" ")); consoleError(...a); };

const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
};
const COLOURS = ["#e6194b", "#3cb44b", "#0082c8", "#f58230", "#911eb4", "#46f0f0", "#f032e6", "#ffe119"];
// The sampler settings (input id, request field: llama-server's and OpenAI's names).
const SAMPLERS = [
  ["top-p", "top_p"], ["top-k", "top_k"], ["min-p", "min_p"], ["top-n-sigma", "top_n_sigma"], ["seed", "seed"],
  ["xtc-probability", "xtc_probability"], ["xtc-threshold", "xtc_threshold"],
  ["dry-multiplier", "dry_multiplier"], ["dry-base", "dry_base"], ["dry-allowed-length", "dry_allowed_length"],
];

// The grounding schema the "Boxes" format sends: a list of labelled boxes in 0..1000.
const GROUNDING_SCHEMA = {
  type: "array", minItems: 1, maxItems: 8,
  items: {
    type: "object", additionalProperties: false, required: ["bbox_2d", "label"],
    properties: {
      bbox_2d: { type: "array", minItems: 4, maxItems: 4, items: { type: "integer", minimum: 0, maximum: 1000 } },
      label: { type: "string", maxLength: 24 },
    },
  },
};
const GROUNDING_HINT = "Report the bounding boxes (bbox_2d, 0..1000) and labels as JSON.";
// What the server decodes: these image formats; videos of any type ffmpeg reads (sampled into
// frames on the server).
const IMAGE_TYPES = { "image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WebP", "image/gif": "GIF", "image/bmp": "BMP" };
const VIDEO_NOTE = "MP4, WebM, MKV, MOV and the rest of what ffmpeg reads";

let history = [];      // the conversation as OpenAI messages (user parts include data URLs)
let pending = [];      // attachments for the next message: {kind, url, name}
let controller = null; // the answer being streamed, when one is
let busy = false;

function key() { return localStorage.getItem("vl-api-key") || ""; }
function headers() {
  const h = { "Content-Type": "application/json" };
  if (key()) h["Authorization"] = "Bearer " + key();
  return h;
}
function showError(msg) {
  const e = $("error");
  e.textContent = msg || "";
  e.hidden = !msg;
}

// --- Safe rendering -------------------------------------------------------------------------
// A small markdown subset (fenced code, headings, lists, paragraphs, `code`, **bold**, *em*)
// built as DOM nodes from text; links stay text.
function inline(parent, text) {
  const re = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\n]+\*)/g;
  let at = 0, m;
  while ((m = re.exec(text)) !== null) {
    if (m.index > at) parent.appendChild(document.createTextNode(text.slice(at, m.index)));
    const t = m[0];
    if (t.startsWith("`")) parent.appendChild(el("code", "", t.slice(1, -1)));
    else if (t.startsWith("**")) parent.appendChild(el("strong", "", t.slice(2, -2)));
    else parent.appendChild(el("em", "", t.slice(1, -1)));
    at = m.index + t.length;
  }
  if (at < text.length) parent.appendChild(document.createTextNode(text.slice(at)));
}

function renderMarkdown(target, text) {
  target.replaceChildren();
  const lines = text.split("\n");
  let para = [], list = null;
  const flush = () => {
    if (para.length) { const p = el("p"); inline(p, para.join("\n")); target.appendChild(p); para = []; }
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    if (line.startsWith("```")) {
      flush();
      const code = [];
      i++;
      while (i < lines.length && !lines[i].startsWith("```")) code.push(lines[i++]);
      const pre = el("pre");
      pre.appendChild(el("code", "", code.join("\n")));
      target.appendChild(pre);
      continue;
    }
    const h = /^(#{1,6})\s+(.*)$/.exec(line);
    const li = /^\s*(?:[-*+]|\d+[.)])\s+(.*)$/.exec(line);
    if (h) { flush(); const e = el("h" + Math.min(h[1].length + 2, 6)); inline(e, h[2]); target.appendChild(e); }
    else if (li) {
      if (para.length) flush();
      if (!list) { list = el(/^\s*\d/.test(line) ? "ol" : "ul"); target.appendChild(list); }
      const e = el("li"); inline(e, li[1]); list.appendChild(e);
    } else if (line.trim() === "") flush();
    else { list = null; para.push(line); }
  }
  flush();
}

// --- Attachments ----------------------------------------------------------------------------
function addFiles(files) {
  for (const f of files) {
    const kind = f.type.startsWith("video/") ? "video" : f.type in IMAGE_TYPES ? "image" : null;
    if (!kind) {
      showError(f.name + ": not an image (" + Object.values(IMAGE_TYPES).join(", ") + ") or a video");
      continue;
    }
    const r = new FileReader();
    r.onload = () => { pending.push({ kind, url: r.result, name: f.name }); drawPending(); };
    r.onerror = () => showError(f.name + ": cannot read the file");
    r.readAsDataURL(f);
  }
}

function drawPending() {
  const box = $("pending");
  box.replaceChildren();
  pending.forEach((p, i) => {
    const c = el("span", "chip", p.name);
    c.dataset.testid = "pending";
    const x = el("button", "", "\u00d7");
    x.type = "button";
    x.title = "Remove";
    x.onclick = () => { pending.splice(i, 1); drawPending(); };
    c.appendChild(x);
    box.appendChild(c);
  });
}

// --- The conversation -----------------------------------------------------------------------
function userBubble(text, media) {
  $("empty").hidden = true;
  const m = el("div", "msg user");
  m.appendChild(el("div", "who", "You"));
  const body = el("div", "body");
  renderMarkdown(body, text);
  m.appendChild(body);
  if (media.length) {
    const t = el("div", "thumbs");
    for (const p of media) {
      const e = el(p.kind === "video" ? "video" : "img");
      e.src = p.url;
      if (p.kind === "video") e.controls = true; else e.alt = p.name;
      t.appendChild(e);
    }
    m.appendChild(t);
  }
  $("log").appendChild(m);
}

function answerBubble() {
  const m = el("div", "msg assistant");
  m.dataset.testid = "answer";
  m.appendChild(el("div", "who", "Assistant"));
  // A thinking model's reasoning, folded above the answer (created at its first piece).
  const thinking = el("details", "thinking");
  thinking.appendChild(el("summary", null, "Thinking"));
  const reasoning = el("div", "reasoning");
  reasoning.dataset.testid = "reasoning";
  thinking.appendChild(reasoning);
  thinking.hidden = true;
  m.appendChild(thinking);
  const body = el("div", "body");
  m.appendChild(body);
  const stats = el("div", "stats");
  stats.dataset.testid = "stats";
  m.appendChild(stats);
  $("log").appendChild(m);
  m.scrollIntoView({ block: "end" });
  return { m, body, stats, thinking, reasoning };
}

// The last image of the conversation (the one an answer's boxes are drawn over) and its index
// among the request's images.
function lastImage() {
  let url = null, count = 0;
  for (const msg of history) {
    if (!Array.isArray(msg.content)) continue;
    for (const p of msg.content) if (p.type === "image_url") { url = p.image_url.url; count++; }
  }
  return url ? { url, index: count - 1 } : null;
}

function drawShapes(bubble, grounding) {
  const img = lastImage();
  if (!img || !grounding || !Array.isArray(grounding.images)) return;
  const g = grounding.images.find((x) => x.index === img.index);
  if (!g || !g.shapes.length) return;
  const fig = el("div", "figure");
  const pic = el("img");
  pic.src = img.url;
  pic.alt = "image with boxes";
  fig.appendChild(pic);
  g.shapes.forEach((s, i) => {
    const colour = COLOURS[i % COLOURS.length];
    const e = el("div", "shape");
    e.style.borderColor = colour;
    if (s.type === "box") {
      const [x1, y1, x2, y2] = s.bbox;
      e.dataset.testid = "box";
      e.style.left = (100 * x1 / g.width) + "%";
      e.style.top = (100 * y1 / g.height) + "%";
      e.style.width = (100 * (x2 - x1) / g.width) + "%";
      e.style.height = (100 * (y2 - y1) / g.height) + "%";
    } else {
      e.dataset.testid = "point";
      e.classList.add("point");
      e.style.left = (100 * s.point[0] / g.width) + "%";
      e.style.top = (100 * s.point[1] / g.height) + "%";
    }
    if (s.label) {
      const l = el("span", "", s.label);
      l.style.background = colour;
      e.appendChild(l);
    }
    fig.appendChild(e);
  });
  bubble.m.insertBefore(fig, bubble.stats);
}

function setBusy(b) {
  busy = b;
  $("send").disabled = b;
  $("stop").disabled = !b;
}

async function send() {
  if (busy) return;
  const text = $("prompt").value.trim();
  if (!text && !pending.length) return;
  showError("");
  const format = $("format").value;
  let responseFormat = null;
  if (format === "grounding") {
    responseFormat = { type: "json_schema", json_schema: { name: "boxes", schema: GROUNDING_SCHEMA } };
  } else if (format === "schema") {
    try {
      responseFormat = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse($("schema").value || "{}") } };
    } catch (e) {
      showError("The JSON schema does not parse: " + e.message);
      return;
    }
  } else if (format === "regex") {
    responseFormat = { type: "regex", regex: $("rule").value };
  } else if (format === "grammar") {
    responseFormat = { type: "grammar", grammar: $("rule").value };
  }
  const maxPixels = parseInt($("max-pixels").value, 10);
  const parts = [];
  for (const p of pending) {
    if (p.kind === "image") {
      const part = { type: "image_url", image_url: { url: p.url } };
      if (maxPixels > 0) part.image_url.max_pixels = maxPixels;
      parts.push(part);
    } else {
      parts.push({ type: "video_url", video_url: { url: p.url } });
    }
  }
  const asked = text || (format === "grounding" ? GROUNDING_HINT : "Describe this.");
  parts.push({ type: "text", text: format === "grounding" && text ? text + "\n" + GROUNDING_HINT : asked });
  userBubble(asked, pending);
  history.push({ role: "user", content: parts });
  pending = [];
  drawPending();
  $("prompt").value = "";

  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = {
    messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    max_tokens: parseInt($("max-tokens").value, 10) || 512,
  };
  if (responseFormat) body.response_format = responseFormat;
  // Sampler settings left empty are the server's defaults.
  for (const [id, field] of SAMPLERS) {
    const v = $(id).value.trim();
    if (v !== "") body[field] = Number(v);
  }
  if (format === "grounding") body.grounding = true;

  const bubble = answerBubble();
  let answer = "", thought = "", usage = null, grounding = null, finish = null, first = 0, rendered = false;
  const started = performance.now();
  const render = () => {
    if (rendered) return;
    rendered = true;
    requestAnimationFrame(() => {
      rendered = false;
      const log = $("log");
      const atEnd = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
      renderMarkdown(bubble.body, answer);
      if (atEnd) log.scrollTop = log.scrollHeight;
    });
  };
  controller = new AbortController();
  setBusy(true);
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (r.status === 401) { askKey(); throw new Error("the server needs an API key"); }
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try { msg = (await r.json()).error.message; } catch (_) { /* not JSON */ }
      throw new Error(msg);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const ev = JSON.parse(data);
        if (ev.error) throw new Error(ev.error.message);
        if (ev.usage) usage = ev.usage;
        for (const c of ev.choices || []) {
          const rt = c.delta && c.delta.reasoning_content;
          if (rt) {
            if (!first) first = performance.now();
            thought += rt;
            bubble.thinking.hidden = false;
            bubble.reasoning.textContent = thought;
          }
          const t = c.delta && c.delta.content;
          if (t) {
            if (!first) first = performance.now();
            answer += t;
            render();
          }
          if (c.finish_reason) finish = c.finish_reason;
          if (c.grounding) grounding = c.grounding;
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else { bubble.m.classList.add("failed"); answer = answer || ""; showError(e.message); finish = "error"; }
  } finally {
    controller = null;
    setBusy(false);
  }
  renderMarkdown(bubble.body, answer || (finish === "error" ? "(no answer)" : ""));
  bubble.m.dataset.finish = finish || "";
  if (finish !== "error") {
    const turn = { role: "assistant", content: answer };
    if (thought) turn.reasoning_content = thought;
    history.push(turn);
  }
  else history.pop();
  drawShapes(bubble, grounding);
  const secs = first ? (performance.now() - first) / 1000 : 0;
  const bits = [];
  if (usage) {
    const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    bits.push(usage.prompt_tokens + " prompt tokens (" + cached + " cached)");
    bits.push(usage.completion_tokens + " tokens");
    if (secs > 0 && usage.completion_tokens > 1) bits.push(((usage.completion_tokens - 1) / secs).toFixed(1) + " tok/s");
  }
  if (first) bits.push("first token " + ((first - started) / 1000).toFixed(2) + " s");
  if (finish === "stopped") bits.push("stopped");
  else if (finish === "length") bits.push("cut at max tokens");
  bubble.stats.textContent = bits.join(" \u00b7 ");
  bubble.m.dataset.done = "1";
  bubble.m.scrollIntoView({ block: "end" });
}

function newChat() {
  if (controller) controller.abort();
  history = [];
  pending = [];
  drawPending();
  showError("");
  const empty = $("empty");
  $("log").replaceChildren(empty);
  empty.hidden = false;
  $("prompt").focus();
}

// An example prompt into the box; a `<placeholder>` in it selected, to type over.
function useExample(text) {
  const p = $("prompt");
  p.value = text;
  p.focus();
  const m = /<[^>]+>/.exec(text);
  if (m) p.setSelectionRange(m.index, m.index + m[0].length);
  else p.setSelectionRange(text.length, text.length);
}

function askKey() {
  $("key-needed").hidden = false;
  $("key-input").focus();
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) { askKey(); return; }
    if (!r.ok) { showError("/v1/models: " + r.status); return; }
    const m = await r.json();
    const d = m.data && m.data[0];
    if (d) {
      $("model").textContent = d.id + " \u00b7 context " + d.context_length;
      $("empty-model").textContent = d.id;
      $("empty-context").textContent = "Context: " + d.context_length.toLocaleString("en") +
        " tokens for the whole conversation (text, images, videos and answers).";
    }
    $("key-needed").hidden = true;
  } catch (e) {
    showError("the server does not answer: " + e.message);
  }
}

function init() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("stop").onclick = () => { if (controller) controller.abort(); };
  $("new-chat").onclick = newChat;
  $("settings-toggle").onclick = () => { $("settings").hidden = !$("settings").hidden; };
  $("format").onchange = () => {
    const f = $("format").value;
    $("schema-box").hidden = f !== "schema";
    $("rule-box").hidden = f !== "regex" && f !== "grammar";
  };
  $("attach").onchange = (e) => { addFiles(e.target.files); e.target.value = ""; };
  $("image-types").textContent = Object.values(IMAGE_TYPES).join(", ");
  $("video-types").textContent = VIDEO_NOTE;
  for (const b of document.querySelectorAll("#examples .example")) b.onclick = () => useExample(b.textContent);
  $("api-key").value = key();
  $("api-key").onchange = () => { localStorage.setItem("vl-api-key", $("api-key").value); loadModel(); };
  $("key-save").onclick = () => {
    localStorage.setItem("vl-api-key", $("key-input").value);
    $("api-key").value = $("key-input").value;
    loadModel();
  };
  document.addEventListener("paste", (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])];
    if (files.length) { e.preventDefault(); addFiles(files); }
  });
  document.addEventListener("dragover", (e) => { e.preventDefault(); document.body.classList.add("dragging"); });
  document.addEventListener("dragleave", () => document.body.classList.remove("dragging"));
  document.addEventListener("drop", (e) => {
    e.preventDefault();
    document.body.classList.remove("dragging");
    addFiles([...e.dataTransfer.files]);
  });
  setBusy(false);
  loadModel();
  document.body.dataset.ready = "1";
}

init();
