"""scripts/generate.py, run as a user runs it (a subprocess): answers, streaming, statistics, bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "generate.py"
# One thread: a 2-thread torch on a busy 2-core machine can be 10-100x slower on small matmuls.
FAST = ["--threads", "1"]


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    """Build the C kernels once in this process (cached on disk), so that no CLI run below waits for
    a cold build (tens of seconds on a busy 2-core machine)."""
    from cs336_inference.fast.cpu import build

    build.library()


def run_cli(*args: str, stdin: str | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize(
    "args, option",
    [
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--top-p", "-0.2"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--max-new-tokens", "-5"], "--max-new-tokens"),
        (["--top-k", "0"], "--top-k"),
        (["--temperature", "hot"], "--temperature"),
        (["--dtype", "int3"], "--dtype"),
        (["--model", "MISSING/dir/model.gguf"], "--model"),
        (["--model", "missing.gguf"], "--model"),
        (["--draft", "ngram", "--speculate-k", "0"], "--speculate-k"),
        (["--draft", "missing.gguf"], "--draft"),
        (["--draft", "ngram", "--no-cache"], "--draft"),
        (["--draft-shares-cache"], "--draft-shares-cache"),
        (["--draft", "ngram", "--draft-shares-cache"], "--draft-shares-cache"),
        (["--draft-lookup"], "--draft-lookup"),
        (["--draft", "head", "--draft-lookup"], "--draft-lookup"),
        (["--compile"], "--compile"),
        (["--eager", "--draft", "ngram", "--compile"], "--compile"),
        (["--speculate-k", "3"], "--speculate-k"),
        (["--stop", "a", "--stop", "b", "--stop", "c", "--stop", "d", "--stop", "e"], "--stop"),
        (["--stop", ""], "--stop"),
        (["--json-schema", "missing.json"], "--json-schema"),
        (["--device", "cuda", "--draft", "ngram"], "--device"),
        (["--draft", "ngram", "--json-schema", "missing.json"], "--json-schema"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, option, tmp_path):
    args = [a.replace("MISSING", str(tmp_path)) for a in args]
    result = run_cli(*args, "Hello", timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("generate.py: error:") and option in lines[0], lines


def test_missing_or_empty_prompt_exits_2():
    for args, stdin in [([], ""), (["   "], ""), (["a", "--prompt", "b"], "")]:
        result = run_cli(*args, stdin=stdin, timeout=30)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer model saved with save_pretrained, plus a word-level tokenizer.json (w0 .. w126)."""
    tokenizers = pytest.importorskip("tokenizers")
    from cs336_inference.config import ModelConfig
    from cs336_inference.io.checkpoint import save_pretrained
    from cs336_inference.model import TransformerLM

    folder = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    model = TransformerLM(cfg)
    with torch.no_grad():
        model.norm.weight.mul_(4.0)  # peaked logits: greedy choices far from ties
    save_pretrained(model, folder)
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(127)}}  # every id of the model is a word
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def words(n: int) -> str:
    return " ".join(f"w{i % 127}" for i in range(n))


def test_prompt_longer_than_the_context_window_exits_2(tiny_checkpoint):
    result = run_cli("--model", str(tiny_checkpoint), "--raw", *FAST, words(80))  # 80 tokens > 64
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "context window" in lines[0] and "80 tokens" in lines[0], lines


def test_json_tokens_equal_the_library_and_the_naive_sampler(tiny_checkpoint):
    from cs336_inference.io.checkpoint import load_pretrained
    from cs336_inference.sampling import generate

    prompt = words(10)
    args = ["--model", str(tiny_checkpoint), "--raw", "--json", "--max-new-tokens", "12", *FAST]
    cached = run_cli(*args, prompt)
    naive = run_cli(*args, "--no-cache", stdin=prompt)  # and the prompt from stdin
    assert cached.returncode == 0 and naive.returncode == 0, cached.stderr + naive.stderr
    out, out_naive = json.loads(cached.stdout), json.loads(naive.stdout)
    model = load_pretrained(tiny_checkpoint)
    expected = generate(model, list(range(1, 11)), 12, stop_token_ids=[]).tolist()  # w0..w9 = ids 1..10
    assert out["token_ids"] == expected == out_naive["token_ids"]
    assert out["prompt_tokens"] == 10 and out["generated_tokens"] == 12 and out["use_cache"]
    assert not out_naive["use_cache"] and out["ttft_s"] > 0 and out["decode_tokens_per_s"] > 0


def test_stop_strings_end_the_text_before_the_first_one(tiny_checkpoint):
    args = ["--model", str(tiny_checkpoint), "--raw", "--json", "--max-new-tokens", "16", *FAST, words(10)]
    full = json.loads(run_cli(*args).stdout)["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    result = run_cli(*args, "--stop", "never here", "--stop", stop)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["text"] == full[: full.find(stop)] and out["stop_string"] == stop, (out["text"], full, stop)
    plain = run_cli(*[a for a in args if a != "--json"], "--stop", stop)  # streamed to stdout
    assert plain.stdout.rstrip("\n") == full[: full.find(stop)].rstrip("\n")


def test_the_default_fast_path_gives_the_eager_tokens_greedy_and_sampled(tiny_checkpoint):
    """The default run is the fast path (native steps where the kernels are built) and says so; --eager
    runs the readable model; both give the same tokens, greedy and sampled with a seed."""
    from cs336_inference.fast.cpu import build

    args = ["--model", str(tiny_checkpoint), "--raw", "--json", "--max-new-tokens", "12", *FAST, words(10)]
    sampled = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "3"]
    runs = [run_cli(*extra, *args) for extra in (["--eager"], [], [*sampled, "--eager"], sampled)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    greedy, greedy_fast, draws, draws_fast = (json.loads(r.stdout)["token_ids"] for r in runs)
    assert greedy_fast == greedy, "the fast path changed the greedy tokens"
    assert draws_fast == draws, "the fast path changed the sampled tokens (same seed)"
    assert draws != greedy, "the sampled run should differ from greedy (else it checks nothing)"
    assert json.loads(runs[0].stdout)["path"] == "eager (readable PyTorch)"
    expected = "fast path: native steps" if build.library() is not None else "fast path: kernels"
    assert json.loads(runs[1].stdout)["path"] == expected


def test_help_shows_the_defaults():
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "default: 256" in text and "--eager" in text, text


def test_speculative_draft_gives_the_same_tokens_and_reports_alpha(tiny_checkpoint):
    prompt = words(10) + " " + words(10)  # a repeated prompt: prompt lookup finds matches
    args = ["--model", str(tiny_checkpoint), "--raw", "--max-new-tokens", "12", *FAST]
    plain = run_cli(*args, "--json", prompt)
    ngram = run_cli(*args, "--json", "--draft", "ngram", "--speculate-k", "3", prompt)
    model_draft = run_cli(*args, "--draft", str(tiny_checkpoint), "--speculate-k", "2", prompt)  # text mode
    own = ["--no-draft-shares-cache", "--no-draft-lookup"]
    shared = run_cli(*args, "--json", "--draft", "int8", "--no-draft-lookup", "--speculate-k", "2", prompt)
    lookup = run_cli(*args, "--json", "--draft", "int8", prompt)  # the defaults: shared cache, lookup, k 6
    alone = run_cli(*args, "--json", "--draft", "int8", *own, prompt)  # a cache of its own, no lookup
    for r in (plain, ngram, model_draft, shared, lookup, alone):
        assert r.returncode == 0, r.stderr
    out, spec = json.loads(plain.stdout), json.loads(ngram.stdout)
    assert spec["token_ids"] == out["token_ids"], "greedy speculative output must equal plain greedy"
    for run, expected in ((shared, (True, False, 2)), (lookup, (True, True, 6)), (alone, (False, False, 6))):
        r = json.loads(run.stdout)  # the model's int8 weights drafting (on the model's own cache)
        got = r["speculative"]["shares_cache"], r["speculative"]["lookup"], r["speculative"]["k"]
        assert got == expected, f"--draft int8: shares cache, lookup, k = {got}, expected {expected}"
        assert r["token_ids"] == out["token_ids"] and r["speculative"]["draft"] == "int8", (
            f"--draft int8 {expected}: greedy output must equal plain greedy"
        )
    s = spec["speculative"]
    assert s["draft"] == "ngram" and s["k"] == 3 and s["new_tokens"] == spec["generated_tokens"]
    rounds = s["new_tokens"] - s["prefill_tokens"]  # the prompt's prefill gives the first token
    assert (
        0 <= s["alpha"] <= 1
        and s["prefill_tokens"] == 1
        and s["tokens_per_pass"] == rounds / s["target_passes"]
    )
    assert model_draft.stdout.strip() == out["text"].strip()
    # the model drafting for itself accepts everything: 2 drafts + 1 bonus per pass
    assert "acceptance alpha 1.000" in model_draft.stderr and "tokens per target pass" in model_draft.stderr


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_model_may_be_a_file_of_the_checkpoint_folder(tiny_checkpoint, name):
    """--model dir/model.safetensors (or any file of the folder) loads the model and its tokenizer."""
    args = ["--raw", "--json", "--max-new-tokens", "6", *FAST, words(5)]
    by_folder = run_cli("--model", str(tiny_checkpoint), *args)
    by_file = run_cli("--model", str(tiny_checkpoint / name), *args)
    assert by_folder.returncode == 0, by_folder.stderr
    assert by_file.returncode == 0, by_file.stderr
    assert json.loads(by_file.stdout)["token_ids"] == json.loads(by_folder.stdout)["token_ids"]


def test_sampling_is_reproducible_with_a_seed(tiny_checkpoint):
    """--temperature 0.7 --top-p 0.9: the same seed gives the same text, another seed another text."""
    args = ["--model", str(tiny_checkpoint), "--raw", "--json", "--max-new-tokens", "30", *FAST]
    sample = ["--temperature", "0.7", "--top-p", "0.9"]
    runs = [run_cli(*args, *sample, "--seed", seed, words(5)) for seed in ("0", "0", "1")]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    first, again, other = (json.loads(r.stdout) for r in runs)
    assert first["text"] == again["text"] and first["token_ids"] == again["token_ids"]
    assert first["token_ids"] != other["token_ids"]
    greedy = json.loads(run_cli(*args, words(5)).stdout)
    assert first["token_ids"] != greedy["token_ids"]  # it really sampled


@pytest.mark.slow  # torch.compile of the target's steps: minutes cold on 2 cores
def test_compiled_speculative_target_gives_the_same_tokens(tiny_checkpoint):
    prompt = words(10) + " " + words(10)
    args = ["--model", str(tiny_checkpoint), "--raw", "--max-new-tokens", "12", "--json", *FAST]
    plain = run_cli(*args, "--eager", prompt)
    compiled = run_cli(*args, "--draft", "ngram", "--speculate-k", "3", "--compile", prompt)
    assert plain.returncode == 0 and compiled.returncode == 0, plain.stderr + compiled.stderr
    assert json.loads(compiled.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert json.loads(compiled.stdout)["path"] == "fast path: compiled steps"


def test_max_new_tokens_is_lowered_to_fit_the_window(tiny_checkpoint):
    result = run_cli("--model", str(tiny_checkpoint), "--raw", "--max-new-tokens", "500", *FAST, words(10))
    assert result.returncode == 0, result.stderr
    assert "lowered to 54" in result.stderr
    assert "generated 54 tokens" in result.stderr and "TTFT" in result.stderr and "tokens/s" in result.stderr
    assert len(result.stdout.split()) == 54  # word-level tokens, one per generated token


def test_capital_of_france_is_paris():
    """The real default model (SmolLM2-135M-Instruct), chat template, greedy."""
    from cs336_inference.io.checkpoint import CheckpointError, default_model_path

    try:
        default_model_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    result = run_cli("--max-new-tokens", "16", *FAST, "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "prompt" in result.stderr and "TTFT" in result.stderr
    # the same question piped in as `echo` sends it (with a trailing newline) gives the same answer
    piped = run_cli("--max-new-tokens", "16", *FAST, stdin="What is the capital of France?\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == result.stdout


def test_auto_threads_counts_the_idle_cores():
    """The CLI's default thread count: one per core idle at the start (/proc/stat read twice)."""
    from cs336_inference.fast.threads import idle_cores

    def stat(cpu0: tuple[int, int], cpu1: tuple[int, int]) -> str:  # (busy, idle) jiffies per core
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        lines += [f"cpu{i} {busy} 0 0 {idle} 0 0 0 0 0 0" for i, (busy, idle) in enumerate((cpu0, cpu1))]
        return "\n".join(lines) + "\nintr 1 2 3\n"

    before = stat((100, 100), (100, 100))
    assert idle_cores(before, stat((100, 200), (100, 200)), {0, 1}) == 2.0, "both idle"
    assert idle_cores(before, stat((200, 100), (100, 200)), {0, 1}) == 1.0, "one core kept busy"
    assert idle_cores(before, stat((150, 150), (150, 150)), {0, 1}) == 1.0, "both half busy"
    assert idle_cores(before, stat((200, 100), (100, 200)), {0}) == 0.0, "only the CPUs this process may use"


def test_in_passing_thread_runs_on_a_thread_that_has_ended():
    """serve.py builds its model with threads.in_passing_thread: fn runs on another thread, which is
    gone when the call returns (its OpenMP team with it), and fn's result or exception comes back."""
    import threading

    from cs336_inference.fast.threads import in_passing_thread

    ran_on = []

    def build(a, b=0):
        ran_on.append(threading.current_thread())
        return a + b

    assert in_passing_thread(build, 2, b=3) == 5
    assert ran_on[0] is not threading.current_thread(), "fn ran on the calling thread"
    assert not ran_on[0].is_alive(), "the passing thread is still alive after the call"

    def fail():
        raise KeyError("no such checkpoint")

    with pytest.raises(KeyError, match="no such checkpoint"):
        in_passing_thread(fail)


def test_json_schema_gives_json_the_schema_accepts(tmp_path):
    """--json-schema FILE on the default model and the default (fast) path: the text is JSON that
    the schema accepts (checked by the jsonschema package); a schema llguidance cannot compile is a
    one-line error."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    from cs336_inference.io.checkpoint import CheckpointError, default_model_path

    try:
        default_model_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 10**8},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    result = run_cli(
        "--json-schema", str(path), "--max-new-tokens", "40", *FAST, "The capital of France, as JSON."
    )
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), schema)
    path.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    bad = run_cli("--json-schema", str(path), *FAST, "hi")
    assert bad.returncode == 2 and "--json-schema" in bad.stderr and "uniqueItems" in bad.stderr, bad.stderr


def run_torchrun(nproc: int, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    # --standalone: a rendezvous on a free port of this machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [str(SCRIPT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_torchrun_tensor_parallel_gives_the_single_process_tokens(tiny_checkpoint):
    """torchrun --nproc-per-node 2 ... --tensor-parallel 2: greedy and seeded sampling give one
    process's tokens, and only rank 0 prints."""
    base = ["--model", str(tiny_checkpoint), "--raw", "--json", "--max-new-tokens", "12", "--eager", *FAST]
    for extra in ([], ["--temperature", "1", "--seed", "5"]):
        alone = run_cli(*base, *extra, words(10))
        sharded = run_torchrun(2, *base, *extra, "--tensor-parallel", "2", words(10))
        assert alone.returncode == 0 and sharded.returncode == 0, sharded.stderr[-2000:]
        lines = [line for line in sharded.stdout.splitlines() if line.startswith("{")]
        assert len(lines) == 1, f"one JSON line (rank 0's), got {sharded.stdout!r}"
        got, want = json.loads(lines[0]), json.loads(alone.stdout)
        assert got["token_ids"] == want["token_ids"], f"{extra}: sharded tokens differ"
        assert got["tensor_parallel"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tensor-parallel", "2"], "--nproc-per-node 2"),
        (["--tensor-parallel", "0"], "--tensor-parallel must be >= 1"),
        (["--tensor-parallel", "2", "--draft", "ngram"], "--tensor-parallel"),
    ],
)
def test_tensor_parallel_without_its_launcher_is_a_one_line_error(tiny_checkpoint, args, message):
    result = run_cli("--model", str(tiny_checkpoint), "--raw", *args, words(3))
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_torchrun_with_the_wrong_world_size_is_an_error(tiny_checkpoint):
    result = run_torchrun(2, "--model", str(tiny_checkpoint), "--raw", "--tensor-parallel", "4", words(3))
    assert result.returncode != 0 and "torchrun started 2 processes" in result.stderr, result.stderr[-2000:]


@pytest.mark.cuda
def test_device_cuda_alone_and_sharded_give_the_same_tokens(tiny_checkpoint):
    """--device cuda, alone and under torchrun with 2 ranks (NCCL on 2 GPUs, gloo where they share
    one): the same tokens, greedy (equal to the CPU's too) and seeded."""
    base = ["--model", str(tiny_checkpoint), "--raw", "--json", "--max-new-tokens", "12"]
    cpu = json.loads(run_cli(*base, "--eager", *FAST, words(10)).stdout)["token_ids"]
    for extra in ([], ["--temperature", "1", "--seed", "5"]):
        alone = run_cli(*base, "--device", "cuda", *extra, words(10))
        sharded = run_torchrun(2, *base, "--device", "cuda", "--tensor-parallel", "2", *extra, words(10))
        assert alone.returncode == 0 and sharded.returncode == 0, (
            alone.stderr[-2000:] + sharded.stderr[-2000:]
        )
        got = json.loads(next(line for line in sharded.stdout.splitlines() if line.startswith("{")))
        assert got["token_ids"] == json.loads(alone.stdout)["token_ids"], f"{extra}: sharded on the GPU"
        if not extra:
            assert got["token_ids"] == cpu, "greedy on the GPU = greedy on the CPU"
