"""scripts/roofline.py: the lecture's table from the formulas, and the quick measurement run."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "roofline.py"


def load_script():
    spec = importlib.util.spec_from_file_location("roofline_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:  # a busy 2-core machine
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_lecture_flag_prints_the_lecture_numbers(capsys):
    assert load_script().main(["--lecture"]) == 0
    out = capsys.readouterr().out
    assert "13,015,449,600 parameters" in out
    rows = {}
    for m in re.finditer(
        r"^(MHA K=40|GQA K=8)\s+(\d+)\s+[\d.]+\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+(yes|no)$", out, re.M
    ):
        rows[m[1], int(m[2])] = (int(m[3].replace(",", "")), float(m[4]), float(m[5]), m[6] == "yes")
    # The lecture's figures (bytes, ms, tok/s, fits in 80 GB); None where the lecture gives no latency.
    lecture = {
        ("MHA K=40", 1): (26_869_760_000, 8.0208, 124.675, True),
        ("MHA K=40", 64): (79_717_990_400, 23.796, 2689.48, True),
        ("MHA K=40", 256): (240_779_264_000, None, 3561.77, False),
        ("GQA K=8", 64): (33_412_874_240, None, 6416.69, True),
        ("GQA K=8", 256): (65_625_128_960, None, 13068.16, True),
    }
    for key, (n_bytes, ms, tok_s, fits) in lecture.items():
        got_bytes, got_ms, got_tok_s, got_fits = rows[key]
        assert got_bytes == n_bytes and got_fits == fits
        assert got_tok_s == pytest.approx(tok_s, abs=5e-3)
        if ms is not None:
            assert got_ms == pytest.approx(ms, abs=5e-4)
    assert "1,342,177,280 bytes" in out and "687,194,767,360 bytes" in out and "4.9x" in out
    assert "576 numbers per token" in out and "14.2x" in out
    assert "295.2 FLOPs per byte" in out


def test_quick_mode_writes_png_and_json(tmp_path):
    proc = run_script("--quick", "--device", "cpu", "--threads", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    png, data = tmp_path / "roofline.png", json.loads((tmp_path / "roofline.json").read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert data["device"] == "cpu" and data["torch_threads"] == 1
    for b in data["bandwidth"].values():
        assert b["bytes"] > 0 and 1e8 < b["bytes_per_s"] < 1e13  # 0.1 GB/s .. 10 TB/s
    assert all(1e8 < v < 1e16 for v in data["peak_flops"].values())
    matmul = data["matmul"]
    assert [r["BT"] for r in matmul] == [1, 4, 16, 64, 256]
    for rows in (matmul, data["model_steps"]):
        for r in rows:
            assert r["flops"] > 0 and r["bytes"] > 0 and r["predicted_s"] > 0 and r["measured_s"] > 0
    intensities = [r["intensity"] for r in matmul]
    assert intensities == sorted(intensities)
    assert matmul[0]["bound"] == "memory" and matmul[0]["intensity"] < 1  # fp32 matrix-vector: 0.5
    steps = {r["name"]: r for r in data["model_steps"]}
    assert set(steps) == {"decode B=1", "decode B=4", "decode B=16", "prefill T=64"}
    # Decode reads all weights for a handful of tokens; prefill reuses them T times.
    assert steps["decode B=1"]["intensity"] < 1 < steps["prefill T=64"]["intensity"]
    assert "GB/s" in proc.stdout and "GFLOP/s" in proc.stdout


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    script = load_script()
    assert script.main(["--quick", "--model", str(tmp_path / "missing.gguf"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("roofline: error:") and err.count("\n") == 1
    assert script.main(["--quick", "--context", "0"]) == 2
    assert "--context" in capsys.readouterr().err


@pytest.mark.cuda
def test_quick_mode_on_gpu(tmp_path):
    proc = run_script("--quick", "--device", "cuda", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "roofline.json").read_text())
    assert data["device"] == "cuda" and data["sweep_dtype"] == "bfloat16"
    times = {r["BT"]: r["measured_s"] for r in data["matmul"]}
    # Memory-bound region: reading the weight dominates, so 16 rows cost about what 1 row does.
    assert times[16] < 3 * times[1]
    assert data["peak_flops"]["bfloat16"] > data["peak_flops"]["float32"]
