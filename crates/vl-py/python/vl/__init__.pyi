"""Type stubs of the vl package (see __init__.py for the documentation)."""

import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

class VlError(Exception):
    """An error from vl; its message is one line naming the field, file or limit."""

    param: Optional[str]
    status: int

class RequestError(VlError):
    """A request the engine refuses (the server would answer 400); ``param`` names the field."""

@dataclass
class ChatResult:
    text: str
    reasoning: Optional[str]
    tool_calls: List[Dict[str, Any]]
    finish_reason: str
    usage: Dict[str, Any]
    timings: Dict[str, float]
    grounding: Optional[Dict[str, Any]]
    logprobs: Optional[Dict[str, Any]]
    raw: Dict[str, Any]
    choices: List["ChatResult"]
    @property
    def boxes(self) -> List[Dict[str, Any]]: ...

@dataclass
class Delta:
    text: str
    choice: int = 0
    reasoning: bool = False

class Stream:
    result: Optional[ChatResult]
    def __iter__(self) -> Iterator[Delta]: ...
    def close(self) -> None: ...

class Engine:
    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        mmproj: str | os.PathLike[str] | None = None,
        quantize: Optional[str] = None,
        device: str = "cpu",
        parallel: int = 4,
        kv_cache_mib: Optional[int] = None,
        prefix_cache: bool = True,
        image_cache_mib: int = 256,
        media_dir: str | os.PathLike[str] | None = None,
        allow_remote_media: bool = False,
        draft_model: str | os.PathLike[str] | None = None,
        kv_cache_dtype: Optional[str] = None,
    ) -> None: ...
    @property
    def context(self) -> int: ...
    def chat(self, messages: Sequence[Dict[str, Any]], **options: Any) -> ChatResult: ...
    def stream(self, messages: Sequence[Dict[str, Any]], **options: Any) -> Stream: ...
    def embed(
        self, inputs: Sequence[Any], *, dimensions: Optional[int] = None, instruction: Optional[str] = None, **options: Any
    ) -> List[List[float]]: ...
    def rerank(
        self, query: Any, documents: Sequence[Any], *, top_n: Optional[int] = None, instruction: Optional[str] = None
    ) -> List[Dict[str, Any]]: ...

def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8080, api_key: Optional[str] = None) -> None: ...
