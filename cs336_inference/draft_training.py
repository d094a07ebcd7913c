"""Training a draft head (draft_head.py) on the target's own outputs, on a CPU.

Three stages, driven by scripts/train_draft.py; what is on disk is kept, so a stopped run resumes:

1. Data. Prompts are cut from the evaluation text (CPython's pydoc_data.topics; every tenth topic
   is held out): explain, summarize or rewrite a paragraph, comment or change a piece of its code;
   and general requests about everyday topics (GENERAL_TOPICS, every tenth held out), so that the
   head drafts chat too. The target answers them itself (greedy, the serving engine), so the head
   learns what the target says, not what a corpus says (self-distillation, as Medusa-2 and EAGLE do).
2. Features, taken while the target answers: the engine keeps, per position j, the feature h_j (the
   final norm's output) of every token it feeds, and greedy decoding makes each answer token the
   target's argmax y_j at the position before it. They are written to disk in chunks (safetensors,
   h in float16), so no second pass over the sequences is needed.
3. Training. The head sees (x_j, h_{j-1}) and is trained to give g_j close to h_j (smooth L1) and to
   put the target's argmax y_j first (cross-entropy over the head's vocabulary). A second, unrolled
   pass feeds the head its own g_{j-1} in place of h_{j-1}, as drafting does from the second draft
   on. Held-out acceptance: how often the head's first (and, unrolled, second) draft equals the
   target's argmax on the held-out topics. With bf16=True the training passes run under bfloat16
   autocast (the weights, the optimizer and the held-out passes stay float32), for a CPU with bf16
   products (AVX512-BF16, AMX: cpu_has_bf16).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
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
from .draft_head import DraftHead
from .model import TransformerLM

Log = Callable[[str], None]


# ------------------------------------------------------------------ 1-2. prompts, the target's answers and its features
def topic_split(held_out_every: int = 10) -> tuple[list[str], list[str]]:
    """The pydoc topics' texts, split by topic: (training topics, held-out topics)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    train = [topics[k] for i, k in enumerate(keys) if i % held_out_every != held_out_every - 1]
    held = [topics[k] for i, k in enumerate(keys) if i % held_out_every == held_out_every - 1]
    return train, held


def _paragraphs(text: str) -> tuple[list[str], list[str]]:
    """(prose paragraphs of 200-900 characters, code examples of 3-30 lines) of one topic."""
    prose, code = [], []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines:
            continue
        if all(line.startswith("   ") for line in lines):  # reST literal blocks are indented
            if 3 <= len(lines) <= 30 and not any(">>>" in line for line in lines[1:2]):
                code.append("\n".join(line[3:] if line.startswith("   ") else line for line in lines))
        else:
            para = " ".join(line.strip() for line in lines)
            if 200 <= len(para) <= 900:
                prose.append(para)
    return prose, code


PROSE_TASKS = [
    "Explain the following in simple terms:\n\n{}",
    "Summarize this text in two sentences:\n\n{}",
    "Rewrite the following paragraph in plain English, keeping its meaning:\n\n{}",
    "Copy the following text, correcting any typos:\n\n{}",
    "What is the main point of this passage?\n\n{}",
]
CODE_TASKS = [
    "Here is some Python code:\n\n{}\n\nAdd a comment to each line and return the code.",
    "Rewrite this Python code with clearer variable names:\n\n{}",
    "Explain what this Python code does:\n\n{}",
    "Here is a Python snippet:\n\n{}\n\nReturn the same code with type hints added where they fit.",
]


# General requests, for a head that also drafts chat: everyday topics under a few kinds of request.
# None is one of the speculative benchmark's chat prompts (bench/speculative.py), which stay unseen.
GENERAL_TOPICS = [
    "drinking enough water",
    "learning a new language",
    "saving money each month",
    "growing tomatoes",
    "the water cycle",
    "how vaccines work",
    "photosynthesis",
    "the moon's phases",
    "earthquakes",
    "volcanoes",
    "recycling plastic",
    "composting at home",
    "riding a bicycle in the city",
    "planning a road trip",
    "packing for a week of travel",
    "writing a good résumé",
    "preparing for a job interview",
    "working from home",
    "time management",
    "public speaking",
    "taking notes in class",
    "reading more books",
    "starting a small garden",
    "caring for a cat",
    "training a puppy",
    "keeping houseplants alive",
    "baking bread",
    "making a simple soup",
    "brewing coffee",
    "cooking rice",
    "meal planning for a week",
    "the history of the printing press",
    "the Roman Empire",
    "the invention of the telephone",
    "the first flight of the Wright brothers",
    "how a refrigerator works",
    "how airplanes stay in the air",
    "how the internet works",
    "what a computer's memory does",
    "how batteries store energy",
    "solar panels",
    "wind turbines",
    "electric cars",
    "the seasons of the year",
    "rainbows",
    "thunderstorms",
    "the ocean tides",
    "coral reefs",
    "honeybees",
    "migrating birds",
    "dinosaurs",
    "the human heart",
    "getting enough sleep",
    "stretching before exercise",
    "running a first 5 km race",
    "learning to swim",
    "playing chess",
    "learning to play the guitar",
    "painting with watercolors",
    "taking better photos with a phone",
    "writing a short story",
    "keeping a journal",
    "making friends in a new city",
    "resolving a disagreement with a roommate",
    "thanking a teacher",
    "apologizing to a friend",
    "asking for a day off",
    "welcoming a new team member",
    "organizing a birthday party",
    "hosting a dinner for friends",
    "choosing a laptop",
    "protecting passwords",
    "backing up files",
    "spotting phishing emails",
    "budgeting for groceries",
    "paying off a credit card",
    "opening a savings account",
    "renting a first apartment",
    "moving to a new home",
    "cleaning a kitchen quickly",
    "doing laundry",
    "fixing a flat bicycle tire",
    "changing a light bulb",
    "staying warm in winter",
    "staying cool in summer",
    "visiting a museum",
    "planning a picnic",
    "camping for the first time",
    "hiking safely",
    "reading a map",
    "the planets of the solar system",
    "black holes",
    "gravity",
    "magnets",
    "the speed of light",
    "why leaves change color in autumn",
    "how clouds form",
    "how bread rises",
    "how soap cleans",
    "the immune system",
    "washing hands",
    "reducing screen time",
    "meditation for beginners",
    "staying focused while studying",
    "preparing for an exam",
    "writing a thank-you letter",
    "writing a polite complaint",
    "giving feedback to a colleague",
    "leading a team meeting",
    "negotiating a salary",
    "starting a small business",
    "selling things online",
    "the basics of investing",
    "the history of the bicycle",
    "the Olympic Games",
    "the pyramids of Egypt",
    "the Great Wall of China",
    "learning to cook as a student",
    "choosing a pet",
    "volunteering in the community",
    "reducing food waste",
    "saving electricity at home",
    "walking more every day",
    "learning to type faster",
    "writing clear instructions",
    "reading food labels",
    "choosing running shoes",
    "the history of writing",
    "the invention of paper",
    "how maps are made",
    "how a compass works",
    "how glasses correct vision",
    "how the ear hears sound",
    "how plants drink water",
    "why the ocean is salty",
    "how snowflakes form",
    "how deserts form",
    "rivers and deltas",
    "rainforests",
    "the Arctic",
    "penguins",
    "elephants",
    "octopuses",
    "ants and their colonies",
    "how fish breathe",
    "the life of a butterfly",
    "the food chain",
    "endangered animals",
    "national parks",
    "city parks",
    "public libraries",
    "the post office",
    "how elections work",
    "paying taxes",
    "reading a contract",
    "buying a used car",
    "car maintenance",
    "taking the train",
    "learning to drive",
    "flying for the first time",
    "jet lag",
    "visiting another country",
    "learning about a new culture",
    "cooking pasta",
    "making pancakes",
    "baking cookies",
    "grilling vegetables",
    "storing food safely",
    "eating more vegetables",
    "drinking less sugar",
    "making tea",
    "setting up a home office",
    "keeping a tidy desk",
    "writing a to-do list",
    "setting goals for the new year",
    "building a habit",
    "breaking a bad habit",
    "handling stress",
    "staying motivated",
    "asking good questions",
    "listening well",
    "writing a speech",
    "giving a presentation",
    "making slides",
    "writing a report",
    "answering emails",
    "working in a team",
    "mentoring a junior colleague",
    "asking for help at work",
    "changing careers",
    "learning a new skill online",
    "studying with flashcards",
    "learning math",
    "fractions",
    "percentages",
    "reading a graph",
    "the scientific method",
    "atoms and molecules",
    "the periodic table",
    "electricity at home",
    "how a light bulb works",
    "how a microwave oven works",
    "how a smartphone works",
    "how search engines work",
    "what an algorithm is",
    "learning to program",
    "debugging a program",
    "writing clean code",
    "version control with git",
    "testing software",
    "what a database is",
    "cloud storage",
    "keeping a computer updated",
    "choosing a phone plan",
    "video calls",
    "social media and privacy",
    "online shopping safely",
    "the history of the computer",
    "the first moon landing",
    "the steam engine",
    "the history of medicine",
    "ancient Greece",
    "the Renaissance",
    "the Silk Road",
    "castles in the Middle Ages",
    "the history of chocolate",
    "the history of money",
    "how banks work",
    "inflation",
    "supply and demand",
    "making a family budget",
    "saving for retirement",
    "insurance",
    "donating to charity",
    "growing herbs on a windowsill",
    "planting a tree",
    "bird watching",
    "knitting",
    "woodworking for beginners",
    "learning to draw",
    "writing poetry",
    "singing in a choir",
    "listening to classical music",
    "starting a book club",
    "playing a board game with family",
    "learning to juggle",
    "yoga",
    "walking a dog",
    "feeding birds in winter",
    "keeping fish in an aquarium",
    "first aid for small cuts",
    "preparing for a power outage",
    "fire safety at home",
    "crossing the street safely",
]
GENERAL_TASKS = [
    "Explain {} in simple terms.",
    "Give three tips about {}. Answer briefly.",
    "Write a short message to a friend about {}.",
    "Why does {} matter? Answer in two sentences.",
    "Describe {} to a ten-year-old.",
    "What should a beginner know about {}?",
    "Write a short paragraph about {}.",
    "What mistakes do people often make with {}?",
    "Summarize the key facts about {} in a few sentences.",
    "Write a short email to a coworker about {}.",
    "How would you explain {} to a friend who has never heard of it?",
    "List the first steps of getting started with {}.",
    "Write a few sentences about {}.",
    "What are the main benefits of {}? Answer briefly.",
    "Write a short note to a neighbor about {}.",
    "Give two advantages and two disadvantages of {}.",
    "What is a common question about {}, and how would you answer it?",
    "Answer briefly: what is the most important thing to remember about {}?",
]


def general_prompts(seed: int = 0, held_out_every: int = 10) -> tuple[list[str], list[str]]:
    """(training, held-out) general requests: every task for each topic, every tenth topic held out,
    each list shuffled."""
    rng = random.Random(seed)
    split: tuple[list[str], list[str]] = ([], [])
    for i, topic in enumerate(GENERAL_TOPICS):
        split[i % held_out_every == held_out_every - 1].extend(task.format(topic) for task in GENERAL_TASKS)
    for prompts in split:
        rng.shuffle(prompts)
    return split


def draft_prompts(texts: list[str], seed: int = 0, tasks: int = 1) -> list[str]:
    """Chat requests built from the topics' paragraphs and code examples: one task drawn for each
    (the list shuffled), then, with tasks > 1, tasks - 1 other tasks for each (shuffled, after)."""
    rng, more = random.Random(seed), random.Random(seed + 1)
    first, extra = [], []
    for text in texts:
        prose, code = _paragraphs(text)
        for items, kinds in ((prose, PROSE_TASKS), (code, CODE_TASKS)):
            for item in items:
                task = rng.choice(kinds)
                first.append(task.format(item))
                others = [t for t in kinds if t != task]
                extra += [t.format(item) for t in more.sample(others, min(tasks - 1, len(others)))]
    rng.shuffle(first)
    more.shuffle(extra)
    return first + extra


def chat_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt as a user turn of the tokenizer's chat template, its generation prompt included."""
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                             add_special_tokens=False) for p in prompts]  # fmt: skip


@torch.inference_mode()
def answer_with_features(
    target: TransformerLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch: int = 16,
    log: Log = print,
) -> dict[str, Tensor]:
    """The target's greedy answers to the prompts (token ids) and its features over prompt + answer,
    in one pass: the serving engine answers `batch` prompts at a time on whatever path the target has
    installed, keeping the final norm's output of every row it computes (LLMEngine(keep_hidden=True)).

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
    head: DraftHead, x, prev, want, y, unroll: int, noise: float = 0.0, generator=None
) -> tuple[Tensor, Tensor, list[Float[Tensor, "M Vd"]]]:
    """(feature loss, token loss, logits per unrolled pass at the M positions with a label y >= 0) of
    a batch; labels -1 count in neither loss, labels outside the head's vocabulary only in the feature
    loss. The readout runs only at those M positions: most of a window is the prompt before the answer."""
    mapped = y
    if head.vocab_ids is not None:
        lookup = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=y.device)
        lookup[head.vocab_ids] = torch.arange(len(head.vocab_ids), device=y.device)
        mapped = torch.where(y >= 0, lookup[y.clamp(min=0)], y)
    valid = y >= 0
    at = valid.nonzero(as_tuple=True)
    counted = mapped[at]
    # the readout's rows padded to a multiple of READOUT_ROWS (padding counts in no loss): under bf16
    # autocast on a CPU, oneDNN keeps a packed copy of the weight for each shape it multiplies, so a
    # count of rows that differs every batch would grow the memory without bound
    M, pad = len(counted), -len(counted) % READOUT_ROWS
    at = tuple(torch.cat([i, i.new_zeros(pad)]) for i in at)
    counted = torch.cat([counted, counted.new_full((pad,), -1)])
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
        t_loss = t_loss + F.cross_entropy(logits.float(), counted, ignore_index=-1)
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
            f_loss, t_loss, _ = draft_losses(head, x, prev, want, y, s.unroll, s.noise, generator)
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
