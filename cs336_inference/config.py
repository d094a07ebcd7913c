"""ModelConfig: one dataclass for every model and attention variant in the lecture.

Notation (used everywhere in this package):
    B batch, T query tokens, S key/value tokens, D d_model, F d_ff,
    N query heads, K key/value heads, H head dim, L layers, V vocabulary.

The attention variant is chosen by the fields, not by a class hierarchy:

    MHA        n_kv_heads == n_heads                (K = N)
    MQA        n_kv_heads == 1                      (K = 1)
    GQA        1 < n_kv_heads < n_heads             (N / K query heads share one K/V head)
    sliding    sliding_window = W                   (key j visible to query i iff i - W < j <= i)
    hybrid     layer_types = ["sliding_attention" | "full_attention", ...] (one per layer)
    CLA        kv_share = c                         (c consecutive layers share one layer's K/V)
    MLA        kv_lora_rank is set                  (DeepSeek-V2/V3 latent attention)
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "deepseek_v3", "cs336")


class ConfigError(ValueError):
    """A configuration that cannot describe a working model."""


# Integer fields: name -> (smallest allowed value, whether None is allowed). A bool is not an integer.
INT_FIELDS: dict[str, tuple[int, bool]] = {
    "vocab_size": (1, False),
    "d_model": (1, False),
    "n_layers": (1, False),
    "n_heads": (1, False),
    "n_kv_heads": (1, True),
    "head_dim": (1, True),
    "d_ff": (1, False),
    "max_seq_len": (1, False),
    "sliding_window": (1, True),
    "kv_share": (1, False),
    "kv_lora_rank": (1, True),
    "q_lora_rank": (1, True),
    "qk_rope_head_dim": (0, False),
    "qk_nope_head_dim": (0, False),
    "v_head_dim": (0, False),
    "bos_token_id": (0, True),
}
POSITIVE_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")
BOOL_FIELDS = ("tie_embeddings", "qkv_bias", "rope_interleave")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class ModelConfig:
    vocab_size: int = 32000  # V
    d_model: int = 512  # D
    n_layers: int = 4  # L
    n_heads: int = 8  # N
    n_kv_heads: int | None = None  # K (None: K = N, plain multi-head attention)
    head_dim: int | None = None  # H (None: D // N)
    d_ff: int = 1376  # F
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 puts a bias on the q/k/v projections
    # Sliding window and hybrid local/global attention.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # Cross-layer attention: groups of kv_share consecutive layers use the first one's K/V.
    kv_share: int = 1
    # Multi-head latent attention (DeepSeek-V2/V3); active when kv_lora_rank is set.
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # DeepSeek checkpoints store rotary pairs interleaved
    # Bookkeeping (not architecture).
    model_type: str = "cs336"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._check_types()
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "set head_dim explicitly or choose a dividing head count"
                )
            self.head_dim = self.d_model // self.n_heads
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
        self.validate()

    # ----------------------------------------------------------------- checks
    def _check_types(self) -> None:
        """Type and range of every scalar field (ConfigError), so that no later arithmetic meets a
        string, a float or a zero; integers of other origins (numpy, JSON) become Python ints."""
        for name, (low, optional) in INT_FIELDS.items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            if not _is_int(value) or value < low:
                none = " or None" if optional else ""
                raise ConfigError(f"{name} must be an integer >= {low}{none}, got {value!r}")
            setattr(self, name, int(value))
        for name in POSITIVE_FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
            setattr(self, name, float(value))
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        eos = self.eos_token_id
        eos_ids = eos if isinstance(eos, list | tuple) else [eos] if eos is not None else []
        if not all(_is_int(i) and i >= 0 for i in eos_ids):
            raise ConfigError(f"eos_token_id must be an integer >= 0, a list of them, or None, got {eos!r}")
        if self.layer_types is not None and (
            isinstance(self.layer_types, str) or not all(isinstance(t, str) for t in self.layer_types)
        ):
            raise ConfigError(f"layer_types must be a list of strings, got {self.layer_types!r}")
        if not isinstance(self.model_type, str):
            raise ConfigError(f"model_type must be a string, got {self.model_type!r}")

    def validate(self) -> None:
        self._check_types()
        if self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads} "
                "(each K/V head must serve the same number of query heads)"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}"
                )
            bad = sorted(set(self.layer_types) - {SLIDING, FULL})
            if bad:
                raise ConfigError(f"layer_types may only hold {SLIDING!r} / {FULL!r}, got {bad}")
            if SLIDING in self.layer_types and self.sliding_window is None:
                raise ConfigError("layer_types has sliding layers but sliding_window is not set")
        if self.kv_share > 1 and self.layer_types is not None:
            for i in range(self.n_layers):
                if self.layer_types[i] != self.layer_types[self.kv_owner(i)]:
                    raise ConfigError(
                        f"layer {i} shares K/V with layer {self.kv_owner(i)} of another layer type"
                    )
        if self.is_mla:
            for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ConfigError(f"MLA needs a positive {name}, got {getattr(self, name)}")
            if self.qk_rope_head_dim % 2:
                raise ConfigError("qk_rope_head_dim must be even (rotary pairs)")
            if self.kv_share != 1:
                raise ConfigError("cross-layer sharing (kv_share > 1) is not combined with MLA here")
            if self.sliding_window is not None:
                raise ConfigError("a sliding window is not combined with MLA here")
        elif self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    # ------------------------------------------------------------ derived facts
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def variant(self) -> str:
        """A short name for the attention variant (for tables and tests)."""
        if self.is_mla:
            return "mla"
        if self.kv_share > 1:
            return "cla"
        if self.layer_types is not None and len(set(self.layer_types)) > 1:
            return "hybrid"
        if self.sliding_window is not None:
            return "sliding"
        if self.n_kv_heads == self.n_heads:
            return "mha"
        if self.n_kv_heads == 1:
            return "mqa"
        return "gqa"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window W of this layer, or None for full (global) attention."""
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer] == SLIDING else None
        return self.sliding_window

    def kv_owner(self, layer: int) -> int:
        """The layer whose K/V this layer reads (itself unless CLA shares it)."""
        return layer - layer % self.kv_share

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    # ------------------------------------------------------------- conversion
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("extra")
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {unknown}")
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (llama, mistral, qwen2, deepseek_v3)."""
        model_type = hf.get("model_type")
        if model_type == "cs336":
            fields = {k: v for k, v in hf.items() if k not in ("model_type", "architectures")}
            return cls.from_dict({**fields, "model_type": "cs336"})
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            kw: dict[str, Any] = dict(
                vocab_size=hf["vocab_size"],
                d_model=hf["hidden_size"],
                n_layers=hf["num_hidden_layers"],
                n_heads=hf["num_attention_heads"],
                n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                d_ff=hf["intermediate_size"],
            )
        except KeyError as e:
            raise ConfigError(f"config.json for {model_type} lacks the field {e.args[0]!r}") from None
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"rope scaling {rope_type!r} is not supported (only plain RoPE)")
        kw.update(
            head_dim=hf.get("head_dim"),
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        if model_type == "llama" and hf.get("attention_bias"):
            raise ConfigError("llama attention_bias=True is not supported")
        if model_type == "qwen2":
            kw["qkv_bias"] = True
            layer_types = hf.get("layer_types")
            if layer_types is None and hf.get("use_sliding_window"):
                first_full = hf.get("max_window_layers", kw["n_layers"])
                layer_types = [SLIDING if i >= first_full else FULL for i in range(kw["n_layers"])]
            if layer_types is not None and SLIDING in layer_types:
                kw["layer_types"] = layer_types
                kw["sliding_window"] = hf["sliding_window"]
        if model_type == "mistral":
            kw["sliding_window"] = hf.get("sliding_window")
            if hf.get("layer_types") is not None:
                kw["layer_types"] = hf["layer_types"]
        if model_type == "deepseek_v3":
            dense_layers = hf.get("first_k_dense_replace", 0)
            if hf.get("n_routed_experts") and (dense_layers or 0) < kw["n_layers"]:
                raise ConfigError(
                    "deepseek_v3 configs with MoE layers are not supported: only dense MLP layers "
                    f"(first_k_dense_replace={dense_layers} < num_hidden_layers={kw['n_layers']})"
                )
            if hf.get("attention_bias"):
                raise ConfigError("deepseek_v3 attention_bias=True is not supported")
            kw.update(
                head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
                kv_lora_rank=hf["kv_lora_rank"],
                q_lora_rank=hf.get("q_lora_rank"),
                qk_rope_head_dim=hf["qk_rope_head_dim"],
                qk_nope_head_dim=hf["qk_nope_head_dim"],
                v_head_dim=hf["v_head_dim"],
                rope_interleave=bool(hf.get("rope_interleave", True)),
            )
        if kw["head_dim"] is None:
            kw.pop("head_dim")
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict: the Hugging Face format of model_type when it holds every field,
        else our own format (model_type "cs336"), e.g. for CLA or a hybrid Llama."""
        own = {**self.to_dict(), "model_type": "cs336", "architectures": ["CS336TransformerLM"]}
        if self.model_type == "cs336":
            return own
        hf = self._hf_fields()
        try:
            lossless = ModelConfig.from_hf(hf).to_dict() == self.to_dict()
        except ConfigError:
            lossless = False
        return hf if lossless else own

    def _hf_fields(self) -> dict[str, Any]:
        hf: dict[str, Any] = dict(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.d_model,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.d_ff,
            max_position_embeddings=self.max_seq_len,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_embeddings,
            hidden_act="silu",
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )
        if self.model_type == "mistral":
            hf["sliding_window"] = self.sliding_window
        if self.model_type == "qwen2" and self.layer_types is not None:
            hf.update(
                use_sliding_window=True, sliding_window=self.sliding_window, layer_types=self.layer_types
            )
        if self.model_type == "deepseek_v3":
            hf.update(
                kv_lora_rank=self.kv_lora_rank,
                q_lora_rank=self.q_lora_rank,
                qk_rope_head_dim=self.qk_rope_head_dim,
                qk_nope_head_dim=self.qk_nope_head_dim,
                v_head_dim=self.v_head_dim,
                rope_interleave=self.rope_interleave,
                first_k_dense_replace=self.n_layers,  # every layer dense (no MoE)
            )
            hf.pop("head_dim")
        return hf

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf(), indent=2) + "\n")
