"""The openai Python SDK and instructor against `vl serve` (run by
crates/vl-cli/tests/python_clients.rs).

    openai_clients.py BASE_URL API_KEY

The server serves tiny-b (random weights; its template offers tools): every structured answer
validates because of the constraint, never by chance. Each passed check prints "ok: NAME"; the
first failure raises (exit status 1).
"""

import sys
from typing import Literal

import instructor
import openai
from pydantic import BaseModel, Field

base, key = sys.argv[1:3]
client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)
MODEL = "tiny-b"


def ok(name):
    print("ok:", name, flush=True)


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["cat", "dog"]
    legs: int = Field(ge=0, le=4)


# Models: listed and retrieved.
ids = [m.id for m in client.models.list().data]
assert MODEL in ids, ids
assert client.models.retrieve(MODEL).id == MODEL
ok("models")

# Chat, whole and streamed: the pieces add up to the whole (greedy).
ask = [{"role": "user", "content": "Say something."}]
whole = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0)
pieces = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0, stream=True)
streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
assert streamed == whole.choices[0].message.content and whole.usage.completion_tokens == 8, (streamed, whole)
ok("chat")

# The SDK's structured output helper (a strict json_schema from a Pydantic model).
for seed in range(3):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A pet?"}],
                                      response_format=Pet, max_tokens=120, temperature=1.0, seed=seed)
    p = r.choices[0].message.parsed
    assert isinstance(p, Pet), r
ok("parse")

# parallel_tool_calls false with a required tool: exactly one call.
tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}
r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[tool],
                                   tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                   temperature=1.0, seed=1)
calls = r.choices[0].message.tool_calls
assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r
ok("one tool call")

# A grammar through the SDK's extra_body (vLLM's field).
r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=1.0, seed=4,
                                   extra_body={"structured_outputs": {"choice": ["north", "south"]}})
assert r.choices[0].message.content in ("north", "south"), r
ok("structured_outputs")

# instructor's modes that send the schema as a constraint (JSON_SCHEMA, TOOLS, TOOLS_STRICT;
# its JSON mode asks for any JSON object, which a random model never closes): each returns a
# validated model (no retries: the first answer must pass).
for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS, instructor.Mode.TOOLS_STRICT):
    print("mode", mode, flush=True)
    ic = instructor.from_openai(client, mode=mode)
    p = ic.chat.completions.create(model=MODEL, response_model=Pet, max_retries=0, max_tokens=160,
                                   temperature=1.0, seed=7, messages=[{"role": "user", "content": "A pet?"}])
    assert isinstance(p, Pet), (mode, p)
ok("instructor")

ic = instructor.from_openai(client, mode=instructor.Mode.RESPONSES_TOOLS)
p = ic.responses.create(model=MODEL, response_model=Pet, max_retries=0, max_output_tokens=160,
                        temperature=1.0, input=[{"role": "user", "content": "A pet?"}])
assert isinstance(p, Pet), p
ok("instructor responses")

# Responses: stored, continued, retrieved and deleted through the SDK.
a = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4)
b = client.responses.create(model=MODEL, input="Another?", previous_response_id=a.id, max_output_tokens=4)
assert b.usage.input_tokens > a.usage.input_tokens, (a.usage, b.usage)
assert client.responses.retrieve(a.id).id == a.id
client.responses.delete(a.id)
try:
    client.responses.retrieve(a.id)
    raise AssertionError("a deleted response was returned")
except openai.NotFoundError:
    pass
ok("responses")

# An error names its field in `param`.
try:
    client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=3.5)
    raise AssertionError("temperature 3.5 was answered")
except openai.BadRequestError as e:
    assert e.param == "temperature", e.body
ok("errors")
