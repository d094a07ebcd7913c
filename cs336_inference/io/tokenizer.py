"""The tokenizer and chat template of a checkpoint, backed by the `tokenizers` library.

    tok = load_tokenizer("folder/" | "model.gguf")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    text = tok.decode(ids)

A chat model was trained on conversations rendered by its own Jinja template (role markers such as
<|im_start|>user ... <|im_end|>); prompting it any other way wastes what it learned, so we render
the model's template. Generation stops at one of `eos_token_ids`.

From a folder we read tokenizer.json (+ tokenizer_config.json / chat_template.jinja). A GGUF file
has no tokenizer.json: it lists the vocabulary, the BPE merges, each token's type and the special
ids, plus `tokenizer.ggml.pre`, the name of the regex that splits text into words before BPE.
We rebuild a byte-level BPE from those (only `tokenizer.ggml.model == "gpt2"` is supported).
"""

from __future__ import annotations

import json
import os
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from cs336_inference.io import gguf_read
from cs336_inference.io.sources import CheckpointError, resolve_checkpoint

# A plain ChatML template, used only when a model ships no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# How llama.cpp splits text into words for each `tokenizer.ggml.pre` name (a few common ones).
# GPT-2's regex (ByteLevel's built-in one): contractions, words, numbers, punctuation, spaces.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types (1 is a normal token)


def gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a GGUF `tokenizer.ggml.pre` name.

    "smollm" (SmolLM/SmolLM2, like StarCoder) first makes every digit its own word, then applies
    GPT-2's regex; this is also what SmolLM2's tokenizer.json does (Digits + ByteLevel). Unknown
    names fall back to GPT-2's regex, with a warning.
    """
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre not in (None, "default", "gpt2", "gpt-2"):
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; splitting words with GPT-2's regex", stacklevel=2)
    return gpt2


def _render(template: str, **variables: Any) -> str:
    """Render a chat template the way transformers does (sandboxed Jinja, trimmed blocks)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(**variables)


class Tokenizer:
    """Text <-> token ids, special tokens, and the model's chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token_id: int | None = None,
        eos_token_ids: list[int] | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids or [])
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text. Special tokens written in the text (e.g. <|im_start|>) stay whole;
        add_special_tokens adds what the tokenizer adds around every text (e.g. a BOS), if anything."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the text the model was trained on, rendered by its own template
        (a plain ChatML template when it has none). add_generation_prompt ends the text with the
        opening of an assistant turn, so that the model answers next."""
        return _render(
            self.chat_template or CHATML_TEMPLATE,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


# ------------------------------------------------------------------ folders (tokenizer.json)
def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _from_folder(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no tokenizer.json")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust parser reports a bad file as a generic Exception
        raise CheckpointError(f"cannot read {path}: {' '.join(str(e).split())}") from None
    config = _json(folder / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()

    def token_id(key: str) -> int | None:
        content = _token_content(config.get(key))
        return None if content is None else backend.token_to_id(content)

    model_config, generation = _json(folder / "config.json"), _json(folder / "generation_config.json")
    eos = _ids(generation.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))
    if token_id("eos_token") is not None:
        eos.insert(0, token_id("eos_token"))
    bos = token_id("bos_token")
    if bos is None:
        bos = generation.get("bos_token_id", model_config.get("bos_token_id"))
    return Tokenizer(backend, bos, list(dict.fromkeys(eos)), template)


# ------------------------------------------------------------------ GGUF files
def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE tokenizer from a GGUF file's `tokenizer.*` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    if len(types) != len(tokens):
        raise CheckpointError(f"GGUF has {len(types)} token types for {len(tokens)} tokens")
    # Control tokens (<|im_start|>) and user-defined ones are matched whole in the text, never split.
    control = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    user_defined = [t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [i for i in (eos, meta.get("tokenizer.ggml.eot_token_id")) if i is not None]
    add_bos = bos is not None and meta.get("tokenizer.ggml.add_bos_token", False)
    add_eos = eos is not None and meta.get("tokenizer.ggml.add_eos_token", False)
    if add_bos or add_eos:
        single = (
            ([f"{tokens[bos]}:0"] if add_bos else []) + ["$A:0"] + ([f"{tokens[eos]}:0"] if add_eos else [])
        )
        specials = [(tokens[i], i) for i in ([bos] if add_bos else []) + ([eos] if add_eos else [])]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(single), special_tokens=specials
        )
    return Tokenizer(backend, bos, list(dict.fromkeys(eos_ids)), meta.get("tokenizer.chat_template"))


def _from_gguf(path: Path) -> Tokenizer:
    meta = gguf_read.read_gguf(path).metadata
    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{path} has no tokenizer (no tokenizer.ggml.tokens)")
    return tokenizer_from_gguf_metadata(meta)


def load_tokenizer(path_or_id: str | os.PathLike) -> Tokenizer:
    """The tokenizer of whatever load_pretrained accepts: a checkpoint folder (its tokenizer.json) or
    any file of it, a hub id, or a GGUF file (sources.resolve_checkpoint resolves both the same way)."""
    source = resolve_checkpoint(path_or_id)
    return _from_gguf(source.path) if source.kind == "gguf" else _from_folder(source.path)
