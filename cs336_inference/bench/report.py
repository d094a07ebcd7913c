"""What a benchmark writes for the docs: its table under one line that names the command, the CPU,
torch and the date, so that a figure in docs/ is never pasted by hand (`benchmark.py ... --markdown F`).
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

import torch


def cpu_description() -> str:
    """The CPU as /proc/cpuinfo names it, with what tells two machines of the same name apart (its
    family and model numbers, the widest vector unit) and the cores this process may use."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    extra = [f"family {fields['cpu family']} model {fields['model']}"] if "cpu family" in fields else []
    extra += [vector] if vector else []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    extra.append(f"{cores} cores")
    return f"{name} ({', '.join(extra)})"


def command_line(argv: list[str] | None = None) -> str:
    """The command that is running, as a reader would type it again."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    script = (
        script.relative_to(Path.cwd())
        if script.is_absolute() and script.is_relative_to(Path.cwd())
        else script
    )
    return shlex.join(["python", str(script), *argv[1:]])


def markdown(table: str, command: str | None = None, today: datetime.date | None = None) -> str:
    """The table as a docs/ section: a line with the command, CPU, torch and date, then the table."""
    today = today or datetime.date.today()
    head = (
        f"`{command or command_line()}` on {cpu_description()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {today.isoformat()}:"
    )
    return f"{head}\n\n```text\n{table.rstrip()}\n```\n"


def write_markdown(path: Path, table: str, command: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown(table, command))
