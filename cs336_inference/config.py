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

The families people run differ from Llama by a few more switches (all off for Llama):

    rope_scaling            {"rope_type": "llama3" | "linear" | "yarn", ...}: long-context RoPE
    rope_freqs              a GGUF's per-frequency divisors (its rope_freqs tensor)
    partial_rotary_factor   rotate only the first H * factor dims of each head (Phi-4-mini)
    qk_norm                 RMSNorm on each head's queries and keys before RoPE (Qwen3, Gemma 3)
    head_dim                N x H may differ from D (Qwen3, Gemma 3)
    Gemma 3                 sandwich_norm (norms after attention and MLP too), mlp_act "gelu_tanh"
                            (GeGLU), query_pre_attn_scalar (the attention scale), embed_scale
                            (embeddings times sqrt(D)), rope_local_theta (the sliding layers' base)
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
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "gemma3",
    "phi3",
    "deepseek_v3",
    "cs336",
)
MLP_ACTS = ("silu", "gelu_tanh")  # SwiGLU, GeGLU


# rope_scaling type -> the numbers it needs (layers.rope_frequencies reads them)
ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


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
OPTIONAL_POSITIVE_FLOAT_FIELDS = ("rope_local_theta", "query_pre_attn_scalar")
BOOL_FIELDS = ("tie_embeddings", "qkv_bias", "rope_interleave", "qk_norm", "sandwich_norm", "embed_scale")


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
    # Switches of other families (module docstring); all off for Llama.
    rope_scaling: dict[str, Any] | None = None  # transformers' keys: rope_type, factor, ...
    rope_freqs: list[float] | None = None  # a GGUF's rope_freqs: frequency i divided by rope_freqs[i]
    rope_local_theta: float | None = None  # sliding layers' RoPE base, where it differs (Gemma 3)
    partial_rotary_factor: float = 1.0  # R = H * factor dims of each head rotated
    qk_norm: bool = False
    sandwich_norm: bool = False
    mlp_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) (None: 1/sqrt(H))
    embed_scale: bool = False
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
        for name in OPTIONAL_POSITIVE_FLOAT_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a number > 0 or None, got {value!r}")
            setattr(self, name, float(value))
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0 < f <= 1:
            raise ConfigError(f"partial_rotary_factor must be a number in (0, 1], got {f!r}")
        self.partial_rotary_factor = float(f)
        if self.mlp_act not in MLP_ACTS:
            raise ConfigError(f"mlp_act must be one of {', '.join(MLP_ACTS)}, got {self.mlp_act!r}")
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
            others = [
                n for n in ("rope_scaling", "rope_freqs", "qk_norm", "sandwich_norm") if getattr(self, n)
            ]
            if others or self.partial_rotary_factor != 1.0:
                raise ConfigError(f"MLA is not combined with {(others or ['partial_rotary_factor'])[0]} here")
        elif self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        elif self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ConfigError(
                f"partial_rotary_factor={self.partial_rotary_factor} rotates {self.rotary_dim} of "
                f"{self.head_dim} head dims; that must be a positive even number"
            )
        self._check_rope()

    def _check_rope(self) -> None:
        """rope_scaling holds a type rope_tables knows with the numbers it reads; rope_freqs has one
        divisor per rotary frequency."""
        if self.rope_scaling is not None:
            scaling = self.rope_scaling
            kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
            needs = ROPE_SCALING_KEYS.get(kind)
            if needs is None:
                raise ConfigError(
                    f"rope_scaling of type {kind!r} is not supported "
                    f"(supported: {', '.join(ROPE_SCALING_KEYS)})"
                )
            for key in needs:
                value = scaling.get(key)
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
                    raise ConfigError(f"rope_scaling[{key!r}] must be a number > 0, got {value!r}")
            self.rope_scaling = {**scaling, "rope_type": kind}
            self.rope_scaling.pop("type", None)
        if self.rope_freqs is not None:
            freqs = self.rope_freqs
            if not isinstance(freqs, list | tuple) or len(freqs) != self.rotary_dim // 2:
                got = len(freqs) if isinstance(freqs, list | tuple) else repr(freqs)
                raise ConfigError(f"rope_freqs must hold {self.rotary_dim // 2} numbers, got {got}")
            if not all(isinstance(x, numbers.Real) and 0 < x < math.inf for x in freqs):
                raise ConfigError("rope_freqs must hold numbers > 0")
            self.rope_freqs = [float(x) for x in freqs]

    # ------------------------------------------------------------ derived facts
    @property
    def rotary_dim(self) -> int:
        """R: the dims of each query/key head that RoPE rotates (H unless partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attn_scale(self) -> float:
        """The factor on q . k: 1/sqrt(H), or 1/sqrt(query_pre_attn_scalar) where Gemma sets one."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of this layer: rope_local_theta for sliding layers where set, else rope_theta."""
        if self.rope_local_theta is not None and self.layer_window(layer) is not None:
            return self.rope_local_theta
        return self.rope_theta

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
        """Build from a Hugging Face config.json dict (llama, mistral, qwen2, qwen3, gemma3_text, gemma3's
        text tower, phi3, deepseek_v3 with dense MLPs). A field the model cannot honour is a ConfigError
        that names it."""
        model_type = hf.get("model_type")
        if model_type == "cs336":
            fields = {k: v for k, v in hf.items() if k not in ("model_type", "architectures")}
            return cls.from_dict({**fields, "model_type": "cs336"})
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "gemma3":  # the multimodal checkpoint: we run its text tower
            text = dict(hf.get("text_config") or {})
            for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
                if key in hf and key not in text:
                    text[key] = hf[key]
            return cls.from_hf({**text, "model_type": "gemma3_text"})
        if model_type == "gemma3_text":  # its config.json leaves out fields at Gemma 3's defaults
            hf = {**GEMMA3_DEFAULTS, **hf}
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
        kw.update(
            head_dim=hf.get("head_dim"),
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            **_hf_rope(hf, model_type),
        )
        act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
        if act not in HF_ACTS:
            raise ConfigError(f"hidden_act {act!r} is not supported (silu or gelu_pytorch_tanh)")
        kw["mlp_act"] = HF_ACTS[act]
        for key in ("mlp_bias", "final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(key):
                raise ConfigError(f"{model_type} {key}={hf[key]!r} is not supported")
        if hf.get("attention_bias") and model_type != "qwen2":
            raise ConfigError(f"{model_type} attention_bias=True is not supported")
        if model_type in ("qwen2", "qwen3"):
            kw["qkv_bias"] = model_type == "qwen2"
            kw["qk_norm"] = model_type == "qwen3"
            layer_types = hf.get("layer_types")
            if layer_types is None and hf.get("use_sliding_window"):
                first_full = hf.get("max_window_layers", kw["n_layers"])
                layer_types = [SLIDING if i >= first_full else FULL for i in range(kw["n_layers"])]
            if layer_types is not None and SLIDING in layer_types and hf.get("use_sliding_window", True):
                kw["layer_types"] = layer_types
                kw["sliding_window"] = hf["sliding_window"]
        if model_type in ("mistral", "phi3"):
            kw["sliding_window"] = hf.get("sliding_window")
            if hf.get("layer_types") is not None:
                kw["layer_types"] = hf["layer_types"]
        if model_type == "gemma3_text":
            if hf.get("use_bidirectional_attention"):
                raise ConfigError("gemma3_text use_bidirectional_attention=True is not supported")
            pattern = hf.get("sliding_window_pattern", 6)
            layer_types = hf.get("layer_types") or [
                SLIDING if (i + 1) % pattern else FULL for i in range(kw["n_layers"])
            ]
            kw.update(
                layer_types=layer_types,
                sliding_window=hf["sliding_window"],
                qk_norm=True,
                sandwich_norm=True,
                query_pre_attn_scalar=hf["query_pre_attn_scalar"],
                embed_scale=True,
            )
        if model_type == "deepseek_v3":
            dense_layers = hf.get("first_k_dense_replace", 0)
            if hf.get("n_routed_experts") and (dense_layers or 0) < kw["n_layers"]:
                raise ConfigError(
                    "deepseek_v3 configs with MoE layers are not supported: only dense MLP layers "
                    f"(first_k_dense_replace={dense_layers} < num_hidden_layers={kw['n_layers']})"
                )
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
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
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
            rope_parameters=rope,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_embeddings,
            hidden_act={v: k for k, v in HF_ACTS.items()}[self.mlp_act],
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )
        if self.partial_rotary_factor != 1.0:
            hf["partial_rotary_factor"] = rope["partial_rotary_factor"] = self.partial_rotary_factor
        if self.model_type in ("mistral", "phi3"):
            hf["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3") and self.layer_types is not None:
            hf.update(
                use_sliding_window=True, sliding_window=self.sliding_window, layer_types=self.layer_types
            )
        if self.model_type == "gemma3_text":
            local = {"rope_type": "default", "rope_theta": self.rope_local_theta or self.rope_theta}
            hf.update(
                rope_parameters={"full_attention": rope, "sliding_attention": local},
                hidden_activation=hf.pop("hidden_act"),
                layer_types=self.layer_types,
                sliding_window=self.sliding_window,
                query_pre_attn_scalar=self.query_pre_attn_scalar,
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


HF_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config.json's name -> mlp_act
# Gemma3TextConfig's defaults: a gemma3 config.json leaves out the fields that keep them
GEMMA3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=1,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
)


def _hf_rope(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """rope_theta, rope_scaling, rope_local_theta and partial_rotary_factor from a config.json, in
    either of transformers' spellings: `rope_parameters` (v5) or `rope_theta` + `rope_scaling` (v4);
    Gemma 3 keeps one set per layer type (v4: `rope_local_base_freq` for the sliding layers)."""
    params = hf.get("rope_parameters")
    if model_type == "gemma3_text":
        if isinstance(params, dict) and "full_attention" in params:
            full, local = params["full_attention"], params.get("sliding_attention") or {}
        else:
            full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta")}
            local = {"rope_theta": hf.get("rope_local_base_freq")}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"gemma3 sliding layers' rope_type {local['rope_type']!r} is not supported")
        out = _rope_fields(hf, full)
        out["rope_local_theta"] = local.get("rope_theta") or GEMMA3_DEFAULTS["rope_local_base_freq"]
        return out
    return _rope_fields(hf, params if isinstance(params, dict) else (hf.get("rope_scaling") or {}))


def _rope_fields(hf: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    return dict(
        rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0),
        rope_scaling=None if kind in ("default", None) else {**scaling, "rope_type": kind},
        partial_rotary_factor=hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0,
    )
