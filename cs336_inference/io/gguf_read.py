"""Reading GGUF files: llama.cpp's single-file format for (quantized) weights, config and tokenizer.

A GGUF file holds three things:
  - metadata: key/value pairs such as `llama.block_count` (the config) and `tokenizer.ggml.tokens`;
  - tensor infos: name, shape and element type of every tensor (e.g. `blk.0.attn_q.weight`, Q4_1);
  - tensor data: the raw bytes, aligned.

We parse the container and turn the raw bytes into floats ourselves (the tests check both against
the `gguf` package, llama.cpp's own Python implementation). The block formats below are what "4-bit" and "8-bit" weights mean in practice. Each block of 32 weights
stores one or two fp16 numbers (a scale d, and for Q4_1 a minimum m) plus 32 small integers q:

    Q8_0   2 + 32 bytes   x = d * q,          q int8
    Q4_0   2 + 16 bytes   x = d * (q - 8),    q in 0..15, two per byte
    Q4_1   4 + 16 bytes   x = d * q + m,      q in 0..15, two per byte

In Q4_0 / Q4_1 byte j of a block holds weight j in its low nibble and weight j + 16 in its high one.
So Q4_1 costs 20 bytes per 32 weights (5 bits per weight) instead of 128 bytes in float32.
gguf_blocks.py reads the other formats of downloaded files: Q5_0, Q5_1, IQ4_NL and the K-quants
(Q2_K .. Q6_K, Q8_K: super-blocks of 256 weights with a scale per sub-block), as "Q4_K_M" files hold.

llama.cpp's converter also reorders the rows of the query and key projections: its rotary
embedding rotates adjacent pairs (2j, 2j + 1), while Hugging Face checkpoints (and our model) rotate
pairs (j, j + H/2) ("rotate half"). `unpermute_qk` undoes that reorder.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from einops import rearrange
from gguf import GGMLQuantizationType
from jaxtyping import Float
from torch import Tensor

from cs336_inference.config import FULL, SLIDING, ConfigError, ModelConfig
from cs336_inference.io import gguf_blocks
from cs336_inference.io.sources import CheckpointError

QK = 32  # weights per block in the Q8_0 / Q4_0 / Q4_1 formats

# element type -> (weights per block, bytes per block)
BLOCK_FORMATS: dict[GGMLQuantizationType, tuple[int, int]] = {
    GGMLQuantizationType.F32: (1, 4),
    GGMLQuantizationType.F16: (1, 2),
    GGMLQuantizationType.BF16: (1, 2),
    GGMLQuantizationType.Q8_0: (QK, 2 + QK),
    GGMLQuantizationType.Q4_0: (QK, 2 + QK // 2),
    GGMLQuantizationType.Q4_1: (QK, 2 + 2 + QK // 2),
    # gguf_blocks.py: d (and m) fp16, a 5th bit per weight in 4 bytes, or IQ4_NL's table of 16 levels
    GGMLQuantizationType.Q5_0: (QK, 2 + 4 + QK // 2),
    GGMLQuantizationType.Q5_1: (QK, 2 + 2 + 4 + QK // 2),
    GGMLQuantizationType.IQ4_NL: (QK, 2 + QK // 2),
    # K-quants: super-blocks of 256 weights (gguf_blocks.QK_K), fp16 d (and dmin), sub-block scales
    GGMLQuantizationType.Q2_K: (gguf_blocks.QK_K, 16 + 64 + 2 + 2),
    GGMLQuantizationType.Q3_K: (gguf_blocks.QK_K, 32 + 64 + 12 + 2),
    GGMLQuantizationType.Q4_K: (gguf_blocks.QK_K, 2 + 2 + 12 + 128),
    GGMLQuantizationType.Q5_K: (gguf_blocks.QK_K, 2 + 2 + 12 + 32 + 128),
    GGMLQuantizationType.Q6_K: (gguf_blocks.QK_K, 128 + 64 + 16 + 2),
    GGMLQuantizationType.Q8_K: (gguf_blocks.QK_K, 4 + 256 + 2 * 16),
}


# ------------------------------------------------------------------ dequantization
def _fp16(raw: np.ndarray) -> np.ndarray:
    """Reinterpret pairs of bytes [..., 2] as little-endian fp16 and widen to float32 [..., 1]."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] integers 0..15: low nibbles are weights 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def dequantize_blocks(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Raw blocks [n, bytes per block] (uint8) -> float32 weights [n, weights per block]."""
    if qtype == GGMLQuantizationType.F32:
        return np.ascontiguousarray(blocks).view("<f4").astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return _fp16(blocks)
    if qtype == GGMLQuantizationType.BF16:
        # bfloat16 is the top half of a float32: shift the 16 bits up.
        bits = np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32)
    if qtype == GGMLQuantizationType.Q8_0:
        d, qs = blocks[:, :2], blocks[:, 2:]
        return _fp16(d) * qs.view(np.int8).astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_0:
        d, qs = blocks[:, :2], blocks[:, 2:]
        return _fp16(d) * (_nibbles(qs) - 8.0)
    if qtype == GGMLQuantizationType.Q4_1:
        d, m, qs = blocks[:, :2], blocks[:, 2:4], blocks[:, 4:]
        return _fp16(d) * _nibbles(qs) + _fp16(m)
    if qtype in gguf_blocks.DEQUANTIZERS:  # Q5_0, Q5_1, IQ4_NL and the K-quants
        return gguf_blocks.DEQUANTIZERS[qtype](blocks)
    raise CheckpointError(f"GGUF tensor type {qtype.name} is not supported ({supported_types()})")


def supported_types() -> str:
    return "supported: " + ", ".join(t.name for t in BLOCK_FORMATS)


CHUNK_BLOCKS = 1 << 14  # blocks dequantized at a time


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType | int) -> np.ndarray:
    """Raw tensor data, one row of the matrix (in bytes or numbers) per row, -> float32.

    The last axis holds one row of the weight matrix in its stored form; the result has the same
    leading axes and (bytes per row / bytes per block * weights per block) columns.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype not in BLOCK_FORMATS:
        raise CheckpointError(f"GGUF tensor type {qtype.name} is not supported ({supported_types()})")
    per_block, block_bytes = BLOCK_FORMATS[qtype]
    raw = np.ascontiguousarray(data).view(np.uint8)
    *lead, row_bytes = raw.shape
    if row_bytes % block_bytes:
        raise CheckpointError(f"{qtype.name} row of {row_bytes} bytes is not a whole number of blocks")
    blocks = raw.reshape(-1, block_bytes)
    out = np.empty((blocks.shape[0], per_block), dtype=np.float32)
    for start in range(0, len(blocks), CHUNK_BLOCKS):  # in pieces: the temporaries stay in the cache
        out[start : start + CHUNK_BLOCKS] = dequantize_blocks(blocks[start : start + CHUNK_BLOCKS], qtype)
    return out.reshape(*lead, row_bytes // block_bytes * per_block)


# ------------------------------------------------------------------ rotary row order
def unpermute_qk(w: Float[Tensor, "out D"], n_heads: int) -> Float[Tensor, "out D"]:
    """Undo llama.cpp's row reorder of a query/key projection (n_heads = K for the key projection).

    Within each head of H rows, llama.cpp stores row 2j + e where Hugging Face has row j + e * H/2
    (e in {0, 1}), so that its rotary embedding can rotate adjacent pairs. We put the rows back.
    """
    return rearrange(w, "(n j e) d -> (n e j) d", n=n_heads, e=2)


# ------------------------------------------------------------------ container
# Metadata value types of the GGUF format: type number -> struct format code.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): [out, in] for a weight matrix
    qtype: GGMLQuantizationType
    offset: int  # byte offset of the data in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data: np.ndarray  # the whole file, memory-mapped as uint8

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of one tensor, one row of the matrix per row: [rows, bytes per row]."""
        t = self.tensors[name]
        return self.data[t.offset : t.offset + t.nbytes].reshape(*t.shape[:-1], -1)

    def release(self, name: str) -> None:
        """Unmap the pages of one tensor that was read (they stay in the page cache): a loader that
        dequantizes tensor by tensor then does not hold the file's pages and the model's floats both."""
        t, mapping = self.tensors[name], getattr(self.data, "_mmap", None)
        page = mmap.PAGESIZE
        start, end = -(-t.offset // page) * page, (t.offset + t.nbytes) // page * page
        if mapping is not None and hasattr(mapping, "madvise") and end > start:
            mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


class _Cursor:
    """Reads little-endian values from a bytes buffer, failing with 'truncated' past its end."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise CheckpointError(f"truncated GGUF file {self.path}: header ends at byte {len(self.buf)}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, code: str) -> Any:
        return struct.unpack("<" + code, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("Q"))).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """count strings in a row (a vocabulary: ~50K of them, so one tight loop, no per-item calls)."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        for _ in range(count):
            if pos + 8 > end:
                break
            n = int.from_bytes(buf[pos : pos + 8], "little")
            if pos + 8 + n > end:
                break
            out.append(str(buf[pos + 8 : pos + 8 + n], "utf-8", "replace"))
            pos += 8 + n
        self.pos = pos
        if len(out) < count:
            self.take(end + 1)  # raises the 'truncated' error
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("I"), self.scalar("Q")
            if etype in _SCALARS and etype != 7:  # numbers: one numpy read instead of a Python loop
                code = np.dtype("<" + _SCALARS[etype])
                return np.frombuffer(self.take(count * code.itemsize), dtype=code).tolist()
            if etype == _STRING:
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        raise CheckpointError(f"corrupt GGUF file {self.path}: unknown metadata value type {vtype}")


def _open(path: Path) -> tuple[np.ndarray, _Cursor, int, dict[str, Any]]:
    """The file memory-mapped, a cursor past its metadata, its tensor count and its metadata."""
    if path.stat().st_size == 0:
        raise CheckpointError(f"GGUF file {path} is empty")
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise CheckpointError(f"cannot read GGUF file {path}: {e}") from None
    cur = _Cursor(memoryview(data), path)
    if bytes(cur.take(4)) != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    version = cur.scalar("I")
    if version not in (2, 3):
        raise CheckpointError(f"GGUF version {version} of {path} is not supported (only 2 and 3)")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("I"))
    return data, cur, n_tensors, metadata


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Only the metadata of a GGUF file (the tokenizer needs nothing else)."""
    return _open(Path(path))[3]


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file: header, metadata, tensor infos; tensor data stays memory-mapped.

    Layout: b"GGUF", version (u32), tensor count (u64), metadata count (u64), the metadata
    (key string, type u32, value), then per tensor: name, n_dims (u32), dims (u64, innermost
    first), type (u32), offset (u64) into the data section, which starts at the next multiple of
    general.alignment. Strings are a u64 length followed by UTF-8 bytes.
    """
    path = Path(path)
    data, cur, n_tensors, metadata = _open(path)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
        qtype_id, offset = cur.scalar("I"), cur.scalar("Q")
        infos.append((name, dims, qtype_id, offset))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    start = -(-cur.pos // align) * align
    tensors: dict[str, TensorInfo] = {}
    for name, dims, qtype_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError:
            raise CheckpointError(
                f"corrupt GGUF file {path}: tensor {name} has unknown type {qtype_id}"
            ) from None
        if qtype not in BLOCK_FORMATS:
            raise CheckpointError(
                f"GGUF tensor {name} has type {qtype.name}, which is not supported ({supported_types()})"
            )
        per_block, block_bytes = BLOCK_FORMATS[qtype]
        if dims[0] % per_block:
            raise CheckpointError(
                f"corrupt GGUF file {path}: tensor {name} rows are not whole {qtype.name} blocks"
            )
        nbytes = int(np.prod(dims)) // per_block * block_bytes
        if start + offset + nbytes > len(data):
            raise CheckpointError(
                f"truncated GGUF file {path}: tensor {name} ends at byte {start + offset + nbytes}, "
                f"the file has {len(data)}"
            )
        if name in tensors:
            raise CheckpointError(f"corrupt GGUF file {path}: tensor {name} is listed twice")
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), qtype, start + offset, nbytes)
    return GGUFFile(path, metadata, tensors, data)


# ------------------------------------------------------------------ config and names
# general.architecture -> our model_type. llama.cpp's "llama" stores Q/K rows permuted for its
# interleaved-pair RoPE; the others rotate halves (NEOX order) as we do, so their rows are as in HF.
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
}
GEMMA3_PATTERN = 6  # llama.cpp's gemma3: every 6th layer global, the others a sliding window
GEMMA3_LOCAL_BASE = 10_000.0  # its sliding layers' RoPE base, unless the file says (rope.freq_base_swa)


def config_from_metadata(
    meta: dict[str, Any], tensor_names: set[str], rope_freqs: list[float] | None = None
) -> ModelConfig:
    """A ModelConfig from the `{arch}.*` metadata (architectures: ARCHITECTURES); tied embeddings when
    there is no output.weight. rope_freqs: the values of the file's rope_freqs tensor (Llama 3.1+
    scaling), which `config_of` reads."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )

    def get(key: str, default: Any = KeyError) -> Any:
        if f"{arch}.{key}" in meta:
            return meta[f"{arch}.{key}"]
        if default is KeyError:
            raise CheckpointError(f"GGUF metadata lacks the key '{arch}.{key}'")
        return default

    if "rope_factors_long.weight" in tensor_names:
        raise ConfigError("GGUF has rope_factors_long.weight (Phi-3 LongRoPE), which is not supported")
    n_heads = get("attention.head_count")
    d_model = get("embedding_length")
    head_dim = get("attention.key_length", d_model // n_heads if n_heads else None)
    if get("attention.value_length", head_dim) != head_dim:
        raise ConfigError(f"GGUF {arch}.attention.value_length differs from key_length {head_dim}")
    rotary = get("rope.dimension_count", head_dim)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", len(tokens) if tokens is not None else KeyError)
    n_layers = get("block_count")
    kw: dict[str, Any] = dict(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        d_ff=get("feed_forward_length"),
        max_seq_len=get("context_length", 2048),
        rope_theta=float(get("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensor_names,
        model_type=ARCHITECTURES[arch],
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        rope_scaling=_rope_scaling(get),
        rope_freqs=rope_freqs,
    )
    if rotary != head_dim:
        kw["partial_rotary_factor"] = rotary / head_dim
        if int(head_dim * kw["partial_rotary_factor"]) != rotary:
            raise ConfigError(f"GGUF rotates {rotary} of {head_dim} head dims, a fraction we cannot express")
    if arch == "qwen2":
        kw["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "qwen3":
        kw["qk_norm"] = True
    if arch == "phi3":
        kw["sliding_window"] = get("attention.sliding_window", None)
    if arch == "gemma3":
        kw.update(_gemma3(get, n_layers, d_model, n_heads, head_dim))
    return ModelConfig(**kw)


def _rope_scaling(get) -> dict[str, Any] | None:
    """`rope.scaling.*` as transformers' rope_scaling (linear, yarn); none for plain RoPE."""
    kind = get("rope.scaling.type", "none")
    factor = float(get("rope.scaling.factor", 1.0))
    if kind in ("none", None) or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn" and get("rope.scaling.yarn_log_multiplier", None) is None:
        scaling = {"rope_type": "yarn", "factor": factor}
        scaling["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if get(f"rope.scaling.{theirs}", None) is not None:
                scaling[ours] = float(get(f"rope.scaling.{theirs}"))
        return scaling
    raise ConfigError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn, or a rope_freqs tensor)")


def _gemma3(get, n_layers: int, d_model: int, n_heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3's switches, as llama.cpp sets them (most are not in the file): every 6th layer global,
    sliding layers at base 10,000, queries scaled by 1/sqrt(H) (by 1/sqrt(D/N) in the 62-layer 27B)."""
    pattern = get("attention.sliding_window_pattern", GEMMA3_PATTERN)
    if isinstance(pattern, list):  # per layer: True where the layer slides
        layer_types = [SLIDING if swa else FULL for swa in pattern]
    else:
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
    return dict(
        layer_types=layer_types,
        sliding_window=get("attention.sliding_window"),
        rope_local_theta=float(get("rope.freq_base_swa", GEMMA3_LOCAL_BASE)),
        qk_norm=True,
        sandwich_norm=True,
        mlp_act="gelu_tanh",
        query_pre_attn_scalar=d_model / n_heads if n_layers == 62 else head_dim,
        embed_scale=True,
    )


def config_of(gguf: GGUFFile) -> ModelConfig:
    """The file's ModelConfig, with the values of its rope_freqs tensor where it has one."""
    freqs = None
    if "rope_freqs.weight" in gguf.tensors:
        t = gguf.tensors["rope_freqs.weight"]
        freqs = dequantize(gguf.raw("rope_freqs.weight"), t.qtype).reshape(-1).tolist()
    return config_from_metadata(gguf.metadata, set(gguf.tensors), freqs)


# our name -> GGUF name
_TOP_LEVEL = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK = {
    "attn_norm": "attn_norm",
    "attn.q_proj": "attn_q",
    "attn.k_proj": "attn_k",
    "attn.v_proj": "attn_v",
    "attn.o_proj": "attn_output",
    "attn.q_norm": "attn_q_norm",
    "attn.k_norm": "attn_k_norm",
    "post_attn_norm": "post_attention_norm",
    "mlp_norm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_mlp_norm": "post_ffw_norm",
}
IGNORED = {"rope_freqs.weight"}  # read into the config (config_of), not a weight


def ours_to_gguf(name: str) -> str:
    """`layers.3.attn.q_proj.weight` -> `blk.3.attn_q.weight` (names with no GGUF twin stay as they are)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if m and m.group(2) in _BLOCK:
        return f"blk.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    return name


def read_tensor(gguf: GGUFFile, name: str, cfg: ModelConfig) -> Tensor:
    """One tensor of the file as float32, Q/K rows back in rotate-half order (llama architecture)."""
    t = gguf.tensors[name]
    w = torch.from_numpy(dequantize(gguf.raw(name), t.qtype).reshape(t.shape))
    heads = {"attn_q.weight": cfg.n_heads, "attn_k.weight": cfg.n_kv_heads}.get(name.split(".", 2)[-1])
    if cfg.model_type == "llama" and heads is not None and w.shape[0] == heads * cfg.head_dim:
        w = unpermute_qk(w, heads)  # (a misshaped one is reported later)
    return w


_FUSED = re.compile(r"blk\.(\d+)\.(attn_qkv|ffn_up)\.weight")


def split_fused(cfg: ModelConfig, name: str, w: Tensor) -> dict[str, Tensor]:
    """Phi-3 stores q/k/v as one attn_qkv (N H + 2 K H rows) and gate/up as one ffn_up (2 F rows,
    gate first): split them into the names of the other architectures. Other tensors pass as they are."""
    m = _FUSED.fullmatch(name) if cfg.model_type == "phi3" else None
    N, K, H, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    if m and m.group(2) == "attn_qkv" and w.shape[0] == (N + 2 * K) * H:
        q, k, v = w.split([N * H, K * H, K * H])
        return {f"blk.{m.group(1)}.attn_{p}.weight": x for p, x in (("q", q), ("k", k), ("v", v))}
    if m and m.group(2) == "ffn_up" and w.shape[0] == 2 * F:
        gate, up = w.split(F)
        return {f"blk.{m.group(1)}.ffn_gate.weight": gate, f"blk.{m.group(1)}.ffn_up.weight": up}
    return {name: w}


def iter_tensors(gguf: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """Every weight of the file as float32, by GGUF name (`read_tensor`; fused ones split), one at a
    time: a loader that copies each into the model holds one tensor's floats at a time."""
    for name in gguf.tensors:
        if name not in IGNORED:
            pieces = split_fused(cfg, name, read_tensor(gguf, name, cfg))
            gguf.release(name)  # read_tensor copied what it needs
            yield from pieces.items()


def read_tensors(gguf: GGUFFile, cfg: ModelConfig) -> dict[str, Tensor]:
    """Every weight of the file as float32, by GGUF name (`iter_tensors`, all at once)."""
    return dict(iter_tensors(gguf, cfg))
