"""vl: Qwen vision-language models in-process, on the vl engine (Rust).

    >>> import vl
    >>> engine = vl.Engine("goldens/tiny-a/checkpoint")
    >>> r = engine.chat([{"role": "user", "content": "Hello"}], max_tokens=8)
    >>> r.finish_reason in ("stop", "length")
    True

Messages are OpenAI's chat messages. An image part may also be ``{"type": "image", "image": X}``
with X a path (str or pathlib.Path), bytes, a PIL image or a URL string (data URLs always;
http(s) URLs with ``allow_remote_media=True``). Sampling and the other request fields are
keyword arguments with the OpenAI names (``max_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``n``, ``tools``, ``tool_choice``, ``response_format``, ``logprobs``, ...) and the
server's extensions (``top_k``, ``min_p``, ``structured_outputs``, ``grammar``,
``dry_multiplier``, ``reasoning_budget``, ``chat_template_kwargs``, ...): each is checked as
``vl serve`` checks it, and a refused one raises ``RequestError`` naming it.

Many threads may call one engine at once: the GIL is released while it works and its scheduler
batches their requests.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

from ._vl import Engine as _Engine
from ._vl import RequestError, VlError
from ._vl import serve as _serve

# Raised from Python too (a part of the wrong type): the attributes the engine's errors carry.
VlError.param = None
VlError.status = 400

__all__ = ["Engine", "ChatResult", "Delta", "Stream", "RequestError", "VlError", "serve"]


@dataclass
class ChatResult:
    """One answer: its text, reasoning, tool calls, usage and timings, and the whole
    ``chat.completion`` object as ``raw``."""

    text: str
    reasoning: Optional[str]
    tool_calls: List[Dict[str, Any]]
    finish_reason: str
    usage: Dict[str, Any]
    timings: Dict[str, float]
    grounding: Optional[Dict[str, Any]]
    logprobs: Optional[Dict[str, Any]]
    raw: Dict[str, Any] = field(repr=False)
    choices: List["ChatResult"] = field(default_factory=list, repr=False)

    @property
    def boxes(self) -> List[Dict[str, Any]]:
        """The answer's boxes and points in pixels of the first image (``grounding``), each
        ``{"type": "box", "bbox": [x1, y1, x2, y2], "label": ...}`` or ``{"type": "point",
        "point": [x, y]}``; empty when the answer names none."""
        images = (self.grounding or {}).get("images") or []
        return list(images[0]["shapes"]) if images else []


@dataclass
class Delta:
    """A piece of a streamed answer: its text, which answer (``choice``) and whether it is
    reasoning (a thinking model's block) rather than the answer itself."""

    text: str
    choice: int = 0
    reasoning: bool = False


def _result(raw: Dict[str, Any]) -> ChatResult:
    def one(c: Dict[str, Any]) -> ChatResult:
        m = c.get("message") or {}
        calls = []
        for t in m.get("tool_calls") or []:
            f = t["function"]
            try:
                args = json.loads(f["arguments"])
            except ValueError:
                args = f["arguments"]
            calls.append({"id": t.get("id"), "name": f["name"], "arguments": args})
        return ChatResult(
            text=m.get("content") or "",
            reasoning=m.get("reasoning_content"),
            tool_calls=calls,
            finish_reason=c.get("finish_reason"),
            usage=raw.get("usage") or {},
            timings=raw.get("timings") or {},
            grounding=c.get("grounding"),
            logprobs=c.get("logprobs"),
            raw=raw,
        )

    all_ = [one(c) for c in raw["choices"]]
    first = all_[0]
    first.choices = all_
    return first


def _data_url(data: bytes) -> str:
    # The server reads the image from its bytes: the media type is not needed.
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode()


def _media(x: Any, what: str) -> str:
    """A path, bytes, a PIL image or a URL as the string the server reads."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        return _data_url(bytes(x))
    if isinstance(x, pathlib.PurePath):
        return os.path.abspath(x)
    if isinstance(x, str):
        if x.startswith(("data:", "http://", "https://", "file://")):
            return x
        return os.path.abspath(x)
    save = getattr(x, "save", None)
    if callable(save):  # a PIL image
        buf = io.BytesIO()
        x.save(buf, format="PNG")
        return _data_url(buf.getvalue())
    raise RequestError(f"a {what} part must be a path, bytes, a PIL image or a URL string, not {type(x).__name__}")


def _part(p: Any) -> Any:
    if not isinstance(p, dict):
        return p
    kind = p.get("type")
    if kind in ("image", "video") and kind in p and not isinstance(p[kind], dict):
        q = dict(p)
        q[kind] = _media(p[kind], kind)
        return q
    if kind in ("image_url", "video_url") and isinstance(p.get(kind), (str, bytes, pathlib.PurePath)):
        q = dict(p)
        q[kind] = {"url": _media(p[kind], kind.split("_")[0])}
        return q
    return p


def _messages(messages: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = dict(m)
            m["content"] = [_part(p) for p in m["content"]]
        out.append(m)
    return out


def _body(messages: Sequence[Dict[str, Any]], options: Dict[str, Any], stream: bool) -> str:
    if "messages" in options or "stream" in options:
        raise RequestError("pass the messages as the first argument and use Engine.stream to stream")
    body = dict(options)
    body["messages"] = _messages(messages)
    body["stream"] = stream
    return json.dumps(body)


class Stream:
    """An answer arriving: iterate for its ``Delta`` pieces; afterwards ``result`` is the whole
    ``ChatResult``. Breaking out of the loop (or ``close()``) cancels the answer."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.result: Optional[ChatResult] = None

    def __iter__(self) -> Iterator[Delta]:
        for choice, text, reasoning in self._inner:
            yield Delta(text=text, choice=choice, reasoning=reasoning)
        raw = self._inner.result
        if raw is not None:
            self.result = _result(json.loads(raw))

    def close(self) -> None:
        """Cancels the answer: the engine stops generating it at its next step."""
        self._inner.close()

    def __del__(self) -> None:
        inner = getattr(self, "_inner", None)
        if inner is not None:
            inner.close()


class Engine:
    """A model loaded for answering, resident until the object is dropped.

    ``model``: a checkpoint directory (safetensors), a GGUF file (with ``mmproj`` or an
    ``mmproj*.gguf`` beside it) or a directory holding one, or a Hugging Face hub id
    (``"Qwen/Qwen3-VL-2B-Instruct"``, or ``"repo:Q4_K_M"`` for a GGUF pair) taken from the local
    Hugging Face cache and downloaded when absent (``HF_HUB_OFFLINE=1``: the cache only), as
    ``vl run --model`` does. ``quantize``: ``None`` keeps the
    weights as stored; ``"q4k"``, ``"q5k"``, ``"q6k"`` or ``"q8"`` quantizes the text decoder at
    load. ``device``: ``"cpu"``, or ``"cuda"`` / ``"metal"`` in builds with those features.
    ``parallel``: sequences decoded together. ``kv_cache_mib``: the KV cache budget (default: a
    share of the machine's memory). ``prefix_cache``: reuse the prompts' common prefixes.
    ``image_cache_mib``: vision features kept for repeated images. ``media_dir``: local media
    paths are read only under it (default ``/``: any file this process can read).
    ``allow_remote_media``: fetch http(s) image and video URLs. ``draft_model``: a smaller
    checkpoint of the same tokenizer (a path or a hub id) loaded beside the model, which drafts
    for requests with ``speculative="draft"``. ``kv_cache_dtype``: ``"f16"`` or ``"bf16"`` keeps the
    KV cache in half precision (CPU: half its memory, faster long contexts; the bound in
    docs/parity.md), ``None`` in the compute dtype.

        >>> engine = Engine("goldens/tiny-a/checkpoint", parallel=2)
        >>> engine.context
        2048
    """

    def __init__(
        self,
        model: "str | os.PathLike[str]",
        *,
        mmproj: "str | os.PathLike[str] | None" = None,
        quantize: Optional[str] = None,
        device: str = "cpu",
        parallel: int = 4,
        kv_cache_mib: Optional[int] = None,
        prefix_cache: bool = True,
        image_cache_mib: int = 256,
        media_dir: "str | os.PathLike[str] | None" = None,
        allow_remote_media: bool = False,
        draft_model: "str | os.PathLike[str] | None" = None,
        kv_cache_dtype: Optional[str] = None,
    ) -> None:
        self._engine = _Engine(
            os.fspath(model),
            mmproj=None if mmproj is None else os.fspath(mmproj),
            quantize=quantize,
            device=device,
            parallel=parallel,
            kv_cache_mib=kv_cache_mib,
            prefix_cache=prefix_cache,
            image_cache_mib=image_cache_mib,
            media_dir=None if media_dir is None else os.path.abspath(media_dir),
            allow_remote_media=allow_remote_media,
            draft_model=None if draft_model is None else os.fspath(draft_model),
            kv_cache_dtype=kv_cache_dtype,
        )

    @property
    def context(self) -> int:
        """The model's context in tokens."""
        return self._engine.context

    def chat(self, messages: Sequence[Dict[str, Any]], **options: Any) -> ChatResult:
        """Answers a conversation (OpenAI chat messages) and returns the first answer; with
        ``n`` above 1 the others are in ``choices``.

            >>> r = engine.chat([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
            >>> r.usage["completion_tokens"] <= 4
            True
        """
        return _result(json.loads(self._engine.chat(_body(messages, options, False))))

    def embed(self, inputs: Sequence[Any], *, dimensions: Optional[int] = None, instruction: Optional[str] = None,
              **options: Any) -> List[List[float]]:
        """Embeds each input with an embedding checkpoint (Qwen3-VL-Embedding), as
        ``/v1/embeddings`` does: an input is a string, a list of token ids, an image part
        (``{"type": "image", "image": X}``, X as for ``chat``), or a list of parts (an image and
        its caption). ``dimensions`` truncates (Matryoshka) and re-normalises; ``instruction``
        replaces the default system instruction. Returns one vector per input.

            >>> v = Engine("goldens/tiny-embed/checkpoint").embed(["A cat sleeps on a sofa."])
        """
        def one(x: Any) -> Any:
            if isinstance(x, list) and x and not all(isinstance(i, int) for i in x):
                return {"content": [_part(p) if isinstance(p, dict) else {"type": "text", "text": p} for p in x]}
            return _part(x)
        if isinstance(inputs, (str, bytes)) or isinstance(inputs, dict):
            raise RequestError("`inputs` must be a list (one entry per vector)")
        body: Dict[str, Any] = dict(options)
        body["input"] = [one(x) for x in inputs]
        if dimensions is not None:
            body["dimensions"] = dimensions
        if instruction is not None:
            body["instruction"] = instruction
        raw = json.loads(self._engine.pool("embeddings", json.dumps(body)))
        return [d["embedding"] for d in raw["data"]]

    def rerank(self, query: Any, documents: Sequence[Any], *, top_n: Optional[int] = None,
               instruction: Optional[str] = None) -> List[Dict[str, Any]]:
        """Scores each document against the query with a reranker checkpoint
        (Qwen3-VL-Reranker), as ``/v1/rerank`` does: ``[{"index", "relevance_score"}]``, best
        first (``top_n`` of them). The query and documents take the forms ``embed`` takes."""
        body: Dict[str, Any] = {"query": _part(query), "documents": [_part(d) for d in documents]}
        if top_n is not None:
            body["top_n"] = top_n
        if instruction is not None:
            body["instruction"] = instruction
        return json.loads(self._engine.pool("rerank", json.dumps(body)))["results"]

    def stream(self, messages: Sequence[Dict[str, Any]], **options: Any) -> Stream:
        """``chat``, piece by piece:

            >>> s = engine.stream([{"role": "user", "content": "Hi"}], max_tokens=4)
            >>> text = "".join(d.text for d in s if not d.reasoning)
            >>> s.result.text == text
            True
        """
        return Stream(self._engine.stream(_body(messages, options, True)))


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8080, api_key: Optional[str] = None) -> None:
    """Serves the OpenAI, Anthropic and web chat API of ``vl serve`` over ``engine`` until
    interrupted (SIGINT / SIGTERM)."""
    _serve(engine._engine, host, port, api_key)
