"""Model configuration shared by Ouro and Huginn, parsed from the released ``config.json`` field names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Arch = Literal["ouro", "huginn"]

# Huginn (huginn-0125) special ids: <|begin_text|>, <|end_text|>, <|end_turn|>.
_HUGINN_STOP_IDS = (65504, 65505, 65508)
# Ouro (SmolLM tokenizer): <|endoftext|> and <|im_end|>; the release sets bos = eos = pad = 0.
_OURO_STOP_IDS = (0, 2)


class CheckpointError(Exception):
    """A checkpoint folder cannot be loaded; the message names the problem."""


class UnknownModelTypeError(CheckpointError, ValueError):
    """``config.json`` names a ``model_type`` this project does not serve."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the stage modules need to know about a looped model.

    Ouro is fully looped (``num_prelude_layers == num_coda_layers == 0``); Huginn has prelude and coda blocks
    around a recurrent core. ``max_depth`` is the trained / default number of loop steps.
    """

    arch: Arch
    name: str
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_prelude_layers: int
    num_loop_layers: int
    num_coda_layers: int
    rope_theta: float
    norm_eps: float
    max_positions: int
    max_depth: int
    tie_embeddings: bool
    has_lookahead_gate: bool = False
    stop_token_ids: tuple[int, ...] = ()
    early_exit_threshold: float = 1.0

    def __post_init__(self) -> None:
        if self.arch not in ("ouro", "huginn"):
            raise ValueError(f"arch must be 'ouro' or 'huginn', got {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.arch == "ouro" and (self.num_prelude_layers or self.num_coda_layers):
            raise ValueError("Ouro has no prelude / coda layers")
        if self.arch == "huginn" and self.num_kv_heads != self.num_heads:
            raise ValueError("Huginn has no grouped-query attention")

    @property
    def bank_width(self) -> int:
        """Width of one hidden-state bank row: Ouro ``hidden``; Huginn ``2 * n_embd`` = [state | injection]."""
        return self.hidden_size if self.arch == "ouro" else 2 * self.hidden_size

    @property
    def prelude_is_embedding(self) -> bool:
        """The prelude is a pure embedding lookup (Ouro: no layers, no KV), so the head stage can run it for a
        successor right after sampling its input (a fused refill)."""
        return self.arch == "ouro"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, loop_slots: int, dtype_bytes: int) -> int:
        """KV-cache bytes of one position: K and V of every prelude and coda layer (Huginn), and of every loop
        layer in each of its ``loop_slots`` depth slots (the KV policy's ``KVLayout.n_slots``)."""
        layers = self.num_prelude_layers + self.num_coda_layers + self.num_loop_layers * loop_slots
        return 2 * self.kv_size * dtype_bytes * layers

    def param_counts(self) -> tuple[int, int]:
        """(F0, Fr): parameters of the non-looped compute and of ONE loop step.

        Ouro: F0 = final norm + LM head; Fr = all layers + final norm + exit gate(s).
        Huginn: F0 = prelude blocks + coda blocks + ln_f + LM head; Fr = adapter + core blocks.
        Embedding lookups are excluded; a tied head counts as the head.
        """
        prelude, loop, head = self.stage_param_counts()
        return prelude + head, loop

    def stage_param_counts(self) -> tuple[int, int, int]:
        """Parameters each stage reads per op: (prelude, one loop step, head); embedding lookups excluded
        (Ouro's prelude reads none)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        if self.arch == "ouro":
            attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
            layer = attn + 3 * h * i + 4 * h
            gates = (h + 1) * (2 if self.has_lookahead_gate else 1)
            return 0, self.num_loop_layers * layer + h + gates, h + v * h
        block = 3 * h * h + 2 * self.q_size + h * h + 3 * h * i + 4 * h
        prelude, head = self.num_prelude_layers * block, self.num_coda_layers * block + h + v * h
        return prelude, 2 * h * h + self.num_loop_layers * block, head

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], name: str = "") -> ModelConfig:
        """Parse a released ``config.json`` (``model_type`` "ouro" or "huginn_raven")."""
        model_type = d.get("model_type")
        if model_type == "ouro":
            return cls._from_ouro(d, name or "ouro")
        if model_type == "huginn_raven":
            return cls._from_huginn(d, name or "huginn")
        raise UnknownModelTypeError(
            f"unknown model_type {model_type!r} in config.json (supported: 'ouro', 'huginn_raven')"
        )

    @classmethod
    def _from_ouro(cls, d: Mapping[str, Any], name: str) -> ModelConfig:
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        vocab = int(d["vocab_size"])
        return cls(
            arch="ouro",
            name=name,
            vocab_size=vocab,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d["intermediate_size"]),
            num_prelude_layers=0,
            num_loop_layers=int(d["num_hidden_layers"]),
            num_coda_layers=0,
            rope_theta=float(d.get("rope_theta", 10000.0)),
            norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_positions=int(d.get("max_position_embeddings", 4096)),
            max_depth=int(d.get("total_ut_steps", 4)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            has_lookahead_gate=bool(d.get("has_lookahead_gate", False)),
            stop_token_ids=_stop_ids(_OURO_STOP_IDS, d, vocab),
            early_exit_threshold=float(d.get("early_exit_threshold", 1.0)),
        )

    @classmethod
    def _from_huginn(cls, d: Mapping[str, Any], name: str) -> ModelConfig:
        hidden = int(d["n_embd"])
        heads = int(d.get("n_heads") or d["num_attention_heads"])
        vocab = int(d.get("padded_vocab_size") or d["vocab_size"])
        return cls(
            arch="huginn",
            name=name,
            vocab_size=vocab,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=int(d["intermediate_size"]),
            num_prelude_layers=int(d["n_layers_in_prelude"]),
            num_loop_layers=int(d["n_layers_in_recurrent_block"]),
            num_coda_layers=int(d["n_layers_in_coda"]),
            rope_theta=float(d.get("rope_base", 50000)),
            norm_eps=float(d.get("norm_eps", 1e-6)),
            max_positions=int(d.get("block_size", 4096)),
            max_depth=int(d.get("mean_recurrence", 32)),
            tie_embeddings=bool(d.get("tie_embeddings", True)),
            has_lookahead_gate=False,
            stop_token_ids=_stop_ids(_HUGINN_STOP_IDS, d, vocab),
            early_exit_threshold=0.0,  # latent-diff q = 0: never exit early (full depth)
        )


def _stop_ids(defaults: tuple[int, ...], d: Mapping[str, Any], vocab: int) -> tuple[int, ...]:
    """Architecture default stop ids plus the config's ``eos_token_id``(s), limited to the vocabulary."""
    ids = list(defaults)
    eos = d.get("eos_token_id")
    for t in eos if isinstance(eos, list) else [eos]:
        if isinstance(t, int) and t not in ids:
            ids.append(t)
    return tuple(t for t in ids if 0 <= t < vocab)
