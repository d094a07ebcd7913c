"""Distillation: the loss against a float64 re-statement (value, direction, temperature, gradient), the
loop against its promises (held-out KL falls, and faster than cross-entropy on the same tokens; resume
is bit for bit; a corrupt checkpoint is one clear error; GPU and CPU agree)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cs336_inference import ModelConfig, TransformerLM
from cs336_inference.distill import (
    DistillCheckpointError,
    distill,
    distill_loss,
    split_topics,
    teacher_samples,
    token_windows,
)
from cs336_inference.pruning import prune


def kl_reference(student: np.ndarray, teacher: np.ndarray, T: float) -> float:
    """T^2 * mean over rows of sum_v p_v (log p_v - log q_v), in float64."""
    s, t = student.astype(np.float64) / T, teacher.astype(np.float64) / T
    log_q = s - s.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    log_p = t - t.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    return float(kl.mean() * T * T)


def logits_pair(seed: int = 0, shape=(2, 5, 11)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = 3.0 * torch.randn(*shape, generator=g)
    teacher = 3.0 * torch.randn(*shape, generator=g)
    teacher[..., 0] += 6.0  # a confident teacher: KL(p||q) and KL(q||p) differ clearly
    return student, teacher


# ------------------------------------------------------------------ the loss (graded)
@pytest.mark.graded(problem="distill_loss", points=2)
@pytest.mark.parametrize("T", [1.0, 2.0, 4.0])
def test_distill_loss_equals_tempered_kl_teacher_to_student(T):
    student, teacher = logits_pair()
    want = kl_reference(student.numpy(), teacher.numpy(), T)
    other_direction = kl_reference(teacher.numpy(), student.numpy(), T)
    got = float(distill_loss(student, teacher, T))
    assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (
        f"T={T}: expected T^2 * mean KL(teacher || student) = {want:.6f}, got {got:.6f}"
        + (
            " (that is KL(student || teacher): the direction is reversed)"
            if abs(got - other_direction) < 1e-3
            else ""
        )
        + (" (that lacks the T^2 factor)" if T != 1 and abs(got - want / T**2) < 1e-3 else "")
    )


@pytest.mark.graded(problem="distill_loss", points=1)
def test_distill_loss_is_zero_for_equal_logits_and_averages_over_positions():
    student, teacher = logits_pair(1)
    assert abs(float(distill_loss(teacher.clone(), teacher, 2.0))) < 1e-6, (
        "KL of a distribution to itself must be 0"
    )
    shifted = float(distill_loss(student + 5.0, teacher, 2.0))
    base = float(distill_loss(student, teacher, 2.0))
    assert abs(shifted - base) < 1e-4, (
        f"adding a constant to every logit must not change the loss: {base} vs {shifted}"
    )
    # mean over positions: one row repeated three times gives the same loss as the row alone
    row_s, row_t = student[:1, :1], teacher[:1, :1]
    one = float(distill_loss(row_s, row_t, 2.0))
    three = float(distill_loss(row_s.expand(3, 1, -1), row_t.expand(3, 1, -1), 2.0))
    assert abs(one - three) < 1e-5, (
        f"the loss must be a mean over positions: one row {one:.6f}, three copies {three:.6f}"
    )


@pytest.mark.graded(problem="distill_loss", points=1)
def test_distill_loss_gradient_is_T_times_q_minus_p_over_positions():
    student, teacher = logits_pair(2)
    T = 3.0
    student.requires_grad_(True)
    teacher.requires_grad_(True)
    distill_loss(student, teacher, T).backward()
    n = student.shape[0] * student.shape[1]
    want = T * (torch.softmax(student.detach() / T, -1) - torch.softmax(teacher.detach() / T, -1)) / n
    err = (student.grad - want).abs().max()
    assert err < 1e-5, (
        f"d loss / d student logits must be T (q - p) / positions; off by up to {float(err):.3g}"
    )
    assert teacher.grad is None or not teacher.grad.abs().any(), (
        "no gradient may flow into the teacher's logits"
    )


# ------------------------------------------------------------------ the loop
CFG = dict(
    vocab_size=64,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    max_seq_len=64,
    model_type="llama",
)


def teacher_and_data(seed: int = 0):
    torch.manual_seed(seed)
    teacher = TransformerLM(ModelConfig(**CFG)).eval()
    with torch.no_grad():
        teacher.lm_head.weight.mul_(4.0)  # a teacher with opinions (a random one is close to uniform)
    data = teacher_samples(teacher, 96, 24, seed=1)
    return teacher, data[:80], data[80:]


def student_of(teacher):
    """The teacher's first and last layers: a pruned student that starts close but not equal."""
    return prune(teacher, layers=[0, 3])


SETTINGS = dict(steps=40, batch_size=8, lr=3e-3, warmup=4, eval_every=20, temperature=1.0, seed=0)


def test_distillation_lowers_held_out_kl_more_than_cross_entropy():
    teacher, train, held = teacher_and_data()
    train = train[:16]  # little data: each window's full distributions teach more than its one-hot tokens
    kd = student_of(teacher)
    history_kd = distill(kd, teacher, train, held, progress=False, **SETTINGS)
    ce = student_of(teacher)
    history_ce = distill(ce, teacher, train, held, progress=False, **{**SETTINGS, "alpha_ce": 1.0})
    start, kd_end, ce_end = history_kd[0]["kl"], history_kd[-1]["kl"], history_ce[-1]["kl"]
    assert history_ce[0]["kl"] == start
    assert kd_end < 0.7 * start, f"distillation: held-out KL {start:.4f} -> {kd_end:.4f} in 40 steps"
    assert kd_end < 0.9 * ce_end, (
        f"KD must beat CE on the same tokens and steps: KL {kd_end:.4f} vs {ce_end:.4f}"
    )


def test_resume_continues_bit_for_bit(tmp_path):
    teacher, train, held = teacher_and_data()
    settings = {**SETTINGS, "steps": 12, "accum": 2, "eval_every": 4, "weight_decay": 0.01}
    straight = student_of(teacher)
    h1 = distill(straight, teacher, train, held, progress=False, **settings)
    resumed = student_of(teacher)
    distill(resumed, teacher, train, held, checkpoint_dir=tmp_path, stop_at=5, progress=False, **settings)
    assert json.loads((tmp_path / "state.json").read_text())["step"] == 5
    again = student_of(teacher)  # a fresh student: everything comes from the checkpoint
    h2 = distill(
        again, teacher, train, held, checkpoint_dir=tmp_path, resume=True, progress=False, **settings
    )
    assert h1 == h2
    for (name, a), b in zip(straight.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resuming"


def test_corrupt_or_mismatched_checkpoint_is_one_clear_error(tmp_path):
    teacher, train, held = teacher_and_data()
    settings = {**SETTINGS, "steps": 3}
    distill(student_of(teacher), teacher, train, None, checkpoint_dir=tmp_path, progress=False, **settings)
    with pytest.raises(DistillCheckpointError, match="other settings"):
        distill(
            student_of(teacher),
            teacher,
            train,
            None,
            checkpoint_dir=tmp_path,
            resume=True,
            progress=False,
            **{**settings, "lr": 1.0},
        )
    with pytest.raises(DistillCheckpointError, match="does not fit"):
        distill(
            prune(teacher, layers=[1]),
            teacher,
            train,
            None,
            checkpoint_dir=tmp_path,
            resume=True,
            progress=False,
            **settings,
        )
    blob = (tmp_path / "optimizer.safetensors").read_bytes()
    (tmp_path / "optimizer.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DistillCheckpointError, match="corrupt"):
        distill(
            student_of(teacher),
            teacher,
            train,
            None,
            checkpoint_dir=tmp_path,
            resume=True,
            progress=False,
            **settings,
        )
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(DistillCheckpointError, match="corrupt"):
        distill(
            student_of(teacher),
            teacher,
            train,
            None,
            checkpoint_dir=tmp_path,
            resume=True,
            progress=False,
            **settings,
        )
    with pytest.raises(DistillCheckpointError, match="no checkpoint"):
        distill(
            student_of(teacher),
            teacher,
            train,
            None,
            checkpoint_dir=tmp_path / "none",
            resume=True,
            progress=False,
            **settings,
        )


def test_bad_settings_and_data():
    teacher, train, _ = teacher_and_data()
    with pytest.raises(ValueError, match="unknown distill settings"):
        distill(student_of(teacher), teacher, train, steps=1, epochs=3)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        distill(student_of(teacher), teacher, train, steps=0)
    with pytest.raises(ValueError, match="train_windows"):
        distill(student_of(teacher), teacher, train[0], steps=1)
    with pytest.raises(ValueError, match="at least 8"):
        token_windows(torch.arange(5), 8)
    assert token_windows(torch.arange(10), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_topic_split_is_disjoint():
    train, held = split_topics()
    assert held and train and held not in train
    from pydoc_data.topics import topics

    assert len(train) + len(held) + 2 == len("\n\n".join(topics[k] for k in sorted(topics)))


@pytest.mark.cuda
def test_a_distillation_step_on_gpu_matches_cpu():
    teacher, train, held = teacher_and_data()
    losses = {}
    for device in ("cpu", "cuda"):
        t = teacher.to(device)
        student = student_of(t)
        history = distill(
            student, t, train, held, progress=False, **{**SETTINGS, "steps": 1, "eval_every": 1}
        )
        losses[device] = history[-1]["loss"]
    assert abs(losses["cpu"] - losses["cuda"]) < 1e-3 * max(1.0, abs(losses["cpu"])), losses
