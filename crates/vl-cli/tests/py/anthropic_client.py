"""The official anthropic SDK against `vl serve` (run by crates/vl-cli/tests/anthropic_sdk.rs).

    anthropic_client.py BASE_URL API_KEY MODE GOLDEN_CASE_JSON SQUARE_PNG

MODE "instruct": tiny-a with its own template (text, image, the stream helper, system prompts,
stop sequences, count_tokens, x-api-key, errors); "tools": tiny-b, whose template offers tools
(forced tool_use, a tool_result round trip); "thinking": tiny-a with the Thinking template
(thinking blocks, whole and streamed). The golden
case is the Python reference's greedy answer to square.png + "Describe this image.". Every check
asserts; each passed check prints "ok: NAME"; the first failure raises (exit status 1).
"""

import base64
import json
import sys

import anthropic

base, key, mode, golden_path, png_path = sys.argv[1:6]
golden = json.load(open(golden_path))
want_text = golden["greedy"]["text"]
want_tokens = len(golden["greedy"]["ids"])
png = base64.b64encode(open(png_path, "rb").read()).decode()
client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=120)
MODEL = "tiny-a"


def ok(name):
    print("ok:", name, flush=True)


def image_message(text="Describe this image."):
    return [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
        {"type": "text", "text": text},
    ]}]


def instruct():
    # Text.
    m = client.messages.create(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hello."}])
    assert m.type == "message" and m.role == "assistant", m
    assert m.content[0].type == "text" and m.content[0].text, m
    assert m.stop_reason in ("max_tokens", "end_turn") and 0 < m.usage.output_tokens <= 6, m
    ok("text")

    # An image: the reference's greedy answer.
    m = client.messages.create(model=MODEL, max_tokens=want_tokens, messages=image_message())
    assert m.content[0].text == want_text, (m.content[0].text, want_text)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == want_tokens, m
    ok("image")

    # The stream helper: text deltas add up to the same, the final message too.
    with client.messages.stream(model=MODEL, max_tokens=want_tokens, messages=image_message()) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == want_text, (streamed, want_text)
    assert final.content[0].text == want_text and final.stop_reason == "max_tokens", final
    ok("stream helper")

    # A system prompt as a string or as blocks: the same prompt, the same answer.
    a = client.messages.create(model=MODEL, max_tokens=8, system="You are terse.", messages=image_message())
    b = client.messages.create(model=MODEL, max_tokens=8, system=[{"type": "text", "text": "You are terse."}],
                               messages=image_message())
    assert a.content[0].text == b.content[0].text, (a, b)
    assert a.usage.input_tokens + (a.usage.cache_read_input_tokens or 0) > golden["num_tokens"], a
    ok("system")

    # A stop sequence from the middle of the reference's answer: the answer ends before it.
    stop = want_text[12:20]
    m = client.messages.create(model=MODEL, max_tokens=want_tokens, messages=image_message(), stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop, m
    assert m.content[0].text == want_text[:want_text.index(stop)], (m.content[0].text, stop)
    ok("stop sequences")

    # count_tokens: the reference's prompt length.
    n = client.messages.count_tokens(model=MODEL, messages=image_message()).input_tokens
    assert n == golden["num_tokens"], (n, golden["num_tokens"])
    ok("count_tokens")

    # x-api-key: a wrong key is refused in Anthropic's shape.
    bad = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0, timeout=60)
    try:
        bad.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        raise AssertionError("a wrong key was answered")
    except anthropic.AuthenticationError as e:
        assert e.status_code == 401 and e.body["error"]["type"] == "authentication_error", e.body
    ok("x-api-key")

    # Errors: Anthropic's shape, naming the field.
    try:
        client.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "Hi"}])
        raise AssertionError("max_tokens 0 was answered")
    except anthropic.BadRequestError as e:
        assert e.status_code == 400 and e.body["type"] == "error", e.body
        assert e.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.body["error"]["message"], e.body
    ok("errors")


def tools():
    # A forced tool: its input validates against the input schema.
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": {"type": "object", "required": ["city", "unit"],
                             "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}}}}
    # (tool_choice, how many calls it allows): a named tool is one call; "any" is one or more,
    # one with parallel tool use disabled.
    for choice, one in (({"type": "tool", "name": "get_weather"}, True), ({"type": "any"}, False),
                        ({"type": "any", "disable_parallel_tool_use": True}, True)):
        m = client.messages.create(model=MODEL, max_tokens=120, tools=[tool], tool_choice=choice,
                                   messages=[{"role": "user", "content": "Weather in Oslo?"}])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses and (len(uses) == 1 or not one), (choice, m)
        for u in uses:
            assert u.name == "get_weather" and u.id, u
            assert set(u.input) == {"city", "unit"} and isinstance(u.input["city"], str), u.input
            assert len(u.input["city"]) <= 12 and u.input["unit"] in ("c", "f"), u.input
    ok("forced tool_use")

    # The call answered with a tool_result: the conversation goes on.
    convo = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": u.id, "name": u.name, "input": u.input}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "12 degrees"}]}]
    m = client.messages.create(model=MODEL, max_tokens=8, tools=[tool], messages=convo)
    assert m.content and m.usage.output_tokens > 0, m
    with_result = client.messages.count_tokens(model=MODEL, tools=[tool], messages=convo).input_tokens
    without = client.messages.count_tokens(model=MODEL, tools=[tool], messages=convo[:1]).input_tokens
    assert with_result > without > 0, (with_result, without)
    ok("tool_result round trip")


def thinking():
    # Thinking blocks apart from the text; the budget closes the block.
    m = client.messages.create(model=MODEL, max_tokens=40, thinking={"type": "enabled", "budget_tokens": 5},
                               messages=[{"role": "user", "content": "Think, then answer."}])
    kinds = [b.type for b in m.content]
    assert kinds[0] == "thinking" and "text" in kinds, kinds
    assert m.content[0].thinking.strip(), m.content[0]
    ok("thinking")

    with client.messages.stream(model=MODEL, max_tokens=40, thinking={"type": "enabled", "budget_tokens": 5},
                                messages=[{"role": "user", "content": "Think, then answer."}]) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == m.content[0].thinking, final
    assert [b.type for b in final.content] == kinds, final
    assert "thinking" in events or any(t == "content_block_delta" for t in events), events
    ok("thinking streamed")

    m = client.messages.create(model=MODEL, max_tokens=20, thinking={"type": "disabled"},
                               messages=[{"role": "user", "content": "Answer."}])
    thought = [b for b in m.content if b.type == "thinking"]
    assert not thought or not thought[0].thinking.strip(), m
    ok("thinking disabled")


{"instruct": instruct, "tools": tools, "thinking": thinking}[mode]()
