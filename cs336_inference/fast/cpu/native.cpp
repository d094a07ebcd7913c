// The ops of fast/cpu/ops.py with C++ bodies, for the compiled decode step (fast/step/fixed.py).
//
// A compiled step calls its products through the dispatcher. With a Python body, each call pays
// for boxing its arguments into Python objects, the Python checks and the ctypes call: 23.5 us for a
// 64 x 576 int8 product that the bare ctypes call does in 8.7 us and these bodies in 11.9 us (AMD
// EPYC), 211 times per SmolLM2 step. These bodies do the same work in C++
// and call decode.c's entry points, whose addresses Python hands over once (`set_kernels`), so
// decode.c is built once, by build.py, for both paths. Same checks, same arguments, same numbers as
// ops.py's Python bodies (tests/test_kernels.py compares them bit for bit).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

using i64 = int64_t;
using F32 = void (*)(const float *, i64, i64, i64, const float *, i64, const float *, float *, int);
using Int8 = void (*)(const float *, i64, i64, i64, const int8_t *, const float *, i64, const float *, float *, int);
using Int4 = void (*)(const float *, i64, i64, i64, const uint8_t *, const uint16_t *, const uint8_t *, i64, i64,
                      const float *, float *, int);
using Ggml = void (*)(int, const float *, i64, i64, i64, const uint8_t *, i64, const float *, float *, int);

struct Kernels {
    F32 f32_rows = nullptr, f32_cols = nullptr;
    Int8 int8 = nullptr;
    Int4 int4 = nullptr;
    Ggml ggml = nullptr;
} K;

constexpr i64 MAX_ROWS = 32;  // ops.MAX_ROWS

// Raise a RuntimeError with a message built here, handed to TORCH_CHECK as one C string. On torch
// 2.11.0+cu130 with gcc 13.3 (an H200 machine, 2026-11-26) a TORCH_CHECK whose message mixes text and
// numbers (built by c10::str inside this library) crashed the process with a segfault when it fired;
// one ready string raised as it should.
void fail(const std::string &message) { TORCH_CHECK(false, message.c_str()); }

void set_kernels(std::vector<i64> addresses) {
    TORCH_CHECK(addresses.size() == 5, "set_kernels: expected 5 addresses");
    K.f32_rows = reinterpret_cast<F32>(addresses[0]);
    K.f32_cols = reinterpret_cast<F32>(addresses[1]);
    K.int8 = reinterpret_cast<Int8>(addresses[2]);
    K.int4 = reinterpret_cast<Int4>(addresses[3]);
    K.ggml = reinterpret_cast<Ggml>(addresses[4]);
}

// x as M rows of d_in floats with row stride ldx (ops._rows): a view where possible
at::Tensor rows(const at::Tensor &x, i64 d_in) {
    if (x.scalar_type() != at::kFloat || !x.device().is_cpu() || x.size(-1) != d_in)
        fail("cs336 kernels: x must be float32 on the CPU with " + std::to_string(d_in) + " features");
    at::Tensor x2 = x.reshape({-1, d_in});
    if (x2.stride(1) != 1) x2 = x2.contiguous();
    if (x2.size(0) < 1 || x2.size(0) > MAX_ROWS)
        fail("cs336 kernels: 1.." + std::to_string(MAX_ROWS) + " rows, got " + std::to_string(x2.size(0)));
    return x2;
}

std::vector<i64> out_shape(const at::Tensor &x, i64 d_out) {
    std::vector<i64> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = d_out;
    return shape;
}

const float *bias_ptr(const c10::optional<at::Tensor> &bias) {
    return bias.has_value() ? bias->data_ptr<float>() : nullptr;
}

at::Tensor linear_f32(const at::Tensor &x, const at::Tensor &weight, const c10::optional<at::Tensor> &bias) {
    i64 d_out = weight.size(0), d_in = weight.size(1);
    F32 fn = weight.is_contiguous() ? K.f32_rows
             : (weight.stride(0) == 1 && weight.stride(1) == d_out) ? K.f32_cols
                                                                     : nullptr;
    if (fn == nullptr || x.size(-1) != d_in) return at::linear(x, weight, bias);
    at::Tensor x2 = rows(x, d_in);
    at::Tensor y = at::empty(out_shape(x, d_out), x.options());
    fn(x2.data_ptr<float>(), x2.size(0), d_in, x2.stride(0), weight.data_ptr<float>(), d_out, bias_ptr(bias),
       y.data_ptr<float>(), at::get_num_threads());
    return y;
}

// fmt: ops.FORMAT_CODES (1 int8, 2 int4, 3 q8_0, 4 q4_0, 5 q4_1)
at::Tensor quantized(const at::Tensor &x, const at::Tensor &q, const c10::optional<at::Tensor> &scale,
                     const c10::optional<at::Tensor> &zero, const c10::optional<at::Tensor> &bias, i64 fmt,
                     i64 d_out) {
    i64 d_in = x.size(-1);
    at::Tensor x2 = rows(x, d_in);
    at::Tensor y = at::empty(out_shape(x, d_out), x.options());
    const float *xp = x2.data_ptr<float>();
    i64 M = x2.size(0), ldx = x2.stride(0);
    int threads = at::get_num_threads();
    if (fmt == 1) {
        TORCH_CHECK(scale.has_value(), "cs336::quantized int8 needs a scale");
        K.int8(xp, M, d_in, ldx, q.data_ptr<int8_t>(), scale->data_ptr<float>(), d_out, bias_ptr(bias),
               y.data_ptr<float>(), threads);
    } else if (fmt == 2) {
        TORCH_CHECK(scale.has_value() && zero.has_value(), "cs336::quantized int4 needs a scale and a zero");
        K.int4(xp, M, d_in, ldx, q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t *>(scale->data_ptr()),
               zero->data_ptr<uint8_t>(), scale->size(1), d_out, bias_ptr(bias), y.data_ptr<float>(), threads);
    } else {
        if (fmt < 3 || fmt > 5) fail("cs336::quantized: unknown format code " + std::to_string(fmt));
        K.ggml(static_cast<int>(fmt), xp, M, d_in, ldx, q.data_ptr<uint8_t>(), d_out, bias_ptr(bias),
               y.data_ptr<float>(), threads);
    }
    return y;
}

}  // namespace

TORCH_LIBRARY(cs336_native, m) {
    m.def("set_kernels(int[] addresses) -> ()", set_kernels);
    m.def("linear_f32(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("quantized(Tensor x, Tensor q, Tensor? scale, Tensor? zero, Tensor? bias, int fmt, int d_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(cs336_native, CPU, m) {
    m.impl("linear_f32", linear_f32);
    m.impl("quantized", quantized);
}
