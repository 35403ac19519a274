"""langchain-openai, openai-agents, litellm and llm against `vl serve` (run by
crates/vl-cli/tests/python_clients.rs), each as its users configure it for an OpenAI-compatible
server; no call leaves the machine (litellm's model list is read locally, the agents SDK's
tracing is off).

    more_clients.py BASE_URL API_KEY LLM_USER_DIR

The server serves tiny-b (random weights): structured answers validate because of the
constraint. Each passed check prints "ok: NAME"; the first failure raises.
"""

import os
import subprocess
import sys
from typing import Literal

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

from pydantic import BaseModel, Field

base, key, llm_dir = sys.argv[1:4]
MODEL = "tiny-b"


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["cat", "dog"]


def ok(name):
    print("ok:", name, flush=True)


# langchain-openai: a chat model, whole and streamed, and a structured output.
from langchain_openai import ChatOpenAI

lc = ChatOpenAI(model=MODEL, base_url=base + "/v1", api_key=key, max_tokens=8, temperature=0, max_retries=0)
whole = lc.invoke("Say something.")
assert isinstance(whole.content, str) and whole.content, whole
streamed = "".join(c.content for c in lc.stream("Say something."))
assert streamed == whole.content, (streamed, whole.content)
pet = ChatOpenAI(model=MODEL, base_url=base + "/v1", api_key=key, max_tokens=120, temperature=1.0, seed=2,
                 max_retries=0).with_structured_output(Pet, method="json_schema").invoke("A pet?")
assert isinstance(pet, Pet), pet
ok("langchain-openai")

# openai-agents: an agent on the chat completions model, a text answer and a typed one.
import agents
from openai import AsyncOpenAI

agents.set_tracing_disabled(True)
model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(base_url=base + "/v1", api_key=key))
settings = agents.ModelSettings(max_tokens=120, temperature=1.0)
r = agents.Runner.run_sync(agents.Agent(name="a", instructions="Be brief.", model=model, model_settings=settings),
                           "Hi", max_turns=1)
assert isinstance(r.final_output, str), r
r = agents.Runner.run_sync(agents.Agent(name="b", model=model, model_settings=settings, output_type=Pet), "A pet?",
                           max_turns=1)
assert isinstance(r.final_output, Pet), r.final_output
ok("openai-agents")

# litellm: an OpenAI-compatible provider.
import litellm

r = litellm.completion(model="openai/" + MODEL, api_base=base + "/v1", api_key=key, max_tokens=8, temperature=0,
                       messages=[{"role": "user", "content": "Say something."}])
assert r.choices[0].message.content and r.usage.completion_tokens == 8, r
ok("litellm")

# llm: an extra OpenAI-compatible model in its user directory, through its command line.
with open(os.path.join(llm_dir, "extra-openai-models.yaml"), "w") as f:
    f.write(f"- model_id: vl-tiny\n  model_name: {MODEL}\n  api_base: {base}/v1\n  api_key_name: vl\n")
env = dict(os.environ, LLM_USER_PATH=llm_dir)
out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "llm"), "-m", "vl-tiny", "--key", key,
                      "-o", "max_tokens", "8", "-o", "temperature", "0", "--no-log", "Say something."],
                     env=env, capture_output=True, text=True, timeout=120)
assert out.returncode == 0 and out.stdout.strip(), out
ok("llm")
