"""A checkpoint folder's own tokenizer: through ``transformers.AutoTokenizer`` with local files only (no network),
its special tokens and chat template, its ``generation_config.json`` stop ids honoured in generation, and streaming
detokenization over it. The folder is built here: the golden ``ouro-tiny`` weights with a byte-level BPE trained
in the test."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from cdb_engine.config import EngineConfig, RequestParams
from cdb_engine.detokenizer import Detokenizer
from cdb_engine.engine import Engine
from cdb_engine.errors import InvalidRequest
from cdb_model.generation import GenerationConfigError, GenerationDefaults
from cdb_model.loader import (
    CheckpointNotFoundError,
    load_config,
    load_generation_defaults,
    load_model,
    load_tokenizer,
)
from cdb_model.tokenizer import SPECIAL_TOKENS, ByteTokenizer, HFTokenizer
from cdb_scheduler.request import FinishReason

from .conftest import golden_dir

# The reference AutoTokenizer reads the checkpoint's config.json, whose rope_scaling field transformers deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")

ROOT = Path(__file__).resolve().parents[2]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who made the light?"}]
TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "  leading spaces, tabs\tand\nnew lines",
    "Ünïcödé, émojis 🙂 and <|im_start|>special<|im_end|> tokens<|endoftext|>",
    "",
]


def train_bpe(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with Ouro's special tokens at ids 0, 1, 2, trained on a little text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = (ROOT / "models" / "ouro-kjv" / "heldout_sample.txt").read_text().splitlines()
    tok.train_from_iterator(corpus * 4, trainer)
    return tok


def tokenizer_config(chat_template: str | None = CHATML) -> dict:
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    added = {str(i): {"content": t, **flags} for i, t in enumerate(SPECIAL_TOKENS)}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
    }
    return cfg | ({"chat_template": chat_template} if chat_template else {})


def make_folder(folder: Path, chat_template: str | None = CHATML, generation: dict | None = None) -> Path:
    """The golden ouro-tiny checkpoint (vocab 512) with a trained tokenizer and the given generation config."""
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(golden_dir("ouro-tiny") / name, folder / name)
    train_bpe(400).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(chat_template)))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_folder(tmp_path_factory.mktemp("ckpt") / "tiny", generation={"eos_token_id": [0, 2]})


@pytest.fixture(scope="module")
def reference(folder: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to resolve a host name or open a connection fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_encoding_and_decoding_equal_auto_tokenizers(folder: Path, reference, no_network: None) -> None:  # type: ignore[no-untyped-def]
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 512  # the model's vocabulary
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert tok.encode("<|endoftext|><|im_start|><|im_end|>") == [0, 1, 2]
    assert tok.eos_token_id == reference.eos_token_id == 0
    assert tok.stop_token_ids == (0, 2)


def test_chat_template_ids(folder: Path, reference, no_network: None) -> None:  # type: ignore[no-untyped-def]
    tok = load_tokenizer(str(folder))
    ids = tok.apply_chat_template(CHAT)
    assert ids == reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho made the light?<|im_end|>\n"
    assert ids == tok.encode(rendered + "<|im_start|>assistant\n")
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|> x 3, <|im_end|> x 2: special ids, not text
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == tok.encode(rendered)


def test_chat_errors_are_invalid_requests(tmp_path: Path) -> None:
    bare = load_tokenizer(str(make_folder(tmp_path / "bare", chat_template=None)))
    with pytest.raises(InvalidRequest, match="has no chat template") as info:
        bare.apply_chat_template(CHAT)
    assert info.value.field == "messages"
    with pytest.raises(InvalidRequest, match="has no chat template"):
        ByteTokenizer().apply_chat_template(CHAT)
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user') }}"
    picky = load_tokenizer(str(make_folder(tmp_path / "picky", chat_template=strict + "{% endif %}")))
    with pytest.raises(InvalidRequest, match="must be the user"):
        picky.apply_chat_template(CHAT)
    for bad, why in (([], "non-empty list"), ([{"role": "user"}], "'content'"), (["hi"], "an object")):
        with pytest.raises(InvalidRequest, match=why):
            picky.apply_chat_template(bad)  # type: ignore[arg-type]


def test_loads_offline_without_any_network_access(folder: Path, tmp_path: Path) -> None:
    """In a fresh process with HF_HUB_OFFLINE=1, an empty Hugging Face cache and every socket refused, the folder's
    tokenizer loads and encodes like in this process; a hub-style name is refused as a missing folder."""
    script = f"""
import json, socket, sys
def refuse(*a, **k):
    raise SystemExit("network access attempted: " + repr(a))
socket.getaddrinfo = socket.create_connection = socket.socket.connect = refuse
from cdb_model.loader import CheckpointNotFoundError, load_tokenizer
tok = load_tokenizer({str(folder)!r})
try:
    load_tokenizer("ByteDance/Ouro-1.4B")
except CheckpointNotFoundError:
    pass
else:
    raise SystemExit("a hub name was accepted")
print(json.dumps([tok.encode(t) for t in {TEXTS!r}] + [tok.apply_chat_template({CHAT!r})]))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    tok = load_tokenizer(str(folder))
    assert json.loads(out.stdout) == [tok.encode(t) for t in TEXTS] + [tok.apply_chat_template(CHAT)]


def test_hub_style_names_are_folders_never_downloads(no_network: None) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_tokenizer("ByteDance/Ouro-1.4B")


def test_generation_config_stop_ids_end_generation(tmp_path: Path) -> None:
    """An id named only by generation_config.json's eos_token_id ends an in-process engine's generation there."""
    free = make_folder(tmp_path / "free", generation={"eos_token_id": 0})
    cfg = EngineConfig(model=str(free), dtype="float64", max_num_seqs=2, num_kv_blocks=64, kv_block_size=8)
    prompt = "And God said"
    with Engine(cfg) as eng:
        (run,) = eng.generate([prompt], RequestParams(max_tokens=24, ignore_eos=True))
    # The first generated token after index 0 that appears only once so far and is not a default stop id.
    k, stop = next((k, t) for k, t in enumerate(run.token_ids) if k > 0 and t not in (0, 2, *run.token_ids[:k]))
    stopping = make_folder(tmp_path / "stopping", generation={"eos_token_id": [0, stop]})
    assert load_config(str(stopping)).stop_token_ids == (0, 2, stop)
    with Engine(replace(cfg, model=str(stopping))) as eng:
        (got,) = eng.generate([prompt], RequestParams(max_tokens=24))
        (ignored,) = eng.generate([prompt], RequestParams(max_tokens=24, ignore_eos=True))
    assert got.token_ids == run.token_ids[: k + 1] and got.finish_reason is FinishReason.STOP
    assert ignored.token_ids == run.token_ids and ignored.finish_reason is FinishReason.LENGTH


def test_generation_defaults(folder: Path, tmp_path: Path) -> None:
    shipped = load_generation_defaults("ouro-kjv")
    assert shipped.eos_token_ids == (0, 2) and shipped.do_sample
    # The checkpoint's defaults for what a request leaves unset (top_k: transformers' own default with do_sample).
    assert shipped.sampling() == (0.8, 0.95, 50)
    assert shipped.sampling(temperature=0.0, top_k=0) == (0.0, 0.95, 0)  # the request's values win
    greedy = GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.7, "top_p": 0.9})
    assert greedy.sampling() == (0.0, 1.0, 0)  # without do_sample, transformers decodes greedily
    assert load_generation_defaults("ouro-tiny") == GenerationDefaults()
    for bad, name in (({"eos_token_id": "x"}, "eos_token_id"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k")):
        with pytest.raises(GenerationConfigError, match=name):
            GenerationDefaults.from_dict(bad)
    broken = make_folder(tmp_path / "broken")
    (broken / "generation_config.json").write_text("{not json")
    with pytest.raises(GenerationConfigError, match=r"generation_config\.json"):
        load_config(str(broken))


def test_streaming_detokenization_over_the_folder_tokenizer(folder: Path) -> None:
    tok = load_tokenizer(str(folder))
    text = " ".join(TEXTS[:3]) + " 🙂🙂 tail"
    ids = tok.encode(text)
    detok = Detokenizer(tok, ())
    streamed = "".join(detok.push(i)[0] for i in ids) + detok.flush()
    assert streamed == tok.decode(ids)
    stop = Detokenizer(tok, ("created the",))
    out, hit = "", False
    for i in ids:
        delta, hit = stop.push(i)
        out += delta
        if hit:
            break
    assert hit and out == "In the beginning God "


def test_the_shipped_model_serves_chat(no_network: None) -> None:
    """models/ouro-kjv: AutoTokenizer files with a ChatML template, and its stop ids from generation_config.json."""
    tok = load_tokenizer("ouro-kjv")
    assert isinstance(tok, HFTokenizer) and tok.chat_template is not None
    ids = tok.apply_chat_template([{"role": "user", "content": "Who made the light?"}])
    tail = tok.encode("<|im_start|>assistant\n")
    assert ids[0] == 1 and ids[-len(tail) :] == tail and ids.count(2) == 1
    assert load_config("ouro-kjv").stop_token_ids == (0, 2) == load_generation_defaults("ouro-kjv").eos_token_ids
    assert load_model("ouro-kjv").config.vocab_size == tok.vocab_size
