"""The OpenAI-compatible API of the real process tree (``cdb serve --http``): the official ``openai`` client streams a
chat completion and a completion from the deployment, with each token's served depth."""

from __future__ import annotations

import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_the_openai_client_streams_a_chat_completion_from_the_process_tree(kjv_http_tree: str) -> None:
    client = openai.OpenAI(base_url=kjv_http_tree, api_key="unused", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="ouro-kjv",
            messages=[{"role": "user", "content": "Who begat Enos?"}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            seed=3,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    assert chunks[-1].usage is not None and 0 < chunks[-1].usage.completion_tokens <= 12
    depths = [d for c in chunks if c.choices for d in (c.choices[0].model_extra or {}).get("cdb", {}).get("depths", [])]
    assert depths and all(1 <= d <= 4 for d in depths)
    done = client.completions.create(model="ouro-kjv", prompt="And God said", max_tokens=6, seed=1)
    assert done.usage is not None and done.usage.completion_tokens == 6 and done.choices[0].finish_reason == "length"
