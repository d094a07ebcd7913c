"""The tokenizer and chat template of a checkpoint, backed by the `tokenizers` library.

    tok = load_tokenizer("folder/" | "model.gguf")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    text = tok.decode(ids)

A chat model was trained on conversations rendered by its own Jinja template (role markers such as
<|im_start|>user ... <|im_end|>); prompting it any other way wastes what it learned, so we render
the model's template. Generation stops at one of `eos_token_ids`.

From a folder we read tokenizer.json (+ tokenizer_config.json / chat_template.jinja). A GGUF file
has no tokenizer.json: it lists the vocabulary, each token's type and the special ids, and we
rebuild the tokenizer from those. `tokenizer.ggml.model` says which kind it is:

  "gpt2"   byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): the file also lists the BPE merges and
           `tokenizer.ggml.pre`, the name of the regex that splits text into words before BPE.
  "llama"  SentencePiece BPE (Llama 2, Mistral, Gemma): spaces are spelled "▁", characters
           missing from the vocabulary fall back to byte tokens <0x00>..<0xFF>, and there are no
           merges in the file, only a score per token; we derive the merges from the vocabulary.
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
        default_template: str = CHATML_TEMPLATE,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids or [])
        self.chat_template = chat_template  # the checkpoint's own (None: it carries none)
        self.default_template = default_template  # rendered when it has none

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
        """The conversation as the text the model was trained on, rendered by its own template (when
        it has none, the family's built-in one, e.g. Gemma's, else a plain ChatML template).
        add_generation_prompt ends the text with the opening of an assistant turn, so that the model
        answers next."""
        return _render(
            self.chat_template or self.default_template,
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
def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    """A byte-level BPE ("gpt2") with the file's merges and word-splitting regex."""
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_merges(tokens: list[str], priority: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    Every split of a token t into two tokens, t = a + b, is a merge (a, b); it ranks by the priority
    (score) of t, higher first. Ties go to the longer a, then the longer b, then the earlier token:
    the order transformers' `generate_merges` gives, found here in one pass over the vocabulary
    (seconds for Gemma's 262,144 tokens) instead of comparing tokens pairwise.
    """
    vocab = set(tokens)
    found = []  # (priority of t, len(a), len(b), a, b), in token order
    for t, p in dict(zip(tokens, priority, strict=True)).items():  # like transformers: a repeated token once
        for i in range(1, len(t)):
            a, b = t[:i], t[i:]
            if a in vocab and b in vocab:
                found.append((p, i, len(t) - i, a, b))
    found.sort(key=lambda merge: merge[:3], reverse=True)  # a stable sort: ties keep token order
    return [(a, b) for *_, a, b in found]


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    """A SentencePiece BPE ("llama") with byte fallback; "▁" spells a space.

    With `add_space_prefix` (the default) a "▁" is put before the text, as Llama 2 was trained:
    "Hi" is looked up as "▁Hi", the same token as the word in " Hi"; decoding strips it again. As in
    transformers, only at the very start (not after a special token), and not when the text already
    starts with a space (so " Hi" decodes to "Hi"). llama.cpp prefixes both.
    """
    if meta.get("general.architecture") in _GEMMA:
        tokens, priority = _gemma_spelling(tokens), [-i for i in range(len(tokens))]
    else:
        priority = meta.get("tokenizer.ggml.scores")
        if priority is None or len(priority) != len(tokens):
            raise CheckpointError("GGUF SentencePiece vocabulary needs one tokenizer.ggml.scores per token")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=sentencepiece_merges(tokens, priority),
        unk_token=None if unk is None else tokens[unk],
        fuse_unk=True,
        byte_fallback=True,  # a character with no token becomes its UTF-8 bytes, <0xE2><0x82><0xAC>
    )
    backend = tokenizers.Tokenizer(model)
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(  # " " -> "▁"; the text stays one word
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


# Gemma files, as transformers reads them: tokens of 2+ spaces are stored with real spaces, which
# the text (spaces already spelled "▁") never matches, so we spell them "▁▁"; and Gemma's scores do
# not follow its merge order, the order of the tokens in the file does.
_GEMMA = ("gemma", "gemma2", "gemma3")


def _gemma_spelling(tokens: list[str]) -> list[str]:
    return ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]


def _add_gguf_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (<|im_start|>, <start_of_turn>) and user-defined ones are matched whole in the
    text, never split; control tokens are special (decode can skip them)."""
    if len(types) != len(tokens):
        raise CheckpointError(f"GGUF has {len(types)} token types for {len(tokens)} tokens")
    vocab = backend.get_vocab()
    control = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    user_defined = [t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED and t in vocab]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])


def _add_bos_eos(backend: tokenizers.Tokenizer, meta: dict[str, Any], tokens: list[str]) -> None:
    """Put BOS before / EOS after every encoded text when the file says so. A SentencePiece vocabulary
    that does not say gets a BOS (as llama.cpp and transformers do)."""
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    sentencepiece = meta.get("tokenizer.ggml.model") == "llama"
    add_bos = bos is not None and meta.get("tokenizer.ggml.add_bos_token", sentencepiece)
    add_eos = eos is not None and meta.get("tokenizer.ggml.add_eos_token", False)
    if add_bos or add_eos:
        single = (
            ([f"{tokens[bos]}:0"] if add_bos else []) + ["$A:0"] + ([f"{tokens[eos]}:0"] if add_eos else [])
        )
        specials = [(tokens[i], i) for i in ([bos] if add_bos else []) + ([eos] if add_eos else [])]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(single), special_tokens=specials
        )


# Control tokens that close a turn. llama.cpp stops generating at these whatever the file's eos id.
_END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>")


def _eos_ids(meta: dict[str, Any], backend: tokenizers.Tokenizer, types: list[int]) -> list[int]:
    """The file's eos (and eot) ids, then any end-of-turn control token (Gemma's <end_of_turn>)."""
    named = [backend.token_to_id(t) for t in _END_OF_TURN]
    ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    ids += [i for i in named if i is not None and types[i] == CONTROL]
    return list(dict.fromkeys(i for i in ids if i is not None))


# Gemma's own template (text messages only), for a Gemma file that carries none (llama.cpp falls back
# to its built-in one too). Gemma has no system role: a system message opens the first user turn;
# "assistant" is called "model"; a turn ends with <end_of_turn>, which is why it is an eos id.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ (message['content'] | trim) + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_BUILTIN_TEMPLATES = dict.fromkeys(_GEMMA, GEMMA_TEMPLATE)


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
    """A tokenizer from a GGUF file's `tokenizer.*` metadata ("gpt2" or "llama" vocabularies)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens)
    else:
        raise CheckpointError(
            f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2', byte-level BPE, and 'llama', "
            "SentencePiece BPE)"
        )
    _add_gguf_special_tokens(backend, tokens, types)
    _add_bos_eos(backend, meta, tokens)
    builtin = _BUILTIN_TEMPLATES.get(meta.get("general.architecture"), CHATML_TEMPLATE)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(
        backend, bos, _eos_ids(meta, backend, types), meta.get("tokenizer.chat_template"), builtin
    )


def _from_gguf(path: Path) -> Tokenizer:
    meta = gguf_read.read_gguf_metadata(path)
    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{path} has no tokenizer (no tokenizer.ggml.tokens)")
    return tokenizer_from_gguf_metadata(meta)


def load_tokenizer(path_or_id: str | os.PathLike) -> Tokenizer:
    """The tokenizer of whatever load_pretrained accepts: a checkpoint folder (its tokenizer.json) or
    any file of it, a hub id, or a GGUF file (sources.resolve_checkpoint resolves both the same way)."""
    source = resolve_checkpoint(path_or_id)
    return _from_gguf(source.path) if source.kind == "gguf" else _from_folder(source.path)
