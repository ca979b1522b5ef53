"""The closed-loop streaming load of ``cdb bench apicost``, run in a process of its own (its CPU is not the
server's): ``python -m cdb_bench.apicost.load API ADDRESS MODEL CONCURRENCY PROMPT_TOKENS OUTPUT_TOKENS SECONDS
VOCAB SEED``.

Each of ``CONCURRENCY`` streams sends its next request when its last one ends, for ``SECONDS``: ``PROMPT_TOKENS``
random token ids, exactly ``OUTPUT_TOKENS`` generated (``ignore_eos``). ``http``: streamed ``/v1/completions`` read
by a minimal HTTP/1.1 client on asyncio streams (one keep-alive connection per stream, SSE events counted as they
come: the cheapest client, so that the figures are the server's); ``grpc``: the project's async gRPC client. It
prints ``ready`` once its streams are connected, then at the end the tokens it received as JSON.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable


def _request(model: str, prompt: list[int], max_tokens: int) -> bytes:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: cdb\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    )
    return head.encode() + b"\r\n\r\n" + body


async def _http_stream(reader: asyncio.StreamReader, counted: list[int]) -> None:
    """Read one chunked SSE response to its ``[DONE]``, counting the token chunks."""
    status = await reader.readline()
    if not status.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the server answered {status!r}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size + 2)
        counted[0] += data.count(b'"token_ids"')


async def _http(address: str, model: str, prompts: Callable[[], list[int]], n: int, counted: list[int]) -> Callable:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))

    async def one() -> None:
        writer.write(_request(model, prompts(), n))
        await _http_stream(reader, counted)

    return one


def _grpc(client: object, prompts: Callable[[], list[int]], n: int, counted: list[int]) -> Callable:
    async def one() -> None:
        async for _ in client.stream(prompts(), max_tokens=n, ignore_eos=True):  # type: ignore[attr-defined]
            counted[0] += 1

    return one


async def main(argv: list[str]) -> None:
    api, address, model = argv[0], argv[1], argv[2]
    concurrency, prompt_tokens, output_tokens = int(argv[3]), int(argv[4]), int(argv[5])
    seconds, vocab, seed = float(argv[6]), int(argv[7]), int(argv[8])
    rng = random.Random(seed)

    def prompts() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(prompt_tokens)]

    counted = [0]
    streams: list[Callable[[], Awaitable[None]]] = []
    if api == "http":
        for _ in range(concurrency):
            streams.append(await _http(address, model, prompts, output_tokens, counted))
    else:
        from clients.async_client import AsyncClient

        client = await AsyncClient(address, timeout=600).__aenter__()  # (one channel for every stream)
        streams = [_grpc(client, prompts, output_tokens, counted) for _ in range(concurrency)]
    print("ready", flush=True)
    end = time.monotonic() + seconds

    async def loop(one: Callable[[], Awaitable[None]]) -> None:
        while time.monotonic() < end:
            await one()

    await asyncio.gather(*(loop(one) for one in streams))
    print(json.dumps({"tokens": counted[0]}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
