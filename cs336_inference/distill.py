"""Knowledge distillation: train a (pruned) student to match the teacher's next-token distributions.

    loss = (1 - alpha) * T^2 * KL(softmax(z_teacher / T) || softmax(z_student / T)) + alpha * CE(z_student, x)

The KL runs in the teacher -> student direction (the student must put mass wherever the teacher
does) and at a temperature T, which flattens both distributions so that the teacher's ranking of
unlikely tokens carries signal; the T^2 keeps the gradient's size independent of T (the gradient of
the tempered KL scales as 1/T). Each step sees every vocabulary probability of every position: far
more signal per token than the one-hot target of cross-entropy, which is why a pruned model heals
faster by distillation than by continued pre-training on the same tokens.

The loop (`distill`): AdamW, linear warm-up then cosine decay to min_lr_ratio * lr, gradient
clipping, gradient accumulation, held-out KL / CE every eval_every steps, a tqdm bar, and checkpoints
(student weights and AdamW moments in safetensors, everything else in JSON: never a pickle) that
resume bit for bit: the batches come from a seeded generator whose state is saved with the rest.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn


class DistillCheckpointError(ValueError):
    """A distillation checkpoint that cannot be resumed from."""


# ------------------------------------------------------------------ the loss
def distill_loss(
    student_logits: Float[Tensor, "... V"], teacher_logits: Float[Tensor, "... V"], temperature: float = 1.0
) -> Float[Tensor, ""]:
    """T^2 * mean over positions of KL(p || q), p = softmax(teacher / T), q = softmax(student / T).

    KL(p || q) = sum_v p_v (log p_v - log q_v), summed over the vocabulary and averaged over every
    other dimension (batch and time). Computed in float32 from log-softmaxes (no log of a rounded
    zero). Gradients flow into student_logits only; teacher_logits are treated as constants.
    """
    # BEGIN SOLUTION distill_loss
    T = temperature
    log_q = F.log_softmax(student_logits.float() / T, dim=-1)
    log_p = F.log_softmax(teacher_logits.detach().float() / T, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return kl.mean() * T * T
    # END SOLUTION


# ------------------------------------------------------------------ data
def token_windows(ids: Int[Tensor, " N"], T: int, stride: int | None = None) -> Int[Tensor, "M T"]:
    """Windows of T consecutive tokens, starting every `stride` (default T: non-overlapping)."""
    stride = T if stride is None else stride
    if T < 2 or stride < 1:
        raise ValueError(f"need window T >= 2 and stride >= 1, got T={T}, stride={stride}")
    if ids.dim() != 1 or ids.numel() < T:
        raise ValueError(f"need a 1-D tensor of at least {T} token ids, got shape {tuple(ids.shape)}")
    return ids.unfold(0, T, stride).contiguous()


def split_topics(held_out_every: int = 10) -> tuple[str, str]:
    """The default eval text (CPython's pydoc_data.topics, sorted by topic) split by topic: every
    held_out_every-th topic is held out, the rest is for training. No topic is in both."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    train = [topics[k] for i, k in enumerate(keys) if i % held_out_every != held_out_every - 1]
    held = [topics[k] for i, k in enumerate(keys) if i % held_out_every == held_out_every - 1]
    return "\n\n".join(train), "\n\n".join(held)


@torch.no_grad()
def teacher_samples(teacher: nn.Module, n: int, T: int, seed: int = 0, temperature: float = 1.0) -> Tensor:
    """n sequences of T tokens sampled from the teacher (first token uniform), [n, T]."""
    device = teacher.embed.weight.device
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, teacher.config.vocab_size, (n, 1), generator=g, device=device)
    cache = teacher.new_cache(n, T)
    logits = teacher(ids, cache=cache)[:, -1]
    for _ in range(T - 1):
        probs = F.softmax(logits.float() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=g)
        ids = torch.cat([ids, nxt], dim=1)
        logits = teacher(nxt, cache=cache)[:, -1]
    return ids


# ------------------------------------------------------------------ evaluation
@torch.no_grad()
def held_out_metrics(
    student: nn.Module, teacher: nn.Module, windows: Int[Tensor, "M T"], batch_size: int = 8
) -> dict[str, float]:
    """Mean KL(teacher || student) per token at temperature 1 and the student's mean cross-entropy."""
    kl = ce = 0.0
    n = 0
    was_training = student.training
    student.eval()
    for start in range(0, windows.shape[0], batch_size):
        x = windows[start : start + batch_size].to(student.embed.weight.device)
        s, t = student(x[:, :-1]), teacher(x[:, :-1])
        tokens = x[:, 1:].numel()
        kl += float(distill_loss(s, t, 1.0)) * tokens
        ce += float(F.cross_entropy(s.flatten(0, 1).float(), x[:, 1:].flatten())) * tokens
        n += tokens
    student.train(was_training)
    return {"kl": kl / n, "ce": ce / n}


# ------------------------------------------------------------------ the loop
@dataclass
class DistillSettings:
    steps: int = 100
    batch_size: int = 8
    accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 10
    weight_decay: float = 0.0
    clip: float = 1.0
    temperature: float = 2.0
    alpha_ce: float = 0.0
    eval_every: int = 25
    seed: int = 0

    def check(self) -> None:
        for name in ("steps", "batch_size", "accum", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.alpha_ce <= 1.0:
            raise ValueError(f"alpha_ce must be in [0, 1], got {self.alpha_ce}")
        if self.temperature <= 0 or self.lr <= 0 or self.clip <= 0 or self.warmup < 0:
            raise ValueError("temperature, lr and clip must be > 0, warmup >= 0")


def lr_at(step: int, s: DistillSettings) -> float:
    """Linear warm-up over s.warmup steps, then cosine from s.lr down to s.min_lr_ratio * s.lr."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def distill(
    student: nn.Module,
    teacher: nn.Module,
    train_windows: Int[Tensor, "M T"],
    eval_windows: Int[Tensor, "E T"] | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    save_every: int | None = None,
    resume: bool = False,
    stop_at: int | None = None,
    progress: bool = True,
    budget_s: float | None = None,
    **settings,
) -> list[dict]:
    """Distill teacher into student in place; returns the history (one dict per evaluation).

    Each of `steps` optimizer steps averages the loss of `accum` micro-batches of `batch_size` windows
    drawn (with replacement) by a generator seeded with `seed`. With checkpoint_dir, a checkpoint is
    written every save_every steps and at the end (or at stop_at, to stop early); resume=True
    continues from the one there, bit for bit like an uninterrupted run (same settings required).
    budget_s: stop (evaluating and saving first) once this many seconds of training have passed.
    Settings (see DistillSettings): steps, batch_size, accum, lr, min_lr_ratio, warmup, weight_decay,
    clip, temperature, alpha_ce (weight of cross-entropy), eval_every, seed.
    """
    unknown = set(settings) - set(DistillSettings.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown distill settings: {sorted(unknown)}")
    s = DistillSettings(**settings)
    s.check()
    if train_windows.dim() != 2 or train_windows.shape[1] < 2:
        raise ValueError(f"train_windows must be [M, T] with T >= 2, got {tuple(train_windows.shape)}")
    device = student.embed.weight.device
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
    generator = torch.Generator().manual_seed(s.seed)
    history: list[dict] = []
    step = 0
    folder = None if checkpoint_dir is None else Path(checkpoint_dir)
    if resume:
        if folder is None or not (folder / STATE).exists():
            raise DistillCheckpointError(f"resume=True but there is no checkpoint in {checkpoint_dir}")
        step, history = load_checkpoint(folder, student, optimizer, generator, s)

    def evaluate(at: int, loss: float | None) -> None:
        if eval_windows is not None:
            history.append(
                {"step": at, "loss": loss, "lr": lr_at(max(at - 1, 0), s)}
                | held_out_metrics(student, teacher, eval_windows, s.batch_size)
            )

    if step == 0 and not history:
        evaluate(0, None)
    end = s.steps if stop_at is None else min(stop_at, s.steps)
    student.train()
    bar = _progress(range(step, end), progress, initial=step, total=s.steps)
    began = time.perf_counter()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, s)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(s.accum):
            rows = torch.randint(0, train_windows.shape[0], (s.batch_size,), generator=generator)
            x = train_windows[rows].to(device)
            inputs, targets = x[:, :-1], x[:, 1:]
            logits = student(inputs)
            loss = torch.zeros((), device=device)
            if s.alpha_ce < 1.0:
                with torch.no_grad():
                    t_logits = teacher(inputs)
                loss = loss + (1.0 - s.alpha_ce) * distill_loss(logits, t_logits, s.temperature)
            if s.alpha_ce > 0.0:
                ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                loss = loss + s.alpha_ce * ce
            (loss / s.accum).backward()
            total += float(loss.detach()) / s.accum
        torch.nn.utils.clip_grad_norm_(params, s.clip)
        optimizer.step()
        done = step + 1
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{total:.4f}")
        out_of_time = budget_s is not None and time.perf_counter() - began > budget_s
        if done % s.eval_every == 0 or done == s.steps or out_of_time:
            evaluate(done, total)
            if hasattr(bar, "write") and eval_windows is not None:
                bar.write(f"step {done}: held-out KL {history[-1]['kl']:.4f}, CE {history[-1]['ce']:.4f}")
        if folder is not None and ((save_every and done % save_every == 0) or done == end or out_of_time):
            save_checkpoint(folder, student, optimizer, generator, s, done, history)
        if out_of_time:
            break
    student.eval()
    return history


def _progress(iterable, enabled: bool, initial: int, total: int):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, initial=initial, total=total, desc="distill", dynamic_ncols=True)


# ------------------------------------------------------------------ checkpoints
STATE, WEIGHTS, OPTIM = "state.json", "student.safetensors", "optimizer.safetensors"


def save_checkpoint(folder, student, optimizer, generator, settings, step: int, history: list[dict]) -> None:
    """student weights and AdamW moments (+ the batch generator's state) as safetensors, the rest as
    JSON; each file is written to a temporary name and renamed, state.json last."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in student.state_dict().items()}
    sd = optimizer.state_dict()
    tensors = {"rng": generator.get_state()}
    for index, state in sd["state"].items():
        for key, value in state.items():
            tensors[f"{index}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    state = {"step": step, "settings": asdict(settings), "param_groups": groups, "history": history}
    for name, write in (
        (WEIGHTS, lambda p: save_file(weights, p)),
        (OPTIM, lambda p: save_file(tensors, p)),
        (STATE, lambda p: Path(p).write_text(json.dumps(state, indent=1))),
    ):
        tmp = folder / (name + ".tmp")
        write(tmp)
        os.replace(tmp, folder / name)


def load_checkpoint(folder, student, optimizer, generator, settings) -> tuple[int, list[dict]]:
    """Restore what save_checkpoint wrote; DistillCheckpointError (one line) if anything is off."""
    folder = Path(folder)
    try:
        state = json.loads((folder / STATE).read_text())
        weights, tensors = load_file(folder / WEIGHTS), load_file(folder / OPTIM)
        step, groups, history = int(state["step"]), state["param_groups"], list(state["history"])
        saved = state["settings"]
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        raise DistillCheckpointError(
            f"{folder}: corrupt or incomplete distillation checkpoint ({e})"
        ) from None
    if saved != asdict(settings):
        diff = sorted(k for k in asdict(settings) if saved.get(k) != asdict(settings)[k])
        raise DistillCheckpointError(f"{folder}: checkpoint was made with other settings ({', '.join(diff)})")
    try:
        student.load_state_dict(weights)
        opt_state: dict = {}
        for name, value in tensors.items():
            if name == "rng":
                continue
            index, _, key = name.partition(".")
            opt_state.setdefault(int(index), {})[key] = value
        optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
        generator.set_state(tensors["rng"])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistillCheckpointError(f"{folder}: checkpoint does not fit this student ({first})") from None
    return step, history
