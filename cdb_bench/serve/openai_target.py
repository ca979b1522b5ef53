"""An OpenAI-compatible server as the target of the open-loop driver (``cdb bench serve --base-url URL``): a cdb
started separately, or any other server that streams completions.

Each request is one streamed call (``stream: true`` with ``stream_options.include_usage``) to ``/v1/completions``
(a prompt of text or token ids) or ``/v1/chat/completions`` (the prompt as one user message), greedy, with
``max_tokens`` the request's output length and, unless turned off, ``ignore_eos`` so the server generates exactly
that many. The SSE events are read as they arrive (``httpx2``): a cdb server reports each token with its served
depth (the ``cdb.depths`` extension of a chunk), so each gets its own arrival time; from another server each chunk
that carries text counts as one arrival, and the generated tokens are the server's ``usage``. A request fails on
an HTTP error status, an ``error`` event, a finish reason other than a normal end, or a stream that ends early.

Queue counters come from the server's Prometheus ``/metrics`` when it exposes cdb's or vLLM's queue gauges;
otherwise the run has no queue samples.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from cdb_bench.serve.driver import StreamItem
from cdb_bench.serve.metrics import Usage
from cdb_bench.serve.requests import ServeRequest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# (waiting, running) gauges of the servers whose queue counters are read: cdb's, vLLM's
QUEUE_GAUGES = (
    ("cdb_requests_waiting", "cdb_requests_running"),
    ("vllm:num_requests_waiting", "vllm:num_requests_running"),
)
_FAILED = {"abort", "cancelled", "error"}


@dataclass(frozen=True, slots=True)
class OpenAIServer:
    """Where and how to call: ``root`` is the base URL without a trailing ``/v1``."""

    root: str
    endpoint: str
    model: str
    api_key: str | None = None
    timeout: float = 600.0
    ignore_eos: bool = True

    @staticmethod
    def root_of(base_url: str) -> str:
        """``http://host:8000`` for ``http://host:8000``, ``http://host:8000/`` or ``http://host:8000/v1``."""
        root = base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, req: ServeRequest) -> dict[str, Any]:
        """The request body of ``req``."""
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
            "max_tokens": req.max_tokens,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "/v1/chat/completions":
            if not isinstance(req.prompt, str):
                raise ValueError("the chat endpoint sends text prompts: use --dataset-path")
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt_arg()
        return body


def list_models(root: str, api_key: str | None, timeout: float = 30.0) -> list[dict[str, Any]]:
    """``GET /v1/models``: the served models' cards (``id``, and ``max_model_len`` where the server says)."""
    server = OpenAIServer(root, ENDPOINTS[0], "", api_key)
    try:
        resp = httpx2.get(f"{root}/v1/models", headers=server.headers(), timeout=timeout)
    except httpx2.HTTPError as exc:
        raise RuntimeError(f"GET {root}/v1/models: {exc}") from None
    if resp.status_code != 200:
        raise RuntimeError(f"GET {root}/v1/models: HTTP {resp.status_code}: {_message(resp.text)}")
    data = resp.json().get("data")
    if not isinstance(data, list) or not data:
        raise RuntimeError(f"GET {root}/v1/models: no model listed")
    return [m for m in data if isinstance(m, dict)]


def _message(text: str) -> str:
    """The ``error.message`` of an OpenAI error body, else the body itself (shortened)."""
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    except (ValueError, AttributeError):
        pass
    return text[:300]


def chunk_items(chunk: dict[str, Any]) -> tuple[list[StreamItem], str | None]:
    """The tokens (served depths, or None per text-carrying chunk of a server without them) and usage in one
    streamed chunk, and its finish reason (None until the last); raises on an ``error`` event."""
    if "error" in chunk:
        err = chunk["error"]
        raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
    items: list[StreamItem] = []
    finish = None
    for choice in chunk.get("choices") or ():
        depths = (choice.get("cdb") or {}).get("depths")
        if isinstance(depths, list):
            items.extend(int(d) for d in depths)
        else:
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                items.append(None)
        finish = choice.get("finish_reason") or finish
    usage = chunk.get("usage")
    if isinstance(usage, dict) and "completion_tokens" in usage:
        items.append(Usage(int(usage.get("prompt_tokens") or 0), int(usage["completion_tokens"])))
    return items, finish


class OpenAIConnection:
    """One run's HTTP client (a connection pool without a cap: the driver decides what is in flight)."""

    def __init__(self, server: OpenAIServer, transport: httpx2.AsyncBaseTransport | None = None) -> None:
        self.server = server
        self.client = httpx2.AsyncClient(
            base_url=server.root,
            headers=server.headers(),
            timeout=httpx2.Timeout(server.timeout, connect=min(30.0, server.timeout)),
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None),
            transport=transport,  # None: the network (tests hand in a mock)
        )
        self.queue_gauges: tuple[str, str] | None = None

    async def stream(self, req: ServeRequest) -> AsyncIterator[StreamItem]:
        finish = None
        body = self.server.body(req)
        async with self.client.sse(self.server.endpoint, method="POST", json=body) as events:
            resp = events.response
            if resp.status_code != 200:
                raise RuntimeError(
                    f"HTTP {resp.status_code}: {_message((await resp.aread()).decode(errors='replace'))}"
                )
            async for event in events:
                if event.data == "[DONE]":
                    break
                items, reason = chunk_items(json.loads(event.data))
                for item in items:
                    yield item
                finish = reason or finish
        if finish is None:
            raise RuntimeError("the stream ended before a finish reason")
        if finish in _FAILED:
            raise RuntimeError(f"finished with {finish}")

    async def probe_queue(self) -> bool:
        """Whether the server's ``/metrics`` has queue gauges this client reads (``queue`` then works)."""
        try:
            resp = await self.client.get("/metrics")
        except httpx2.HTTPError:
            return False
        if resp.status_code != 200:
            return False
        names = {s.name for fam in text_string_to_metric_families(resp.text) for s in fam.samples}
        self.queue_gauges = next((g for g in QUEUE_GAUGES if set(g) <= names), None)
        return self.queue_gauges is not None

    async def queue(self) -> tuple[int, int]:
        if self.queue_gauges is None:
            raise RuntimeError("the server exposes no queue gauges this client reads")
        resp = await self.client.get("/metrics")
        resp.raise_for_status()
        totals = dict.fromkeys(self.queue_gauges, 0.0)
        for fam in text_string_to_metric_families(resp.text):
            for s in fam.samples:
                if s.name in totals:
                    totals[s.name] += s.value  # summed over label sets (models, engines)
        waiting, running = self.queue_gauges
        return int(totals[waiting]), int(totals[running])

    async def close(self) -> None:
        await self.client.aclose()
