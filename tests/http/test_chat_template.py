"""``--chat-template`` (``CDB_CHAT_TEMPLATE``): a Jinja file or template that renders the HTTP API's chats instead
of the tokenizer's own, reported by ``/tokenizer_info``; checked (read, compiled) before the server starts."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from cdb.processes import process_resolution
from cdb_engine.config import RequestParams
from services.http.chat_template import ChatTemplateError, read_chat_template
from tests.http.harness import SETTINGS, TINY, served
from tests.http.tree import http_process_tree
from tests.services.tree import SHARED_CONFIG

pytestmark = pytest.mark.timeout(120)

# a plain "role: content" format, ending with the assistant's turn
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHAT = [{"role": "user", "content": "Who made the heaven?"}]
RENDERED = "user: Who made the heaven?\nassistant:"


@pytest.mark.parametrize("model", ["ouro-tiny", "ouro-kjv"])  # a byte tokenizer without a template; an HF one with
def test_the_given_template_renders_chats_tokenize_and_tokenizer_info(model: str, tmp_path: Path) -> None:
    file = tmp_path / "chat.jinja"
    file.write_text(TEMPLATE)
    with served(replace(TINY, model=model), settings=replace(SETTINGS, chat_template=str(file))) as api:
        tok = api.engine.tokenizer
        ids = tok.encode(RENDERED)
        status, _, raw = api.request("POST", "/tokenize", {"messages": CHAT})
        assert status == 200 and json.loads(raw)["tokens"] == ids
        status, _, raw = api.request("GET", "/tokenizer_info")
        assert json.loads(raw)["chat_template"] == TEMPLATE
        body = {"messages": CHAT, "max_tokens": 5, "temperature": 0}
        status, _, raw = api.request("POST", "/v1/chat/completions", body)
        out = json.loads(raw)
        assert status == 200, out
        assert out["usage"]["prompt_tokens"] == len(ids)
        reference = api.engine.generate([ids], RequestParams(max_tokens=5))[0]
        assert out["choices"][0]["message"]["content"] == reference.text


def test_an_inline_template_and_the_tokenizers_own_by_default() -> None:
    with served(replace(TINY, model="ouro-kjv"), settings=replace(SETTINGS, chat_template=TEMPLATE)) as api:
        status, _, raw = api.request("POST", "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
        assert status == 200
        assert json.loads(raw)["tokens"] == api.engine.tokenizer.encode("user: Who made the heaven?\n")
    with served(replace(TINY, model="ouro-kjv")) as api:
        status, _, raw = api.request("GET", "/tokenizer_info")
        assert status == 200
        assert json.loads(raw)["chat_template"] == getattr(api.engine.tokenizer, "chat_template", None)


def test_a_template_that_raises_refuses_the_chat_naming_messages() -> None:
    refusing = "{{ raise_exception('only one message, please') if messages|length > 1 else messages[0]['content'] }}"
    with served(TINY, settings=replace(SETTINGS, chat_template=refusing)) as api:
        status, _, raw = api.request("POST", "/v1/chat/completions", {"messages": CHAT * 2, "max_tokens": 2})
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "messages" and "only one message" in error["message"]


def test_a_missing_file_or_a_broken_template_is_refused_before_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ChatTemplateError, match="not a readable file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        read_chat_template("{% for m in messages %}{{ m }")
    assert read_chat_template("") is None
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    monkeypatch.chdir(tmp_path)
    resolved = process_resolution("scheduler", ["--chat-template", "t.jinja"], {})
    assert resolved.settings.chat_template == str(tmp_path / "t.jinja")  # absolute: a child may run elsewhere
    with pytest.raises(SystemExit):  # the parser's error (exit 2), naming the flag
        process_resolution("scheduler", ["--chat-template", "missing.jinja"], {})
    assert "--chat-template (or CDB_CHAT_TEMPLATE): chat template" in capsys.readouterr().err
    inline = process_resolution("scheduler", [], {"CDB_CHAT_TEMPLATE": TEMPLATE})
    assert inline.settings.chat_template == TEMPLATE
    from_env = process_resolution("scheduler", [], {"CDB_CHAT_TEMPLATE": "t.jinja"})
    assert from_env.settings.chat_template == str(tmp_path / "t.jinja")
    with pytest.raises(SystemExit):
        process_resolution("scheduler", [], {"CDB_CHAT_TEMPLATE": "{% if %}"})


@pytest.mark.slow
def test_the_template_reaches_the_scheduler_of_a_process_tree() -> None:
    with http_process_tree(replace(SHARED_CONFIG, model="ouro-kjv"), CDB_CHAT_TEMPLATE=TEMPLATE) as (_, base_url):
        root = base_url.removesuffix("/v1")
        with urllib.request.urlopen(f"{root}/tokenizer_info", timeout=30) as resp:
            assert json.loads(resp.read())["chat_template"] == TEMPLATE
