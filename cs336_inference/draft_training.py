"""Training a draft head (draft_head.py) on the target's own outputs, on a CPU.

Three stages, driven by scripts/train_draft.py; what is on disk is kept, so a stopped run resumes:

1. Data. Requests about CPython's documentation and general chat requests (draft_prompts.py, each
   with held-out subjects). The target answers them itself (greedy, the serving engine), so the head
   learns what the target says, not what a corpus says (self-distillation, as Medusa-2 and EAGLE do).
2. Features, taken while the target answers: the engine keeps, per position j, the feature h_j (the
   final norm's output) of every token it feeds, and greedy decoding makes each answer token the
   target's argmax y_j at the position before it. They are written to disk in chunks (safetensors,
   h in float16), so no second pass over the sequences is needed.
3. Training. The head sees (x_j, h_{j-1}) and is trained to give g_j close to h_j (smooth L1) and to
   put the target's argmax y_j first (cross-entropy over the head's vocabulary) at the answers'
   tokens, or (every_position, train_draft.py's default) to match the target's distribution
   softmax(h_j W^T) at every position, the prompt's too: the features say what the target predicts
   there, whoever wrote the next token. A second, unrolled pass feeds the head its own g_{j-1} in
   place of h_{j-1}, as drafting does from the second draft on. Held-out acceptance: how often the
   head's first (and, unrolled, second) draft equals the target's argmax on the held-out topics.
   With bf16=True the training passes run under bfloat16 autocast (the weights, the optimizer and the
   held-out passes stay float32), for a CPU with bf16 products (AVX512-BF16, AMX: cpu_has_bf16).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from safetensors.torch import load_file, save_file
from torch import Tensor

from .distill import load_checkpoint, lr_at, save_checkpoint
from .draft_head import DraftHead, load_draft_head
from .model import TransformerLM

Log = Callable[[str], None]


# ------------------------------------------------------------------ 1-2. the target's answers and its features
@torch.inference_mode()
def answer_with_features(
    target: TransformerLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch: int = 24,
    log: Log = print,
) -> dict[str, Tensor]:
    """The target's greedy answers to the prompts (token ids) and its features over prompt + answer,
    in one pass: the serving engine answers `batch` prompts at a time on whatever path the target has
    installed, keeping the final norm's output of every row it computes (LLMEngine(keep_hidden=True)).
    With 24 sequences and 32 rows a step, the native kernels' row limit, a step's rows are full (more
    rows would go to BLAS, slower here); a sequence's answer does not depend on its neighbours.

    Returns a chunk as `load_features` joins them: tokens [N] int32, feats [N, D] float16, labels [N]
    int32 (the next token, -1 after a sequence's last: at an answer position the target's greedy
    choice, which is what the token loss counts), starts [M + 1] int64 (sequence boundaries). A
    sequence's last token is never fed back, so its feature is zero; no loss reads it."""
    from .sampling import SamplingParams
    from .serving import LLMEngine

    engine = LLMEngine(
        target, num_blocks=batch * 48, block_size=16, max_batch_tokens=32, max_batch_seqs=batch,
        keep_hidden=True,
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    tokens, feats, labels, starts = [], [], [], [0]
    began = time.perf_counter()
    for start in range(0, len(prompts), 8 * batch):  # the engine keeps `batch` running; a log line per group
        group = prompts[start : start + 8 * batch]
        for prompt, (out,) in zip(group, engine.run(group, params), strict=True):
            seq = torch.tensor(list(prompt) + out.new_token_ids, dtype=torch.int32)
            tokens.append(seq)
            feats.append(torch.cat([out.hidden, out.hidden.new_zeros(1, out.hidden.shape[1])]).half())
            labels.append(torch.cat([seq[1:], torch.tensor([-1], dtype=torch.int32)]))
            starts.append(starts[-1] + len(seq))
        log(f"  answered {len(tokens)}/{len(prompts)} prompts ({starts[-1]} tokens, "
            f"{time.perf_counter() - began:.0f} s)")  # fmt: skip
    return {"tokens": torch.cat(tokens), "feats": torch.cat(feats), "labels": torch.cat(labels),
            "starts": torch.tensor(starts)}  # fmt: skip


def save_chunk(chunk: dict[str, Tensor], path: str | Path) -> Path:
    """Write a chunk (answer_with_features) as safetensors, whole or not at all (a temporary file
    renamed), so that an interrupted run never leaves half a chunk to resume from."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(chunk, str(tmp))
    tmp.rename(path)
    return path


def chunk_path(folder: str | Path, prompts: list[str], max_new_tokens: int, model: str) -> Path:
    """Where the chunk of these prompts' answers goes: named by what it depends on (resumable)."""
    key = hashlib.sha1(json.dumps([model, max_new_tokens, prompts]).encode()).hexdigest()[:12]
    return Path(folder) / f"answers-{key}.safetensors"


def answer_starts(sequences: list[list[int]], header: list[int]) -> list[int]:
    """Per sequence, the index of its first answer token: just after the last chat header (the
    template's "assistant" turn opening); len(sequence) when there is none (plain text)."""
    out = []
    n = len(header)
    for seq in sequences:
        at = len(seq)
        for i in range(len(seq) - n, -1, -1):
            if seq[i : i + n] == header:
                at = i + n
                break
        out.append(at)
    return out


def load_features(paths: list[Path]) -> dict[str, Tensor]:
    """The chunks joined: tokens, feats, labels, and starts (sequence boundaries) over all of them."""
    parts = [load_file(str(p)) for p in paths]
    starts, offset = [torch.zeros(1, dtype=torch.long)], 0
    for part in parts:
        starts.append(part["starts"][1:] + offset)
        offset += int(part["starts"][-1])
    return {
        "tokens": torch.cat([p["tokens"] for p in parts]).long(),
        "feats": torch.cat([p["feats"] for p in parts]),
        "labels": torch.cat([p["labels"] for p in parts]).long(),
        "starts": torch.cat(starts),
    }


def frequent_tokens(labels: Int[Tensor, " N"], n: int, always: list[int] = ()) -> Int[Tensor, " n"]:
    """The n token ids the target predicts most often (plus `always`, e.g. the EOS ids), sorted."""
    counts = torch.bincount(labels)
    top = counts.argsort(descending=True)[:n].tolist()
    return torch.tensor(sorted(set(top) | set(always)))


def generation_header(tokenizer) -> list[int]:
    """The token ids the chat template puts before an answer (its generation prompt)."""
    messages = [{"role": "user", "content": "x"}]
    with_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    return tokenizer.encode(with_prompt[len(without) :], add_special_tokens=False)


def mark_answers(data: dict[str, Tensor], header: list[int]) -> dict[str, Tensor]:
    """data with "answer": a bool [N], True at every answer token (after a sequence's last header)."""
    starts = data["starts"].tolist()
    seqs = [data["tokens"][a:b].tolist() for a, b in zip(starts[:-1], starts[1:], strict=True)]
    answer = torch.zeros(len(data["tokens"]), dtype=torch.bool)
    for a, seq, at in zip(starts[:-1], seqs, answer_starts(seqs, header), strict=True):
        answer[a + at : a + len(seq)] = True
    return {**data, "answer": answer}


def training_windows(data: dict[str, Tensor], T: int) -> Int[Tensor, "M 2"]:
    """(start, length) of training windows. With an "answer" mask: one per sequence that has an
    answer, its last T + 1 positions (the answer and the prompt before it); else each sequence cut
    into pieces of at most T + 1 positions. Position 0 of a window supplies only the feature h_{j-1}
    of the next."""
    out = []
    starts = data["starts"].tolist()
    if "answer" in data:
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            if bool(data["answer"][a:b].any()):
                s = max(a, b - (T + 1))
                out.append((s, b - s))
        return torch.tensor(out)
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        for s in range(a, b - 1, T):
            n = min(T + 1, b - s)
            if n >= 2:
                out.append((s, n))
    return torch.tensor(out)


# ------------------------------------------------------------------ 3. training
def continued_head(folder: str | Path, target: TransformerLM, vocab: Int[Tensor, " Vd"] | None) -> DraftHead:
    """The head saved in folder, attached to target, to train on: ValueError (one line) where it reads
    out another draft vocabulary than `vocab` (the one this data gives), which would mislabel every
    token."""
    head = load_draft_head(folder, target)
    ids = None if head.vocab_ids is None else head.vocab_ids.cpu()
    if (ids is None) != (vocab is None) or (vocab is not None and not torch.equal(ids, vocab.cpu())):
        raise ValueError(f"the draft head in {folder} was trained with another draft vocabulary")
    return head


@dataclass
class DraftSettings:
    steps: int = 1000
    batch_size: int = 8
    T: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 1.0
    w_feature: float = 1.0
    w_token: float = 0.5
    unroll: int = 2
    noise: float = 0.02
    eval_every: int = 200
    seed: int = 0
    bf16: bool = False  # training passes under bfloat16 autocast (weights and optimizer in float32)
    every_position: bool = False  # the prompts' positions count too, against the target's distribution


def _batch(data, wins: Tensor, rows: list[int], T: int, device) -> tuple[Tensor, ...]:
    """Padded [B, T] inputs: tokens x_j, features h_{j-1}, targets h_j and labels y_j (-1: not a
    position that counts: padding, or, when data has an "answer" mask, a label that is not an answer
    token's prediction)."""
    B = len(rows)
    D = data["feats"].shape[1]
    x = torch.zeros(B, T, dtype=torch.long)
    prev = torch.zeros(B, T, D)
    want = torch.zeros(B, T, D)
    y = torch.full((B, T), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        s, n = wins[r].tolist()
        m = n - 1
        x[b, :m] = data["tokens"][s + 1 : s + n]
        prev[b, :m] = data["feats"][s : s + m].float()
        want[b, :m] = data["feats"][s + 1 : s + n].float()
        y[b, :m] = data["labels"][s + 1 : s + n]
        if "answer" in data:  # y_j predicts x_{j+1}: it counts when x_{j+1} is an answer token
            keep = data["answer"][s + 2 : s + n + 1]
            y[b, : len(keep)] = torch.where(keep, y[b, : len(keep)], -1)
            y[b, len(keep) : m] = -1
    return x.to(device), prev.to(device), want.to(device), y.to(device)


READOUT_ROWS = 128


def draft_losses(
    head: DraftHead,
    x,
    prev,
    want,
    y,
    unroll: int,
    noise: float = 0.0,
    generator=None,
    every_position: bool = False,
) -> tuple[Tensor, Tensor, list[Float[Tensor, "M Vd"]]]:
    """(feature loss, token loss, logits per unrolled pass at the M positions that count) of a batch.

    By default the positions that count are those with a label y >= 0 (the answers' tokens, whose
    label is the target's argmax); labels outside the head's vocabulary count only in the feature
    loss. every_position: every position with a feature counts, the prompt's too (a zero `want` marks
    padding and a sequence's last position), and the token loss is a cross-entropy against the
    target's own distribution softmax(h_j W^T) over the head's vocabulary rather than its argmax: at
    a prompt position the label is the user's next token, which is not what the target predicts. The
    readout runs only at the M positions (most of a window is the prompt before the answer)."""
    valid = want.abs().amax(dim=-1) > 0 if every_position else y >= 0
    at = valid.nonzero(as_tuple=True)
    counted = y[at]
    if head.vocab_ids is not None and not every_position:
        lookup = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=y.device)
        lookup[head.vocab_ids] = torch.arange(len(head.vocab_ids), device=y.device)
        counted = lookup[counted]
    # the readout's rows padded to a multiple of READOUT_ROWS (padding counts in no loss): under bf16
    # autocast on a CPU, oneDNN keeps a packed copy of the weight for each shape it multiplies, so a
    # count of rows that differs every batch would grow the memory without bound
    M, pad = len(counted), -len(counted) % READOUT_ROWS
    at = tuple(torch.cat([i, i.new_zeros(pad)]) for i in at)
    counted = torch.cat([counted, counted.new_full((pad,), -1)])
    soft = None
    if every_position:  # the target's distribution at the M positions (padding rows: all zero)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            soft = F.linear(want[at].float(), head.readout.float()).softmax(dim=-1)
            soft[M:] = 0.0
    feats = (
        prev if noise == 0 else prev + noise * torch.randn(prev.shape, generator=generator).to(prev.device)
    )
    f_loss = t_loss = torch.zeros((), device=x.device)
    all_logits = []
    for _ in range(unroll):
        g = head(x, feats)
        logits = head.logits(g[at])
        all_logits.append(logits[:M])
        diff = F.smooth_l1_loss(g, want, reduction="none") * valid[..., None]
        f_loss = f_loss + diff.sum() / (valid.sum() * g.shape[-1]).clamp(min=1)
        if soft is None:
            t_loss = t_loss + F.cross_entropy(logits.float(), counted, ignore_index=-1)
        else:
            t_loss = t_loss + F.cross_entropy(logits.float(), soft, reduction="sum") / max(M, 1)
        feats = torch.cat([prev[:, :1], g[:, :-1]], dim=1)  # the next pass reads the head's own g_{j-1}
    return f_loss / unroll, t_loss / unroll, all_logits


@torch.no_grad()
def held_out_acceptance(head: DraftHead, data, wins: Tensor, T: int, unroll: int, batch: int = 8) -> dict:
    """How often the head's draft equals the target's argmax y_j on held-out windows: depth 1 reads
    the target's h_{j-1}, depth 2 the head's own g_{j-1} (its second draft of a round)."""
    was = head.training
    head.eval()
    hits = [0] * unroll
    n = 0
    device = head.fc.weight.device
    for start in range(0, len(wins), batch):
        rows = list(range(start, min(start + batch, len(wins))))
        x, prev, want, y = _batch(data, wins, rows, T, device)
        _, _, logits = draft_losses(head, x, prev, want, y, unroll)
        labels = y[y >= 0]
        for u, lg in enumerate(logits):
            hits[u] += int((head.token_ids(lg.argmax(-1)) == labels).sum())
        n += len(labels)
    head.train(was)
    return {f"accept_depth{u + 1}": hits[u] / max(n, 1) for u in range(unroll)}


def train_draft_head(
    head: DraftHead,
    train: dict[str, Tensor],
    held: dict[str, Tensor],
    checkpoint_dir: str | Path,
    resume: bool = True,
    log: Log = print,
    progress: bool = True,
    stop_at: int | None = None,
    **settings,
) -> list[dict]:
    """Train `head` (attached to its target) in place; a checkpoint every eval_every steps (and at
    stop_at, to stop early) in checkpoint_dir, resumed from if there (same settings required), bit
    for bit like an uninterrupted run. Returns the history (per evaluation: step, epoch, training
    losses, held-out acceptance at depths 1..unroll)."""
    s = DraftSettings(**settings)
    device = head.fc.weight.device
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    generator = torch.Generator().manual_seed(s.seed)
    folder = Path(checkpoint_dir)
    step, history = 0, []
    if resume and (folder / "state.json").exists():
        step, history = load_checkpoint(folder, head, optimizer, generator, s)
        log(f"resumed at step {step}")
    wins, held_wins = training_windows(train, s.T), training_windows(held, s.T)
    per_epoch = math.ceil(len(wins) / s.batch_size)
    if step == 0:
        history.append({"step": 0, "epoch": 0.0} | held_out_acceptance(head, held, held_wins, s.T, s.unroll))
        log(_line(history[-1]))
    end = s.steps if stop_at is None else min(stop_at, s.steps)
    bar = range(step, end)
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(bar, initial=step, total=s.steps, desc="train draft head", dynamic_ncols=True)
    head.train()
    sums = {"feature": 0.0, "token": 0.0, "n": 0}
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, s)
        # an epoch: every window once, in an order drawn by the seeded generator
        epoch, at = divmod(step, per_epoch)
        order = torch.randperm(len(wins), generator=torch.Generator().manual_seed(s.seed + epoch))
        rows = order[at * s.batch_size : (at + 1) * s.batch_size].tolist()
        x, prev, want, y = _batch(train, wins, rows, s.T, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=s.bf16):
            f_loss, t_loss, _ = draft_losses(
                head, x, prev, want, y, s.unroll, s.noise, generator, every_position=s.every_position
            )
        loss = s.w_feature * f_loss + s.w_token * t_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s.clip)
        optimizer.step()
        sums["feature"] += f_loss.item()
        sums["token"] += t_loss.item()
        sums["n"] += 1
        done = step + 1
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(feature=f"{f_loss.item():.4f}", token=f"{t_loss.item():.3f}")
        if done % s.eval_every == 0 or done == s.steps or done == end:
            row = {"step": done, "epoch": round(done / per_epoch, 2),
                   "feature_loss": sums["feature"] / sums["n"], "token_loss": sums["token"] / sums["n"]}  # fmt: skip
            row |= held_out_acceptance(head, held, held_wins, s.T, s.unroll)
            history.append(row)
            sums = {"feature": 0.0, "token": 0.0, "n": 0}
            (bar.write if hasattr(bar, "write") else log)(_line(row))
            save_checkpoint(folder, head, optimizer, generator, s, done, history)
    head.eval()
    return history


def cpu_has_bf16() -> bool:
    """Whether this x86 CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX), where training under
    bf16 autocast pays; a CPU without them emulates bf16, slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None


def _line(row: dict) -> str:
    parts = [f"step {row['step']} (epoch {row['epoch']:.2f})"]
    if "feature_loss" in row:
        parts.append(f"feature loss {row['feature_loss']:.4f}, token loss {row['token_loss']:.3f}")
    parts.append(
        "held-out acceptance " + ", ".join(f"{row[k]:.3f}" for k in sorted(row) if k.startswith("accept"))
    )
    return "; ".join(parts)


def format_history(history: list[dict]) -> str:
    """The training log as a markdown table: per evaluation, the mean training losses since the last
    one and the held-out acceptance at each depth."""
    depths = sorted(k for k in history[-1] if k.startswith("accept_depth"))
    head = "| step | epoch | feature loss | token loss | " + " | ".join(
        f"held-out acceptance, draft {k.removeprefix('accept_depth')}" for k in depths
    )
    lines = [head + " |", "| ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in depths) + " |"]
    for row in history:
        losses = f"{row['feature_loss']:.4f} | {row['token_loss']:.3f}" if "feature_loss" in row else "– | –"
        accept = " | ".join(f"{row[k]:.3f}" for k in depths)
        lines.append(f"| {row['step']} | {row['epoch']:.2f} | {losses} | {accept} |")
    return "\n".join(lines)
