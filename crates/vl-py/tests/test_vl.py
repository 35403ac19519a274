"""The Python package on the tiny golden checkpoints (random weights): answers equal the
reference's greedy ones (goldens/tiny-a/cases), whatever form the image takes; streams add up;
schemas and tool calls validate; threads are answered concurrently with equal answers; breaking
out of a stream cancels it; errors carry the server's one-line messages."""

import base64
import json
import pathlib
import threading

import pytest
from PIL import Image

import vl

ROOT = pathlib.Path(__file__).resolve().parents[3]
GOLDENS = ROOT / "goldens"
SQUARE = GOLDENS / "images" / "square.png"
CASE = json.loads((GOLDENS / "tiny-a" / "cases" / "one_image.json").read_text())
WANT = CASE["greedy"]["text"]
N = len(CASE["greedy"]["ids"])


@pytest.fixture(scope="module")
def engine():
    return vl.Engine(GOLDENS / "tiny-a" / "checkpoint", parallel=4)


def ask(image):
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "Describe this image."}]}]


def test_an_image_in_each_form_gives_the_reference_answer(engine):
    data = SQUARE.read_bytes()
    forms = [
        str(SQUARE),
        SQUARE,
        data,
        Image.open(SQUARE),
        "data:image/png;base64," + base64.b64encode(data).decode(),
    ]
    for form in forms:
        r = engine.chat(ask(form), max_tokens=N, temperature=0)
        assert r.text == WANT, type(form)
        assert r.finish_reason == "length"
        assert r.usage["prompt_tokens"] == CASE["num_tokens"]
        assert r.usage["completion_tokens"] == N
        assert r.usage["prompt_tokens_details"]["image_tokens"] == 16
    # The OpenAI part shape works as it is.
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "Describe this image."}]}]
    r = engine.chat(msg, max_tokens=N, temperature=0)
    assert r.text == WANT
    assert r.timings["decode_tokens_per_s"] > 0 and r.timings["prefill_s"] > 0


def test_a_stream_adds_up_to_the_answer(engine):
    s = engine.stream(ask(SQUARE), max_tokens=N, temperature=0)
    pieces = [d for d in s]
    assert len(pieces) > 1
    assert "".join(d.text for d in pieces) == WANT
    assert s.result is not None and s.result.text == WANT


def test_a_json_schema_answer_validates(engine):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    for seed in range(3):
        r = engine.chat([{"role": "user", "content": "JSON please."}], max_tokens=80, temperature=1.0, seed=seed,
                        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        v = json.loads(r.text)
        assert set(v) == {"n", "ok"} and 0 <= v["n"] <= 9 and isinstance(v["ok"], bool), r.text
    r = engine.chat([{"role": "user", "content": "Pick."}], max_tokens=8, temperature=1.0, seed=1,
                    structured_outputs={"choice": ["left", "right"]})
    assert r.text in ("left", "right")


def test_drafts_and_forced_tokens_are_keyword_arguments(engine):
    # n-gram drafts change no answer; a bad method is refused by name.
    for spec in ("ngram", {"method": "ngram", "draft_max": 3, "ngram_min": 1}):
        r = engine.chat(ask(SQUARE), max_tokens=N, temperature=0, speculative=spec)
        assert r.text == WANT, spec
    r = engine.chat([{"role": "user", "content": "Pick."}], max_tokens=40, temperature=0, forced_tokens=False,
                    structured_outputs={"choice": ["a_long_left_answer", "a_long_right_answer"]})
    assert r.text in ("a_long_left_answer", "a_long_right_answer")
    for bad in ("eagle", "draft"):  # this engine loaded no draft model
        with pytest.raises(vl.RequestError) as e:
            engine.chat(ask(SQUARE), max_tokens=2, speculative=bad)
        assert e.value.param == "speculative", bad


def test_a_draft_model_drafts_when_asked():
    drafted = vl.Engine(GOLDENS / "tiny-a" / "checkpoint", parallel=1, draft_model=GOLDENS / "tiny-b" / "checkpoint")
    for spec in ("draft", {"method": "draft", "draft_max": 6}):
        r = drafted.chat(ask(SQUARE), max_tokens=N, temperature=0, speculative=spec)
        assert r.text == WANT, spec


def test_a_half_precision_kv_cache_gives_the_answer():
    # tiny-a's greedy answers are unchanged by an f16 cache (crates/vl-models/tests/kv_dtype.rs
    # measures its logits' bound against the reference).
    half = vl.Engine(GOLDENS / "tiny-a" / "checkpoint", parallel=1, kv_cache_dtype="f16")
    assert half.chat(ask(SQUARE), max_tokens=N, temperature=0).text == WANT
    with pytest.raises(vl.RequestError) as e:
        vl.Engine(GOLDENS / "tiny-a" / "checkpoint", kv_cache_dtype="f8")
    assert "kv_cache_dtype" in str(e.value)


def test_threads_are_answered_together_with_equal_answers(engine):
    out = [None] * 6
    def work(i):
        out[i] = engine.chat(ask(SQUARE), max_tokens=N, temperature=0).text
    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert out == [WANT] * 6


def test_breaking_out_of_a_stream_cancels_it(engine):
    s = engine.stream([{"role": "user", "content": "Tell a long story."}], max_tokens=1800, temperature=0)
    took = 0
    for d in s:
        took += 1
        if took == 3:
            break
    s.close()
    assert s.result is None
    # The engine is free again: a short answer comes back.
    r = engine.chat([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    assert r.usage["completion_tokens"] == 2


def test_errors_carry_the_servers_messages(engine):
    with pytest.raises(vl.RequestError) as e:
        engine.chat([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=3.5)
    assert "temperature" in str(e.value) and e.value.param == "temperature" and e.value.status == 400
    with pytest.raises(vl.RequestError) as e:
        engine.chat(ask(GOLDENS / "images" / "no-such.png"), max_tokens=2)
    assert "no-such.png" in str(e.value)
    with pytest.raises(vl.RequestError) as e:
        engine.chat([{"role": "user", "content": "Hi"}], max_tokens=2, grammar="root ::= missing\n")
    assert e.value.param == "grammar" and "missing" in str(e.value)
    with pytest.raises(vl.RequestError):
        engine.chat(ask(12345), max_tokens=2)
    with pytest.raises(vl.RequestError) as e:
        vl.Engine(GOLDENS / "tiny-a" / "checkpoint", quantize="q3")
    assert "quantize" in str(e.value)
    with pytest.raises(vl.VlError) as e:
        vl.Engine(GOLDENS / "no-such-model")
    assert "no-such-model" in str(e.value)


def test_tool_calls_come_back_with_their_arguments():
    engine = vl.Engine(GOLDENS / "tiny-b" / "checkpoint")
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    r = engine.chat([{"role": "user", "content": "Weather?"}], max_tokens=120, temperature=1.0, seed=3,
                    tools=[{"type": "function", "function": {"name": "weather", "parameters": params}}],
                    tool_choice="required", parallel_tool_calls=False)
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1
    call = r.tool_calls[0]
    assert call["name"] == "weather" and set(call["arguments"]) == {"city"}
    assert len(call["arguments"]["city"]) <= 10


def test_the_readme_example_runs(monkeypatch, capsys):
    """README's Python example, as written, from the checkout's root."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python\nimport vl\n") + len("```python\n")
    code = readme[start:readme.index("```", start)]
    assert len(code.strip().splitlines()) == 5
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "'completion_tokens': 16" in printed


def test_embed_and_rerank_give_the_references_values():
    g = json.loads((GOLDENS / "tiny-embed" / "embeddings.json").read_text())
    text = next(c for c in g["cases"] if c["case"] == "text")
    e = vl.Engine(GOLDENS / "tiny-embed" / "checkpoint")
    v, w = e.embed([text["texts"][0], text["texts"][0]])
    assert max(abs(a - b) for a, b in zip(w, text["embedding"])) <= 1e-4
    (cut,) = e.embed([text["texts"][0]], dimensions=text["dims"])
    assert len(cut) == text["dims"]
    assert max(abs(a - b) for a, b in zip(cut, text["truncated"])) <= 1e-4
    with pytest.raises(vl.RequestError):
        e.chat([{"role": "user", "content": "Hi"}], max_tokens=2)
    s = json.loads((GOLDENS / "tiny-rerank" / "scores.json").read_text())
    case = next(c for c in s["cases"] if c["case"] == "text")
    r = vl.Engine(GOLDENS / "tiny-rerank" / "checkpoint")
    (top,) = r.rerank(case["query"]["texts"][0], [case["document"]["texts"][0]])
    assert top["index"] == 0 and abs(top["relevance_score"] - case["score"]) <= 1e-3


def test_a_hub_id_loads_from_the_local_cache(tmp_path, monkeypatch):
    # A private Hugging Face cache holding tiny/qwen3-vl-a (links to tiny-a's files), laid out
    # as huggingface_hub and hf-hub lay one out; offline, so nothing is fetched.
    snap = tmp_path / "hub" / "models--tiny--qwen3-vl-a" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0123abcd")
    for f in (GOLDENS / "tiny-a" / "checkpoint").iterdir():
        (snap / f.name).symlink_to(f.resolve())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    engine = vl.Engine("tiny/qwen3-vl-a", parallel=1)
    r = engine.chat(ask(SQUARE), max_tokens=N)
    assert r.text == WANT
    assert r.raw["model"] == "tiny/qwen3-vl-a"
    with pytest.raises(vl.VlError) as e:
        vl.Engine("tiny/not-cached")
    assert "tiny/not-cached is not in the local Hugging Face cache" in str(e.value)
    assert "HF_HUB_OFFLINE is set" in str(e.value)
