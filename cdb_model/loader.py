"""Load a looped LM from a preset name or a local Hugging Face-style folder (never the network).

A folder holds the released ``config.json`` and either one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; optionally ``generation_config.json`` (its ``eos_token_id``s join the stop ids)
and the tokenizer files (``tokenizer.json`` + ``tokenizer_config.json``: ``HFTokenizer``; none: the byte
tokenizer). Only the weights of the requested stages are read; the checkpoint's key set and shapes are
nevertheless checked in full (headers only) so a broken checkpoint fails early with a named problem.
``check_source`` is the cheap version of those checks (files present, config parsed) for a launcher to run before
it starts any process.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from cdb_model.config import CheckpointError, ModelConfig, UnknownModelTypeError
from cdb_model.generation import GenerationConfigError, GenerationDefaults, read_generation_defaults
from cdb_model.presets import build_preset, preset_config, preset_names
from cdb_model.tokenizer import (
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerLoadError,
)
from cdb_scheduler.plan import Stage

if TYPE_CHECKING:  # (torch, safetensors and the model classes are imported where weights are read: a process that
    # reads only configs and tokenizers, the scheduler's, starts without them)
    import torch

    from cdb_model.base import LoopedLM

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "GenerationConfigError",
    "MissingConfigError",
    "MissingTensorsError",
    "MissingWeightsError",
    "ShapeMismatchError",
    "TokenizerLoadError",
    "UnexpectedTensorsError",
    "UnknownModelTypeError",
    "check_source",
    "expected_tensors",
    "is_preset",
    "load_config",
    "load_generation_defaults",
    "load_model",
    "load_tokenizer",
]

# Models shipped with the project: ``models/<name>`` of the source tree (or of the working directory, as in the image).
SHIPPED_MODELS = (Path(__file__).resolve().parents[1] / "models", Path("models"))
DEFAULT_MODEL = "ouro-kjv"  # the trained model ``cdb serve`` and ``cdb demo`` start with

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointNotFoundError(CheckpointError):
    """The checkpoint folder does not exist (and the source is no preset name)."""


class MissingConfigError(CheckpointError):
    """``config.json`` is absent, unreadable, lacks a required field or holds an invalid value."""


class MissingWeightsError(CheckpointError):
    """No weights file, or a shard named in the index is absent."""


class MissingTensorsError(CheckpointError):
    """Tensors the model needs are not in the checkpoint."""


class UnexpectedTensorsError(CheckpointError):
    """The checkpoint holds tensors the model does not know."""


class ShapeMismatchError(CheckpointError):
    """A tensor's shape differs from the one the config implies."""


def _names(names: Iterable[str], limit: int = 20) -> str:
    s = sorted(names)
    more = f" ... and {len(s) - limit} more" if len(s) > limit else ""
    return ", ".join(s[:limit]) + more


def resolve_source(source: str) -> str:
    """The folder of a shipped model's name (``ouro-kjv``); a preset name or a path is returned unchanged."""
    if source in preset_names() or Path(source).exists() or "/" in source:
        return source
    for base in SHIPPED_MODELS:
        if (base / source / "config.json").is_file():
            return str(base / source)
    return source


def shipped_models() -> list[str]:
    """The names of the models shipped with the project (folders of ``models/`` with a ``config.json``)."""
    names = {p.parent.name for base in SHIPPED_MODELS if base.is_dir() for p in base.glob("*/config.json")}
    return sorted(names)


def is_preset(source: str | Path) -> bool:
    """True for a built-in preset name (random weights, no files)."""
    return isinstance(source, str) and source in preset_names()


def _folder(source: str | Path) -> Path:
    path = Path(resolve_source(str(source)))
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint folder {str(path)!r} does not exist and is not a preset ({', '.join(preset_names())})"
        )
    return path


def load_config(folder: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of a preset name, a shipped model or a checkpoint folder (its ``config.json``; the
    ``eos_token_id``s of its ``generation_config.json`` join the stop ids)."""
    if is_preset(folder):
        return preset_config(str(folder))
    path = _folder(folder)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise MissingConfigError(f"missing config.json in checkpoint folder {str(path)!r}")
    try:
        d = json.loads(cfg_path.read_text())
        config = ModelConfig.from_hf(d, name=path.name)
    except json.JSONDecodeError as e:
        raise MissingConfigError(f"{cfg_path} is not valid JSON: {e}") from e
    except KeyError as e:
        raise MissingConfigError(f"{cfg_path} lacks the required field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise MissingConfigError(f"{cfg_path} holds an invalid value: {e}") from e
    extra = read_generation_defaults(path).eos_token_ids
    stop = tuple(dict.fromkeys([*config.stop_token_ids, *(t for t in extra if t < config.vocab_size)]))
    return replace(config, stop_token_ids=stop) if stop != config.stop_token_ids else config


def load_generation_defaults(source: str | Path) -> GenerationDefaults:
    """A checkpoint's ``generation_config.json`` (stop ids, sampling defaults); presets and folders without the
    file: the empty defaults (greedy)."""
    if is_preset(source):
        return GenerationDefaults()
    return read_generation_defaults(_folder(source))


def check_source(source: str | Path) -> ModelConfig:
    """Cheap checks of a model source before anything is started: a preset, or a folder whose ``config.json``
    parses, whose weight files (the single file, or the index and every shard it names) exist, and whose
    ``generation_config.json`` and ``tokenizer_config.json`` (if any) parse. Raises the ``CheckpointError``
    subclass naming the problem."""
    config = load_config(source)
    if is_preset(source):
        return config
    path = _folder(source)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise MissingWeightsError(f"{index} is not a valid safetensors index: {e!r}") from e
        absent = [f for f in shards if not (path / f).is_file()]
        if absent:
            raise MissingWeightsError(f"missing weights shard(s) named in {INDEX_FILE}: {', '.join(absent)}")
    elif not (path / SINGLE_FILE).is_file():
        raise MissingWeightsError(f"missing weights file: neither {SINGLE_FILE} nor {INDEX_FILE} in {str(path)!r}")
    tok_cfg = path / TOKENIZER_CONFIG
    if tok_cfg.is_file():
        try:
            if not isinstance(json.loads(tok_cfg.read_text()), dict):
                raise TokenizerLoadError(f"{tok_cfg} must hold a JSON object")
        except json.JSONDecodeError as e:
            raise TokenizerLoadError(f"{tok_cfg} is not valid JSON: {e}") from e
    return config


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the full model under its upstream name, with the shape ``config`` implies (built on
    the meta device: no memory, no weights)."""

    from cdb_model.models import build_empty

    return {k: tuple(t.shape) for k, t in build_empty(config).state_dict().items()}


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it (from the index, or the single ``model.safetensors``)."""
    from safetensors import safe_open

    index = path / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = {f: path / f for f in set(weight_map.values())}
        absent = sorted(f for f, p in files.items() if not p.is_file())
        if absent:
            raise MissingWeightsError(f"missing weights shard(s) named in {INDEX_FILE}: {', '.join(absent)}")
        located: dict[str, Path] = {}
        for p in files.values():
            with safe_open(str(p), framework="pt") as f:
                located.update((k, p) for k in f.keys())  # noqa: SIM118 - safe_open has no __iter__
        return located
    single = path / SINGLE_FILE
    if not single.is_file():
        raise MissingWeightsError(f"missing weights file: neither {SINGLE_FILE} nor {INDEX_FILE} in {str(path)!r}")
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}  # noqa: SIM118


def _shapes(located: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for p in set(located.values()):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                out[k] = tuple(f.get_slice(k).get_shape())
    return out


def _load_folder(path: Path, dtype: torch.dtype, device: torch.device | str, stages: set[Stage] | None) -> LoopedLM:
    from safetensors import safe_open
    from tqdm import tqdm

    from cdb_model.models import build_empty

    config = load_config(path)
    located = _weight_files(path)
    if config.arch == "ouro" and "model.lookahead_exit_gate.weight" in located:
        config = replace(config, has_lookahead_gate=True)
    full = expected_tensors(config)
    model = build_empty(config, stages)
    want = model.state_dict()

    # Names in the file -> names in the model. Tied heads: the file's duplicate lm_head.weight is ignored, or
    # used as the embedding when the embedding itself is absent. Huginn's stored RoPE table is ignored.
    source = {k: k for k in located}
    ignored = {"freqs_cis"} if config.arch == "huginn" else set()
    if config.tie_embeddings and "lm_head.weight" in located:
        embed = "model.embed_tokens.weight" if config.arch == "ouro" else "transformer.wte.weight"
        if embed not in located:
            source[embed] = "lm_head.weight"
        ignored.add("lm_head.weight")
    missing = set(full) - set(source)
    if missing:
        raise MissingTensorsError(f"checkpoint {str(path)!r} lacks tensors: {_names(missing)}")
    unexpected = set(located) - set(full) - ignored
    if unexpected:
        raise UnexpectedTensorsError(f"checkpoint {str(path)!r} has unexpected tensors: {_names(unexpected)}")
    shapes = _shapes(located)
    for name, shape in full.items():
        got = shapes[source[name]]
        if got != shape:
            raise ShapeMismatchError(
                f"tensor {source[name]!r}: checkpoint shape {list(got)} != shape {list(shape)} implied by config.json"
            )

    by_file: dict[Path, list[str]] = {}
    for name in want:
        by_file.setdefault(located[source[name]], []).append(name)
    sd: dict[str, torch.Tensor] = {}
    shards = tqdm(  # a bar on stderr for sharded checkpoints (a stage's log shows the final line)
        by_file.items(),
        total=len(by_file),
        desc=f"loading {path.name}",
        unit="shard",
        disable=len(by_file) < 2,
        file=sys.stderr,
        mininterval=1.0,
    )
    for p, names in shards:
        with safe_open(str(p), framework="pt") as f:
            for name in names:
                sd[name] = f.get_tensor(source[name]).to(device=device, dtype=dtype)
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def load_model(
    source: str,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    stages: set[Stage] | None = None,
) -> LoopedLM:
    """A preset name (``preset_names()``) or a local checkpoint folder -> ``LoopedLM`` holding only ``stages``
    (None: all), in ``dtype`` (None: float32). Raises a ``CheckpointError`` subclass naming the problem."""
    if source in preset_names():
        return build_preset(source, dtype=dtype, device=device, stages=stages)
    import torch

    return _load_folder(Path(resolve_source(source)), torch.float32 if dtype is None else dtype, device, stages)


def load_tokenizer(source: str, tokenizer: str = "") -> Tokenizer:
    """The tokenizer of a model source: a folder with ``tokenizer_config.json`` gets ``transformers``'
    ``AutoTokenizer`` (local files only), one with only ``tokenizer.json`` the ``tokenizers`` wrapper, presets and
    folders without tokenizer files the byte tokenizer. ``tokenizer``: another folder (or a ``tokenizer.json``
    file) to take it from (vLLM's ``--tokenizer``; ``CheckpointError`` when it holds none). Stop ids: the model
    config's (``load_config``)."""
    config = load_config(source)
    if tokenizer:
        path = Path(tokenizer).expanduser()
        if path.is_file():
            return HFTokenizer(path, config.stop_token_ids, config.vocab_size)
        if not ((path / TOKENIZER_CONFIG).is_file() or (path / TOKENIZER_JSON).is_file()):
            raise CheckpointError(f"--tokenizer {tokenizer}: no {TOKENIZER_CONFIG} or {TOKENIZER_JSON} there")
    elif is_preset(source):
        return ByteTokenizer(config.vocab_size, config.stop_token_ids)
    else:
        path = _folder(source)
    if (path / TOKENIZER_CONFIG).is_file():
        return HFTokenizer(path, config.stop_token_ids, config.vocab_size)
    if (path / TOKENIZER_JSON).is_file():
        return HFTokenizer(path / TOKENIZER_JSON, config.stop_token_ids, config.vocab_size)
    return ByteTokenizer(config.vocab_size, config.stop_token_ids)
