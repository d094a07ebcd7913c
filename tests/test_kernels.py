"""The decode kernels (cs336_inference/fast/cpu): equal to the readable references, a row's result
independent of the rows beside it, and optional (disabled or unbuildable, the PyTorch path runs)."""

import math

import pytest
import torch
import torch.nn.functional as F

from cs336_inference.config import ModelConfig
from cs336_inference.fast import cpu as kernels
from cs336_inference.fast import install
from cs336_inference.fast.cpu import build
from cs336_inference.layers import Linear
from cs336_inference.model import TransformerLM
from cs336_inference.quantization import QuantizedLinear, quantize_model
from cs336_inference.sampling import generate

# (name, d_out, d_in, group_size): widths that are not multiples of the 32-wide blocks of the kernels
# where the format allows it, and numbers of outputs that leave a short last tile (tiles are 2, 3 or 4
# output rows wide)
CASES = [
    ("fp32_rows", 37, 70, None),
    ("fp32_cols", 37, 70, None),
    ("fp32_cols", 45, 96, None),  # one whole 32-column tile and a partial one
    ("fp32_panels", 37, 70, None),  # 3 panels of 16 rows, the last one padded
    ("fp32_panels", 200, 33, None),  # 13 panels: a short last tile whether tiles are 1, 3 or 4 panels
    ("int8", 37, 70, None),
    ("int8", 33, 64, None),
    ("int4", 37, 70, 10),  # groups that are not whole 32-blocks: the scalar path
    ("int4", 33, 128, 64),  # the vector path
    ("int4", 21, 96, 32),
    ("int4", 38, 64, 32),  # a last tile of 2 rows whether tiles are 2, 3 or 4 rows wide
    ("q8_0", 37, 96, None),
    ("q4_0", 37, 96, None),
    ("q4_1", 37, 96, None),
]
IDS = [f"{name}-{o}x{i}" + (f"-g{g}" if g else "") for name, o, i, g in CASES]


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.delenv("CS336_KERNELS", raising=False)
    monkeypatch.setenv("CS336_KERNELS_FP32", "ours")  # the fp32 Linear takes our kernel at every shape
    build.reset()
    if build.library() is None:
        pytest.skip("the kernels could not be built here (no C compiler?)")
    yield
    build.reset()


@pytest.fixture
def kernels_off(monkeypatch):
    monkeypatch.setenv("CS336_KERNELS", "0")
    build.reset()
    yield
    build.reset()


def fast_quantize(*args, **kwargs):
    """quantize_model with the fast path installed on the result (quantize_model makes readable layers)."""
    return install(quantize_model(*args, **kwargs))


def make_layer(name: str, d_out: int, d_in: int, group_size: int | None, bias: bool = True):
    """(forward, kernel, w64, b64): the layer's forward, its kernel called directly (None: declined),
    and the float64 weight and bias it must compute with."""
    g = torch.Generator().manual_seed(d_out * 1000 + d_in)
    w = torch.randn(d_out, d_in, generator=g)
    b = torch.randn(d_out, generator=g) if bias else None
    if name.startswith("fp32"):
        # the layer's own forward re-stores its weight in the layout measured fastest, so the two
        # layouts are checked on the kernel directly; the layer runs its decode path as it decides
        stored = w.t().contiguous().t() if name == "fp32_cols" else w.contiguous()
        layer = Linear(d_in, d_out, bias=bias).requires_grad_(False)
        with torch.no_grad():
            layer.weight.data = stored.clone()
            if bias:
                layer.bias.copy_(b)
        return (
            install(layer),
            lambda x: (kernels.linear_panels if name == "fp32_panels" else kernels.linear_fp32)(x, stored, b),
            w.double(),
            None if b is None else b.double(),
        )
    layer = install(QuantizedLinear.from_weight(w, name, group_size=group_size, bias=b))
    kernel = lambda x: kernels.quantized_linear(layer, x)  # noqa: E731
    return layer, kernel, layer.dequantize().double(), None if b is None else b.double()


def inputs(M: int, d_in: int, layout: str, seed: int = 0) -> torch.Tensor:
    """M rows of d_in numbers as a contiguous [1, M, I] tensor, or as a strided view of a bigger one."""
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return torch.randn(1, M, d_in, generator=g)
    if layout == "strided_rows":  # rows further apart than d_in (a slice of a wider tensor)
        return torch.randn(M, d_in + 5, generator=g)[:, 3 : 3 + d_in]
    return torch.randn(d_in, M, generator=g).t()  # transposed: no unit stride along I


def assert_close_to_reference(y, x, w64, b64, what, limit=1e-5):
    ref = F.linear(x.double(), w64, b64)
    bound = F.linear(x.double().abs(), w64.abs()) + (0 if b64 is None else b64.abs())
    err = (y.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst < limit, (
        f"{what}: error up to {worst:.3g} of sum |x||w|, over {limit:g} (float32 rounding is ~1e-7)"
    )


@pytest.mark.parametrize("mode", ["kernel", "fallback"])
@pytest.mark.parametrize(("name", "d_out", "d_in", "group_size"), CASES, ids=IDS)
def test_forward_equals_the_reference_for_1_to_32_rows(request, mode, name, d_out, d_in, group_size):
    request.getfixturevalue("kernels_on" if mode == "kernel" else "kernels_off")
    layer, kernel, w64, b64 = make_layer(name, d_out, d_in, group_size)
    with torch.inference_mode():
        for M in [*range(1, 18), 32]:  # 32 = kernels.MAX_ROWS
            for layout in ("contiguous", "strided_rows", "transposed"):
                x = inputs(M, d_in, layout, seed=M)
                what = f"{name} {mode}, M={M}, {layout} x"
                y = layer(x)
                assert y.shape == (*x.shape[:-1], d_out)
                assert_close_to_reference(y, x, w64, b64, what)
                direct = kernel(x)
                if mode == "fallback":
                    assert direct is None, f"{what}: a disabled kernel ran"
                    continue
                assert direct is not None, f"{what}: the kernel declined"
                assert_close_to_reference(direct, x, w64, b64, what + " (kernel)")
                if not name.startswith("fp32"):
                    assert torch.equal(direct, y), f"{what}: the layer did not use the kernel"


QUANTIZED_CASES = [case for case in CASES if not case[0].startswith("fp32")]


@pytest.mark.parametrize(
    ("name", "d_out", "d_in", "group_size"),
    QUANTIZED_CASES,
    ids=[IDS[CASES.index(c)] for c in QUANTIZED_CASES],
)
def test_a_short_quantized_prefill_runs_the_kernel_32_rows_at_a_time(
    kernels_on, name, d_out, d_in, group_size
):
    """More than MAX_ROWS rows (a prompt): quantized layers call the kernel on 32 rows at a time up to
    QUANTIZED_MAX_ROWS rows (each row as if alone), and decline beyond (the readable path runs)."""
    from cs336_inference.fast.cpu import ops

    layer, kernel, w64, b64 = make_layer(name, d_out, d_in, group_size)
    with torch.inference_mode():
        for M, layout in ((70, "contiguous"), (70, "strided_rows"), (33, "transposed")):
            x = inputs(M, d_in, layout, seed=M)
            what = f"{name}, M={M}, {layout} x"
            y = kernel(x)
            assert y is not None, f"{what}: the kernel declined"
            assert_close_to_reference(y, x, w64, b64, what)
            rows = x.reshape(-1, d_in)
            alone = torch.cat([kernel(rows[m : m + 1]) for m in (0, 31, 32, M - 1)])
            got = y.reshape(-1, d_out)[[0, 31, 32, M - 1]]
            assert torch.equal(got, alone), f"{what}: rows 0, 31, 32, {M - 1} differ from the rows run alone"
        too_many = inputs(ops.QUANTIZED_MAX_ROWS + 1, d_in, "contiguous")
        assert kernel(too_many) is None, (
            f"{name}: {ops.QUANTIZED_MAX_ROWS + 1} rows should take the readable path"
        )
        assert_close_to_reference(layer(too_many), too_many, w64, b64, f"{name}, readable path")


@pytest.fixture
def native_ops(kernels_on):
    """The C++ op bodies (fast/cpu/native.cpp) loaded next to the Python ones; skipped if they cannot
    be built here (no ninja or no torch headers: compiled steps then call the Python bodies)."""
    from cs336_inference.fast.cpu import ops

    if not ops.load_native():
        pytest.skip("fast/cpu/native.cpp could not be built here")
    return ops


@pytest.mark.parametrize(("name", "d_out", "d_in", "group_size"), CASES, ids=IDS)
def test_the_cpp_op_bodies_give_the_python_bodies_numbers_bit_for_bit(
    native_ops, name, d_out, d_in, group_size
):
    """cs336_native::* (what a compiled step calls) against cs336::* (the Python bodies over ctypes):
    the same C functions behind both, so the same bits, for every format and row layout."""
    layer, _, _, _ = make_layer(name, d_out, d_in, group_size)
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g)
    with torch.inference_mode():
        for M in (1, 2, 5, 17, 32):
            for layout in ("contiguous", "strided_rows", "transposed"):
                x = inputs(M, d_in, layout, seed=M)
                what = f"{name}, M={M}, {layout} x"
                if name.startswith("fp32"):
                    stored = w.contiguous() if name == "fp32_rows" else w.t().contiguous().t()
                    args = (x, stored, b)
                    ours, python = torch.ops.cs336_native.linear_f32(*args), torch.ops.cs336.linear_f32(*args)
                else:
                    code = native_ops.FORMAT_CODES[name]
                    scale, zero = getattr(layer, "scale", None), getattr(layer, "zero", None)
                    args = (x, layer.qweight, scale, zero, layer.bias, code, d_out)
                    ours, python = torch.ops.cs336_native.quantized(*args), torch.ops.cs336.quantized(*args)
                assert ours.shape == (*x.shape[:-1], d_out), f"{what}: shape {tuple(ours.shape)}"
                assert torch.equal(ours, python), f"{what}: differs by {(ours - python).abs().max():.3g}"


def test_the_cpp_op_bodies_refuse_what_the_kernels_do_not_take_in_one_line(native_ops):
    layer = QuantizedLinear.from_weight(torch.randn(8, 64), "int8")
    for x, expected in [
        (torch.randn(33, 64), "1..32 rows, got 33"),
        (torch.randn(2, 64).double(), "float32"),
    ]:
        with pytest.raises(RuntimeError, match=expected) as info:
            torch.ops.cs336_native.quantized(x, layer.qweight, layer.scale, None, None, 1, 8)
        assert len(str(info.value).strip().splitlines()) <= 3, str(
            info.value
        )  # torch adds a "raised from" line


def test_a_failed_cpp_build_is_one_line_and_compiled_steps_keep_the_python_bodies(
    kernels_on, monkeypatch, capfd
):
    from cs336_inference.fast.cpu import ops

    def fail():
        raise RuntimeError("Error building extension: no ninja")

    monkeypatch.setattr(ops, "_native", None)
    monkeypatch.setattr(build, "build_native", fail)
    capfd.readouterr()
    assert ops.load_native() is False and ops.load_native() is False
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "C++ op bodies not built" in err[0] and "no ninja" in err[0], err
    assert ops._compiled_ops() is torch.ops.cs336


def test_the_avx2_and_plain_c_builds_equal_the_reference(march):
    """The same source compiled for AVX2 and for plain x86-64: every format, 1, 3, 5 and 17 rows,
    bitwise row independence."""
    with torch.inference_mode():
        for name, d_out, d_in, group_size in CASES:
            _, kernel, w64, b64 = make_layer(name, d_out, d_in, group_size)
            x = inputs(17, d_in, "contiguous", seed=3)
            full = kernel(x)
            assert full is not None, f"{name} ({march}): the kernel declined"
            assert_close_to_reference(full, x, w64, b64, f"{name} ({march}), 17 rows")
            for M in (1, 3, 5):
                assert torch.equal(kernel(x[:, :M]), full[:, :M]), f"{name} ({march}): {M} rows differ"


def _check_vector_exp(label: str) -> None:
    """decode.c's cs336_exp (the native step's softmax) and cs336_silu_mul (its SwiGLU) against
    float64 e^x and torch's silu."""
    import numpy as np

    lib = build.library()
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-87.3, 88.3, 100_003), torch.randn(4099, generator=g) * 10])
    y = x.clone()
    lib.cs336_exp(y.data_ptr(), y.numel())
    exact = torch.exp(x.double())
    ulp = torch.from_numpy(np.spacing(exact.float().numpy()).astype(np.float64))
    err = ((y.double() - exact).abs() / ulp).max().item()
    assert err <= 2, f"{label}: e^x is {err:.2f} ulp off at worst, expected at most 2"
    # past the clamp: about 2^-126 below, finite above; NaN stays NaN; a short tail is left as is past n
    edge = torch.tensor([-1000.0, float("-inf"), 1000.0, float("inf"), float("nan"), 0.0, 1.0, 5.0])
    lib.cs336_exp(edge.data_ptr(), 7)
    assert 0 <= edge[0] < 1.3e-38 and 0 <= edge[1] < 1.3e-38, f"{label}: e^-1000 gave {edge[:2].tolist()}"
    assert 2e38 < edge[2] < float("inf") and 2e38 < edge[3] < float("inf"), f"{label}: {edge[2:4].tolist()}"
    assert edge[4].isnan() and edge[5] == 1.0 and abs(edge[6] - math.e) < 3e-7, f"{label}: {edge.tolist()}"
    assert edge[7] == 5.0, f"{label}: cs336_exp wrote past its n numbers"
    M, F = 3, 300  # F: a short last chunk of 256 and a tail past the last whole vector
    gu = torch.randn(M, 2 * F, generator=g) * 4
    a = torch.empty(M, F)
    lib.cs336_silu_mul(gu.data_ptr(), M, F, a.data_ptr(), 2)
    expected = torch.nn.functional.silu(gu[:, :F].double()) * gu[:, F:].double()
    torch.testing.assert_close(
        a.double(), expected, rtol=1e-6, atol=1e-7, msg=lambda m: f"{label}: silu: {m}"
    )


def test_the_vector_exp_and_silu_are_within_float_rounding(kernels_on):
    _check_vector_exp("this CPU's build")


def test_the_vector_exp_of_the_avx2_and_plain_c_builds(march):
    _check_vector_exp(march)


@pytest.mark.parametrize(("name", "d_out", "d_in", "group_size"), CASES, ids=IDS)
def test_a_rows_result_does_not_depend_on_the_other_rows(kernels_on, name, d_out, d_in, group_size):
    """Bitwise: row m alone, in the first M rows, with 1 or 2 threads: the same float32 numbers."""
    _, layer, _, _ = make_layer(name, d_out, d_in, group_size)
    x = inputs(16, d_in, "contiguous", seed=7)[0]
    with torch.inference_mode():
        full = layer(x)
        for M in range(1, 16):
            assert torch.equal(layer(x[:M]), full[:M]), (
                f"{name}: the first {M} rows differ from the 16-row call"
            )
        for m in (0, 5, 15):
            assert torch.equal(layer(x[m : m + 1]), full[m : m + 1]), f"{name}: row {m} alone differs"
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            assert torch.equal(layer(x), full), f"{name}: 2 threads give other numbers than 1"
        finally:
            torch.set_num_threads(threads)


# shapes the AMX kernels (fast/cpu/amx.c) cover: outputs a multiple of 32, inputs (int8) or groups (int4)
# a multiple of 64
AMX_CASES = [
    ("int4", 64, 128, 64),
    ("int4", 96, 576, 64),
    ("int4", 32, 1536, 128),
    ("int4", 32, 8192, 64),  # 128 groups a row
    ("int8", 64, 128, None),
    ("int8", 96, 576, None),
    ("int8", 32, 1536, None),
]
AMX_IDS = [f"{name}-{o}x{i}" + (f"-g{g}" if g else "") for name, o, i, g in AMX_CASES]


@pytest.fixture
def amx(kernels_on, monkeypatch):
    """The kernels with CS336_KERNELS_AMX=1 (int4 and int8 on AMX tiles), where this CPU and build have AMX."""
    monkeypatch.setenv("CS336_KERNELS_AMX", "1")
    build.reset()
    lib = build.library()
    if lib is None or not lib.cs336_amx_enable(1):
        pytest.skip("no AMX on this CPU or in this build")
    yield lib
    lib.cs336_amx_enable(0)  # the loaded library keeps its switch; the next load sets it from the environment
    build.reset()


@pytest.mark.parametrize(("name", "d_out", "d_in", "group_size"), AMX_CASES, ids=AMX_IDS)
def test_the_amx_int4_kernel_equals_the_reference_for_1_to_32_rows(amx, name, d_out, d_in, group_size):
    """bf16 tiles, fp32 numbers: x split into three bf16 parts, q (int8) or q - zero (int4) exact, the scales
    in fp32."""
    layer, kernel, w64, b64 = make_layer(name, d_out, d_in, group_size)
    with torch.inference_mode():
        for M in [*range(1, 18), 21, 22, 32]:  # 22 and 32: more rows than one AMX call takes (21)
            for layout in ("contiguous", "strided_rows", "transposed"):
                x = inputs(M, d_in, layout, seed=M)
                what = f"{name} {d_out}x{d_in} on AMX, M={M}, {layout} x"
                direct = kernel(x)
                assert direct is not None, f"{what}: the kernel declined"
                # 5e-7, not 1e-5: fp32's rounding gives ~8e-8 here, and x in two bf16 parts (16 bits) ~1.5e-6
                assert_close_to_reference(direct, x, w64, b64, what, limit=5e-7)
                assert torch.equal(layer(x), direct), f"{what}: the layer did not use the kernel"


@pytest.mark.parametrize(("name", "d_out", "d_in", "group_size"), AMX_CASES, ids=AMX_IDS)
def test_on_amx_a_rows_result_does_not_depend_on_the_other_rows(amx, name, d_out, d_in, group_size):
    """What speculative verification needs from AMX too: row m alone, among 17 or 32 rows, 1 or 2 threads."""
    _, layer, _, _ = make_layer(name, d_out, d_in, group_size)
    x = inputs(32, d_in, "contiguous", seed=11)[0]
    with torch.inference_mode():
        full = layer(x)
        for M in (1, 2, 5, 16, 17, 21, 22):
            assert torch.equal(layer(x[:M]), full[:M]), (
                f"{name} on AMX: the first {M} rows differ from 32 rows"
            )
        for m in (0, 7, 21, 31):
            assert torch.equal(layer(x[m : m + 1]), full[m : m + 1]), f"{name} on AMX: row {m} alone differs"
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(layer(x), full), f"{name} on AMX: 1 thread gives other numbers than {threads}"
        finally:
            torch.set_num_threads(threads)


def test_shapes_amx_does_not_cover_keep_the_avx_kernels_numbers(amx):
    """Groups of 10 or 32, 33 to 38 outputs, 70 inputs, and the formats AMX does not run: with AMX on,
    bit for bit the numbers of AMX off."""
    with torch.inference_mode():
        for name, d_out, d_in, group_size in [c for c in CASES if not c[0].startswith("fp32")]:
            _, kernel, _, _ = make_layer(name, d_out, d_in, group_size)
            x = inputs(5, d_in, "contiguous", seed=2)
            on = kernel(x)
            amx.cs336_amx_enable(0)
            off = kernel(x)
            amx.cs336_amx_enable(1)
            assert torch.equal(on, off), (
                f"{name} {d_out}x{d_in} g{group_size}: AMX on changed an uncovered shape"
            )


def test_amx_asked_for_without_amx_is_one_line_and_the_kernels_still_run(monkeypatch, capfd):
    """CS336_KERNELS_AMX=1 with a build that has no AMX (-march=haswell): one line, then AVX2's kernels."""
    monkeypatch.delenv("CS336_KERNELS", raising=False)
    monkeypatch.setenv("CS336_KERNELS_MARCH", "haswell")
    monkeypatch.setenv("CS336_KERNELS_AMX", "1")
    build.reset()
    try:
        if build.library() is None:
            pytest.skip("could not build for -march=haswell here")
        # a cold cache also prints the one-time compile notice: every other line is the AMX one
        lines = [line for line in capfd.readouterr().err.strip().splitlines() if ": compiling " not in line]
        assert len(lines) == 1 and "CS336_KERNELS_AMX=1 but no AMX here" in lines[0], lines
        name, d_out, d_in, group_size = AMX_CASES[1]
        _, kernel, w64, b64 = make_layer(name, d_out, d_in, group_size)
        x = inputs(5, d_in, "contiguous")
        with torch.inference_mode():
            assert_close_to_reference(kernel(x), x, w64, b64, "int4 on the AVX2 build with AMX asked for")
    finally:
        build.reset()


def test_the_fp32_planner_keeps_our_kernel_unless_torch_is_clearly_faster(monkeypatch):
    """layout.measure: four candidates timed over a ring of copies; ours unless torch is > 10% faster."""
    from cs336_inference.fast import autotune as layout

    monkeypatch.delenv("CS336_KERNELS", raising=False)
    build.reset()
    if build.library() is None:
        pytest.skip("the kernels could not be built here (no C compiler?)")
    monkeypatch.setattr(layout, "RING_BYTES", 4 * 2**20)  # 4 MB of copies: quick, still a ring
    calls = []
    real = layout._median_time
    monkeypatch.setattr(layout, "_median_time", lambda fn, repeats=7: calls.append(fn) or real(fn, repeats))
    p = layout.measure(96, 64)
    assert set(p.seconds) == {"torch/cols", "torch/rows", "ours/cols", "ours/rows"}, p.seconds
    assert len(calls) == 8, f"expected 4 candidates x 2 row counts timed, got {len(calls)}"
    best = min(p.seconds.values())
    ours = min(v for k, v in p.seconds.items() if k.startswith("ours"))
    chosen = p.seconds[f"{p.product}/{p.layout}"]
    if p.product == "torch":
        assert ours > (1 + layout.OURS_MARGIN) * best, f"torch chosen though ours is within 10%: {p.seconds}"
        assert chosen == best, f"torch chosen but not the fastest: {p.seconds}"
    else:
        assert chosen == ours <= (1 + layout.OURS_MARGIN) * best, f"ours chosen wrongly: {p}"
    # the rule itself, on made-up timings (ours 5% slower: kept; 20% slower: torch)
    for slower, expect in ((1.05, "ours"), (1.20, "torch")):
        times = iter(
            [1.0, 1.0, slower, slower, 1.0, 1.0, slower, slower]
        )  # cols: torch, ours; rows: torch, ours
        monkeypatch.setattr(layout, "_median_time", lambda fn, repeats=7, t=times: next(t))
        assert layout.measure(96, 64).product == expect, f"ours {slower}x torch's time: expected {expect}"
    build.reset()


def llm_int8_layer(d_out: int, d_in: int, threshold: float, bias: bool = True):
    from cs336_inference.quantization.llm_int8 import LLMInt8Linear

    g = torch.Generator().manual_seed(d_out * 1000 + d_in)
    w, b = torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g) if bias else None
    q = QuantizedLinear.from_weight(w, "int8", bias=b)
    return LLMInt8Linear("int8", d_in, d_out, q.stored(), None, q.bias, threshold=threshold)


def llm_int8_reference(layer, x):
    """What LLMInt8Linear.forward computes without the kernel: the graded llm_int8_matmul, + bias."""
    from cs336_inference.quantization.llm_int8 import llm_int8_matmul

    y = llm_int8_matmul(x, layer.qweight, layer.scale, layer.threshold)
    return y if layer.bias is None else y + layer.bias


@pytest.mark.parametrize("threshold", [float("inf"), 6.0], ids=["w8a8", "llm_int8"])
@pytest.mark.parametrize(("d_out", "d_in"), [(37, 70), (33, 64), (9, 200), (5, 1)])
def test_the_int8_activation_kernel_gives_llm_int8s_numbers_bit_for_bit(kernels_on, threshold, d_out, d_in):
    """cs336_w8a8 (activations quantized per row, an exact int32 product, the same rescaling) equals
    llm_int8_matmul exactly: 1..17 and 32 rows, widths that are not whole 64-byte vectors, strided and
    transposed x, rows of zeros, and (threshold 6) outlier features planted in some calls."""
    for bias in (True, False):
        layer = llm_int8_layer(d_out, d_in, threshold, bias)
        with torch.inference_mode():
            for M in [*range(1, 18), 32]:
                for layout in ("contiguous", "strided_rows", "transposed"):
                    x = inputs(M, d_in, layout, seed=M) * 2
                    if M % 3 == 0:
                        x[..., 0, :] = 0  # a row of zeros: scale 0, output = bias
                    if M % 2 and d_in > 3:
                        x[..., 3] = 9.0  # an outlier feature (threshold 6)
                    what = f"{d_out}x{d_in} threshold={threshold} bias={bias} M={M} {layout} x"
                    direct = kernels.llm_int8_linear(layer, x)
                    assert direct is not None, f"{what}: the kernel declined"
                    expected = llm_int8_reference(layer, x)
                    assert torch.equal(direct, expected), (
                        f"{what}: differs from llm_int8_matmul by up to {(direct - expected).abs().max():.3g}"
                    )
                    assert torch.equal(layer(x), direct), f"{what}: the layer did not use the kernel"
            assert kernels.llm_int8_linear(layer, torch.randn(kernels.MAX_ROWS + 1, d_in)) is None


def test_the_int8_activation_kernel_without_vnni_gives_the_same_bits(march):
    """The plain C int32 loop (CPUs without AVX512-VNNI) equals llm_int8_matmul exactly too."""
    layer = llm_int8_layer(37, 70, float("inf"))
    with torch.inference_mode():
        for M in (1, 5, 17):
            x = inputs(M, 70, "contiguous", seed=M)
            assert torch.equal(kernels.llm_int8_linear(layer, x), llm_int8_reference(layer, x)), (
                f"-march={march}, M={M}"
            )


def test_prefill_and_autograd_stay_on_the_pytorch_path(kernels_on):
    layer, _, _, _ = make_layer("int8", 37, 70, None)
    x = torch.randn(kernels.QUANTIZED_MAX_ROWS + 1, 70)
    assert kernels.quantized_linear(layer, x) is None, f"{len(x)} rows: a long prefill stays on BLAS"
    fp32 = torch.randn(37, 70)
    x = torch.randn(kernels.MAX_ROWS + 1, 70)
    assert kernels.linear_fp32(x, fp32) is None, f"{len(x)} rows: an fp32 prefill stays on BLAS"
    lin = Linear(70, 37)  # requires_grad weights, grad mode on: the kernel must not cut the graph
    y = lin(torch.randn(2, 70))
    assert y.requires_grad and y.grad_fn is not None
    assert kernels.quantized_linear(layer, torch.randn(2, 70, dtype=torch.float64)) is None


def test_kernels_disabled_by_the_environment(kernels_off):
    assert build.library() is None
    layer, _, _, _ = make_layer("q4_0", 37, 96, None)
    assert kernels.quantized_linear(layer, torch.randn(2, 96)) is None


def tiny_model(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=97,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=96,
        max_seq_len=64,
        tie_embeddings=True,
    )
    return install(TransformerLM(cfg).eval())  # the kernels' path: what these tests check


def test_a_failed_build_is_one_line_on_stderr_and_the_model_still_runs(monkeypatch, tmp_path, capfd):
    model = tiny_model()
    prompt = torch.tensor([5, 7, 11, 13])
    monkeypatch.setenv("CS336_KERNELS", "0")
    build.reset()
    expected = generate(model, prompt, 8, stop_token_ids=[])
    capfd.readouterr()
    monkeypatch.delenv("CS336_KERNELS")
    monkeypatch.setenv("CS336_KERNELS_CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv("CS336_KERNELS_CACHE", str(tmp_path))  # nothing built before
    monkeypatch.setenv("CS336_KERNELS_FP32", "ours")
    build.reset()
    try:
        qmodel = fast_quantize(model, "q8_0")
        tokens = generate(model, prompt, 8, stop_token_ids=[])
        qmodel(prompt[None])
        generate(qmodel, prompt, 4, stop_token_ids=[])
        err = capfd.readouterr().err
        lines = [line for line in err.splitlines() if "not built" in line]
        assert len(lines) == 1, f"expected one line about the failed build, got {err!r}"
        assert all(line.startswith("cs336_inference.fast: ") for line in err.splitlines()), err
        assert torch.equal(tokens, expected)
    finally:
        build.reset()


def test_greedy_tokens_of_a_tiny_model_with_and_without_kernels(monkeypatch):
    prompt = torch.tensor([5, 7, 11, 13, 2])
    for method in (None, "int8", "int4", "q4_1", "llm_int8", "w8a8"):
        model = tiny_model(1)
        model = (
            model
            if method is None
            else fast_quantize(model, method, group_size=32 if method == "int4" else None)
        )
        monkeypatch.setenv("CS336_KERNELS", "0")
        build.reset()
        off = generate(model, prompt, 24, stop_token_ids=[])
        monkeypatch.setenv("CS336_KERNELS", "1")
        monkeypatch.setenv("CS336_KERNELS_FP32", "ours")
        build.reset()
        if build.library() is None:
            pytest.skip("the kernels could not be built here")
        on = generate(model, prompt, 24, stop_token_ids=[])
        assert torch.equal(on, off), f"{method or 'fp32'}: {on.tolist()} != {off.tolist()}"
    build.reset()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp32", "int8", "int4"])
def test_smollm2_greedy_tokens_with_and_without_kernels(monkeypatch, method):
    """64 greedy tokens of SmolLM2: with the kernels == without (the reference path), exactly.

    For fp32 the kernel is forced at every shape (CS336_KERNELS_FP32=ours). For int8 / int4 the
    reference is the same quantized model through dequantize-then-F.linear; both round differently
    from each other only in float32 summation order, far below the gaps between greedy logits here.
    """
    from cs336_inference.io.checkpoint import default_model_path, load_pretrained

    path = default_model_path()
    if not path.exists():
        pytest.skip(f"no SmolLM2 checkpoint at {path}")
    model = load_pretrained(path, dtype=torch.float32)
    if method != "fp32":
        model = fast_quantize(model, method)
    prompt = torch.tensor([504, 3458, 282, 4967, 314, 253, 1345, 28, 216, 1032, 314])
    monkeypatch.setenv("CS336_KERNELS", "0")
    build.reset()
    off = generate(model, prompt, 64, stop_token_ids=[])
    monkeypatch.setenv("CS336_KERNELS", "1")
    monkeypatch.setenv("CS336_KERNELS_FP32", "ours")
    build.reset()
    if build.library() is None:
        pytest.skip("the kernels could not be built here")
    on = generate(model, prompt, 64, stop_token_ids=[])
    build.reset()
    first = next((i for i, (a, b) in enumerate(zip(on.tolist(), off.tolist(), strict=True)) if a != b), None)
    assert first is None, (
        f"{method}: tokens differ from step {first}: {on[first:].tolist()} vs {off[first:].tolist()}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fp32", "int8", "int4", "q4_0", "int8-amx", "int4-amx"])
def test_smollm2_native_step_gives_generates_greedy_tokens(method):
    """64 greedy tokens of SmolLM2 through the native step (every layer in one C call, fast/cpu/step.c)
    equal `generate`'s (the model's own forward), and so do 5-token verify passes of speculative
    decoding with prompt lookup on a prompt that repeats itself (-amx: every product on AMX tiles)."""
    if method.endswith("-amx"):
        lib = build.library()
        if lib is None or not lib.cs336_amx_enable(1):
            pytest.skip("no AMX on this CPU or in this build")
        try:
            _smollm2_native_greedy(method.removesuffix("-amx"))
        finally:
            lib.cs336_amx_enable(0)
    else:
        _smollm2_native_greedy(method)


def _smollm2_native_greedy(method: str) -> None:
    from cs336_inference.fast.step.fixed import FixedSteps, graph_generate
    from cs336_inference.io.checkpoint import default_model_path, load_pretrained
    from cs336_inference.speculative import speculative_generate

    path = default_model_path()
    if not path.exists():
        pytest.skip(f"no SmolLM2 checkpoint at {path}")
    if build.library() is None:
        pytest.skip("the kernels could not be built here")
    model = load_pretrained(path, dtype=torch.float32)
    if method != "fp32":
        model = fast_quantize(model, method, quantize_head=True)
    prompt = torch.tensor([504, 3458, 282, 4967, 314, 253, 1345, 28, 216, 1032, 314] * 2)
    expected = generate(model, prompt, 64, stop_token_ids=[]).tolist()
    for name, got in (
        ("graph_generate", graph_generate(model, prompt, 64, mode="native")),
        ("speculative k=4", speculative_generate(model, "ngram", prompt, 64, k=4, stop_token_ids=[], steps=FixedSteps("native"))),
    ):  # fmt: skip
        got = got.tolist()
        first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
        assert first is None, (
            f"{method} {name}: tokens differ from step {first}: {got[first:]} vs {expected[first:]}"
        )


def _cuda_eager_ms(fn, repeats: int = 50) -> float:
    """Milliseconds per call, launched from Python as eager code runs (CUDA events)."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def _cuda_ms(fn, repeats: int = 50) -> float:
    """Milliseconds per call of fn on the GPU as a decode step runs it: recorded in a CUDA graph
    (repeats calls) and replayed, so the CPU's cost of launching (large for Triton's Python
    launcher) is not counted; median of 5 replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    return sorted(times)[2]


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("M", [1, 2, 5, 16])
def test_cuda_weight_only_products_equal_the_reference(fmt, M):
    """The GPU paths (fast/gpu/products.py) against the readable reference: dequantize, then F.linear in
    float32. Widths that are not multiples of 128 (576: SmolLM2's) and a bias."""
    from cs336_inference.fast.gpu.products import quantized_cuda

    torch.manual_seed(0)
    for d_out, d_in in [(1536, 576), (576, 1536), (256, 4096)]:
        w, b = torch.randn(d_out, d_in), torch.randn(d_out)
        layer = QuantizedLinear.from_weight(w, fmt, bias=b).cuda()
        x = torch.randn(M, d_in, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            y = quantized_cuda(layer, x)
            assert y is not None, f"{fmt} [{d_out}, {d_in}] M={M}: the GPU path declined"
            expected = F.linear(x.float(), layer.dequantize(), layer.bias)
        scale = expected.abs().max().item()
        err = (y.float() - expected).abs().max().item()
        assert err < 2e-2 * scale, (
            f"{fmt} [{d_out}, {d_in}] M={M}: max error {err:.4g} vs max |y| {scale:.4g}"
        )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_triton_int8_kernel_equals_the_reference_for_1_to_32_rows(dtype):
    """Widths that are not multiples of its blocks (N = 100, K = 300), rows with a stride, every M."""
    pytest.importorskip("triton")
    from cs336_inference.fast.gpu.triton_int8 import int8_linear

    torch.manual_seed(0)
    for d_out, d_in in [(100, 300), (576, 1536)]:
        layer = QuantizedLinear.from_weight(torch.randn(d_out, d_in), "int8").cuda()
        for M in [*range(1, 18), 31, 32]:
            x = torch.randn(M, d_in + 8, device="cuda", dtype=dtype)[:, :d_in]  # row stride != d_in
            y = int8_linear(x, layer.qweight, layer.scale.to(dtype))
            assert y is not None, f"[{d_out}, {d_in}] M={M}: declined"
            expected = F.linear(x.float(), layer.dequantize())
            err, scale = (y.float() - expected).abs().max().item(), expected.abs().max().item()
            assert err < 1e-2 * scale, f"[{d_out}, {d_in}] M={M} {dtype}: max error {err:.4g} vs {scale:.4g}"


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_cuda_weight_only_decode_beats_bf16_on_a_bandwidth_bound_layer(fmt):
    """int8 reads half the bytes of bf16, int4 a quarter: at M = 1 on an 8192 x 8192 layer (128 MB
    in bf16) each must be faster than the bf16 product. The fast layer (fast.install) takes the GPU
    path; the readable QuantizedLinear dequantizes, as the lecture's reference does."""
    torch.manual_seed(0)
    w = torch.randn(8192, 8192, device="cuda")
    layer = install(QuantizedLinear.from_weight(w, fmt)).cuda()
    w16, x = w.bfloat16(), torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        y, expected = layer(x).float(), F.linear(x.float(), layer.dequantize())
        err, scale = (y - expected).abs().max().item(), expected.abs().max().item()
        assert err < 2e-2 * scale, f"{fmt}: max error {err:.4g} vs max |y| {scale:.4g}"
        t_q, t_bf16 = _cuda_ms(lambda: layer(x)), _cuda_ms(lambda: F.linear(x, w16))
    assert t_q < t_bf16, f"{fmt} {t_q:.3f} ms vs bf16 {t_bf16:.3f} ms"


@pytest.mark.cuda
def test_cuda_five_token_verify_costs_under_1_5x_a_one_token_step():
    cfg = ModelConfig(
        vocab_size=32000, d_model=2048, n_layers=8, n_heads=16, n_kv_heads=4, d_ff=5632, max_seq_len=512
    )
    model = TransformerLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 64), device="cuda")
    with torch.inference_mode():
        cache = model.new_cache(1, 128)
        model(ids, cache=cache)

        def step(T):
            model(ids[:, :T], cache=cache)
            cache.truncate(64)

        t1, t5 = _cuda_eager_ms(lambda: step(1), 20), _cuda_eager_ms(lambda: step(5), 20)
    assert t5 < 1.5 * t1, f"5-token forward {t5:.2f} ms vs 1-token {t1:.2f} ms"


# ------------------------------------------------------------------ sibling projections (fast/step/fuse.py)
def decode_logits(model, prompt: torch.Tensor, T_values=(1, 3)) -> list[torch.Tensor]:
    """The prefill's logits, then those of decode calls of T tokens each (the kernels' path)."""
    with torch.inference_mode():
        cache = model.new_cache(1, 32)
        out = [model(prompt[None, :-3], cache=cache)]
        for T in T_values:
            out.append(model(prompt[None, -T:], cache=cache))
    return out


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4", "q8_0", "q4_0", "q4_1"])
def test_sibling_projections_run_as_one_product_with_the_separate_numbers(kernels_on, monkeypatch, fmt):
    """fuse_siblings: q/k/v and gate/up become one kernel call each (counted), their weights views of
    the stacked one; the quantized outputs are bit for bit those of separate calls, fp32 to rounding
    (the stacked shape may be stored in the other layout)."""
    from cs336_inference.fast.step import fuse

    model = tiny_model(3)
    if fmt != "fp32":
        model = fast_quantize(model, fmt, group_size=32 if fmt == "int4" else None)
    prompt = torch.tensor([5, 7, 11, 13, 2, 8, 9, 4])
    before = decode_logits(model, prompt)
    n_layers = model.config.n_layers
    assert fuse.fuse_siblings(model) == 2 * n_layers, "expected a q/k/v and a gate/up group per layer"
    assert fuse.fuse_siblings(model) == 0, "a second call must not group grouped layers again"
    attn = model.layers[0].attn
    name = "weight" if fmt == "fp32" else attn.q_proj.stored_names[0]
    stacked = getattr(attn.q_proj.siblings.stacked, name)
    for layer in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert getattr(layer, name).untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr(), (
            f"{fmt}: a member's {name} must be a view of the stacked tensor (no second copy)"
        )
    calls = []
    product = "decode_linear" if fmt == "fp32" else "quantized_linear"
    real = getattr(fuse, product)
    monkeypatch.setattr(fuse, product, lambda layer, x: calls.append(layer) or real(layer, x))
    decode_logits(model, prompt, T_values=(1,))  # two forwards: a 5-token prefill, a step
    assert len(calls) == 4 * n_layers, (
        f"{fmt}: {len(calls)} stacked products in two forwards, expected {4 * n_layers}"
    )
    after = decode_logits(model, prompt)
    # members called on their own, on different inputs, in any order: each gets its own product
    g = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(1, 2, model.config.d_model, generator=g) for _ in range(2))
    with torch.inference_mode():
        fused = [attn.q_proj(x1), attn.k_proj(x2), attn.v_proj(x2), attn.k_proj(x1)]
        separate = [F.linear(x, layer.weight, layer.bias) for x, layer in
                    ((x1, attn.q_proj), (x2, attn.k_proj), (x2, attn.v_proj), (x1, attn.k_proj))]  # fmt: skip
    for i, (a, b) in enumerate(zip(fused, separate, strict=True)):
        torch.testing.assert_close(
            a, b, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"{fmt}, direct call {i}: {m}"
        )
    for what, a, b in zip(("prefill", "1-token step", "3-token step"), before, after, strict=True):
        if fmt == "fp32":
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m, w=what: f"fp32 {w}: {m}")
        else:
            assert torch.equal(a, b), f"{fmt} {what}: fused logits differ by up to {(a - b).abs().max():.3g}"


def test_sibling_projections_follow_new_weights(kernels_on):
    """Loading weights in place reaches the stacked tensor (views); a member given a new tensor is
    stacked again on the next call: either way the output is a fresh model's with those weights."""
    from cs336_inference.fast.step.fuse import fuse_siblings

    prompt = torch.tensor([5, 7, 11, 13, 2, 8, 9, 4])
    model, other = tiny_model(3), tiny_model(4)
    fuse_siblings(model)
    model.load_state_dict(other.state_dict())
    fresh = decode_logits(tiny_model(4), prompt)
    for a, b in zip(decode_logits(model, prompt), fresh, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"after load_state_dict: {m}")
    with torch.no_grad():
        model.layers[0].attn.k_proj.weight.data = torch.zeros_like(model.layers[0].attn.k_proj.weight)
        reference = tiny_model(4)
        reference.layers[0].attn.k_proj.weight.zero_()
    for a, b in zip(decode_logits(model, prompt), decode_logits(reference, prompt), strict=True):
        torch.testing.assert_close(
            a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"after a new k_proj weight: {m}"
        )


def test_fusing_is_off_with_the_environment_switch(kernels_on, monkeypatch):
    from cs336_inference.fast.step.fuse import fuse_siblings

    monkeypatch.setenv("CS336_KERNELS_FUSE", "0")
    model = tiny_model(3)
    assert fuse_siblings(model) == 0
    assert not hasattr(model.layers[0].attn.q_proj, "siblings")


@pytest.mark.parametrize("product", ["ours", "torch"])
@pytest.mark.parametrize("layout_name", ["rows", "cols"])
def test_a_model_made_under_inference_mode_can_take_another_layout(
    kernels_on, monkeypatch, layout_name, product
):
    """A model loaded under torch.inference_mode holds inference tensors; re-storing a weight in the
    planned layout (or stacking siblings) must keep them inference tensors, or every later op on the
    Parameter raised "Inference tensors do not track version counter"."""
    from cs336_inference.fast import autotune as layout
    from cs336_inference.fast.step.fuse import fuse_siblings

    monkeypatch.setattr(layout, "_plans", {})
    monkeypatch.setattr(layout, "measure", lambda o, i, force="auto": layout.Plan(layout_name, product, {}))
    prompt = torch.tensor([5, 7, 11, 13, 2, 8, 9, 4])
    expected = decode_logits(tiny_model(3), prompt)
    for fuse in (False, True):
        with torch.inference_mode():
            model = tiny_model(3)
            if fuse:
                fuse_siblings(model)
        got = decode_logits(model, prompt)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(
                a, b, rtol=1e-5, atol=1e-5, msg=lambda m, fuse=fuse: f"fuse={fuse}: {m}"
            )


def test_install_swaps_in_the_fast_layers_and_uninstall_restores_the_readable_ones(kernels_on):
    """fast.install: every Linear / QuantizedLinear / LLMInt8Linear becomes its fast subclass (same
    parameters and state dict, same numbers); uninstall gives the readable classes back."""
    from cs336_inference import fast
    from cs336_inference.layers import Linear
    from cs336_inference.quantization import LLMInt8Linear, QuantizedLinear

    prompt = torch.tensor([5, 7, 11, 13, 2, 8])
    for method in (None, "q4_0", "llm_int8"):
        model = fast.uninstall(tiny_model(2))  # tiny_model installs; start from the readable model
        model = model if method is None else quantize_model(model, method)
        readable = {name: type(m) for name, m in model.named_modules()}
        state = {k: v.clone() for k, v in model.state_dict().items()}
        expected = decode_logits(model, prompt)
        assert not fast.installed(model)
        assert fast.install(model) is model and fast.installed(model)
        for name, m in model.named_modules():
            if readable[name] in (Linear, QuantizedLinear, LLMInt8Linear):
                assert type(m) is fast.FAST[readable[name]], f"{method}: {name} is {type(m).__name__}"
                assert fast.readable_type(m) is readable[name]
        assert state.keys() == model.state_dict().keys()
        for a, b in zip(decode_logits(model, prompt), expected, strict=True):
            torch.testing.assert_close(
                a, b, rtol=1e-4, atol=1e-4, msg=lambda m, method=method: f"{method}: {m}"
            )
        fast.uninstall(model)
        assert {name: type(m) for name, m in model.named_modules()} == readable


def test_the_readable_layers_never_call_the_kernels(kernels_on, monkeypatch):
    """Without install the model runs plain PyTorch: a kernel that would answer 7 everywhere is never
    called; installed, it is."""
    from cs336_inference import fast
    from cs336_inference.fast import layers as fast_layers

    model = quantize_model(
        fast.uninstall(tiny_model(4)), "q8_0", quantize_head=False
    )  # fp32 head, q8_0 layers
    monkeypatch.setattr(
        fast_layers, "quantized_linear", lambda layer, x: torch.full((*x.shape[:-1], layer.d_out), 7.0)
    )
    monkeypatch.setattr(fast_layers, "decode_linear", lambda layer, x: None)
    ids = torch.tensor([[5, 7, 11]])
    plain = model(ids)
    assert not any(isinstance(m, fast.FastQuantizedLinear) for m in model.modules())
    fast.install(model)
    assert not torch.equal(model(ids), plain), "installed: the (planted) kernel answers"
    fast.uninstall(model)
    assert torch.equal(model(ids), plain)


def test_plans_are_kept_in_a_file_between_processes(monkeypatch, tmp_path):
    """autotune.plan: measured once per machine (CPU, torch, threads, shape), read back after."""
    from cs336_inference.fast import autotune

    calls = []

    def measure(d_out, d_in, force="auto"):
        calls.append((d_out, d_in))
        return autotune.Plan("rows", "torch", {"torch/rows": 1e-6})

    path = tmp_path / "plans.json"
    monkeypatch.setenv("CS336_AUTOTUNE_CACHE", str(path))
    monkeypatch.setattr(autotune, "measure", measure)
    monkeypatch.setattr(autotune, "_plans", {})
    first = autotune.product_plan(40, 24)
    assert calls == [(40, 24)] and path.exists()
    monkeypatch.setattr(autotune, "_plans", {})  # a new process
    assert autotune.product_plan(40, 24) == first and calls == [(40, 24)], (
        "read from the file, not measured again"
    )
    monkeypatch.setenv("CS336_AUTOTUNE_CACHE", "0")
    monkeypatch.setattr(autotune, "_plans", {})
    autotune.product_plan(40, 24)
    assert calls == [(40, 24), (40, 24)], "CS336_AUTOTUNE_CACHE=0: measured every process"


def _fma32(a: float, b: float, c: float) -> float:
    """fma in float32, exactly: a * b + c in rationals, rounded once to the nearest float32 (ties to even)."""
    from fractions import Fraction

    import numpy as np

    exact = Fraction(a) * Fraction(b) + Fraction(c)
    guess = np.float32(float(exact))
    near = [guess, np.nextafter(guess, np.float32("inf")), np.nextafter(guess, np.float32("-inf"))]
    best = min(abs(Fraction(float(v)) - exact) for v in near)
    ties = [v for v in near if abs(Fraction(float(v)) - exact) == best]
    return float(min(ties, key=lambda v: int(v.view(np.int32)) & 1))  # even mantissa on a tie


def _panel_products_of_every_build(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, monkeypatch) -> dict:
    """linear_panels(x, w, b) on this CPU's build, the AVX2 one and the plain x86-64 one."""
    out = {}
    for march in ("", "haswell", "x86-64"):
        monkeypatch.setenv("CS336_KERNELS_MARCH", march)
        build.reset()
        if build.library() is not None:
            out[march or "this CPU"] = kernels.linear_panels(x, w, b)
    build.reset()
    return out


def test_panel_products_are_one_fma_chain_per_output_on_every_build(kernels_on, monkeypatch):
    """decode.c's panels: y[m, o] = fma(W[o, I-1], x[m, I-1], ... fma(W[o, 0], x[m, 0], 0)) + b[o],
    checked against that chain computed in exact rationals, for the builds with 16, 8 and 4 lanes
    (so their bits agree with one another), with 1 to 40 rows: each tile shape (AVX-512: 4 x 1 .. 4 x 6,
    3 x 8, 2 x 9 .. 2 x 16, two groups of 2 x 9 and 8, 3 x 8 groups past 24 rows) gives each row the
    same bits, as speculative verification needs."""
    g = torch.Generator().manual_seed(5)
    d_out, d_in = 21, 9
    w, b = torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g)
    x = torch.randn(40, d_in, generator=g)
    expected = torch.empty(40, d_out)
    for m in range(40):
        for o in range(d_out):
            acc = 0.0
            for i in range(d_in):
                acc = _fma32(w[o, i].item(), x[m, i].item(), acc)
            expected[m, o] = float(torch.tensor(acc) + b[o])  # float32 add, as the kernel's bias
    for M in (1, 5, 8, 9, 16, 17, 24, 25, 40):
        got = _panel_products_of_every_build(x[:M], w, b, monkeypatch)
        assert len(got) >= 2, f"only {list(got)} could be built here"
        for build_name, y in got.items():
            assert y is not None, f"{build_name}: linear_panels declined {M} rows"
            bad = (y != expected[:M]).nonzero()
            assert len(bad) == 0, (
                f"{build_name}, {M} rows: {len(bad)} of {y.numel()} outputs differ from the fma chain, first at"
                f" (m, o) = {tuple(bad[0].tolist())}: {y[tuple(bad[0])].item()!r} instead of"
                f" {expected[tuple(bad[0])].item()!r}"
            )
