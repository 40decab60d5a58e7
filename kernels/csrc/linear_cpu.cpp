#ifndef BL_BODY
// fp32 matrix product y = x W^T (+ bias) on the CPU over a weight laid out in blocks of 64 output columns
// (kernels/linear_cpu.py packs the weight, builds this file and documents the op and its measurements).
//
// Layout: (N / 64, K, 64) fp32, block b holding output columns 64b .. 64b + 63 input after input, so that one
// block is one sequential stream of K x 256 bytes (N padded to a multiple of 64 with zero columns).
//
// A task is one block and up to MC rows of x; it walks the block's inputs in chunks of KC (a 128 KB panel of the
// weights, read once from memory and then from L2 for every MR rows of x) and, inside a chunk, MR rows at a time:
// MR x 64 accumulators in registers, one load of the chunk's next 64 weights feeding MR rows' FMAs with x[m][k]
// broadcast. At a few rows (decode) that is one sequential read of the weights per thread with nothing else to do;
// at hundreds of rows it is a register-blocked GEMM whose weight panel stays in L2. The task's MC x 64 results
// collect in a buffer and are copied to y at the end (a partial last block's padded columns are dropped there).
// Threads split the tasks (at::parallel_for).
//
// The same body is compiled three times, for AVX-512 (16 lanes, MR 6: 24 accumulators), AVX2+FMA (8 lanes, the
// block in two halves of 32 columns, MR 3: 12 accumulators) and the baseline x86-64 (SSE2, 4 lanes, four quarters,
// MR 3); the file includes itself under GCC's target pragma and the caller picks one per call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_isa.h"

namespace {

constexpr int64_t COLS = 64;  // output columns per block
constexpr int64_t KC = 512;   // inputs per chunk: a 128 KB panel of the block
constexpr int64_t MC = 192;   // rows of x per task

struct Args {
  const float* x;     // (M, K), contiguous
  const float* w;     // (blocks, K, 64)
  const float* bias;  // (N,) or null
  float* y;           // (M, N)
  int64_t M, N, K;
};

// the bodies below, compiled once per code path: this file includes itself under GCC's target pragma (which, unlike
// a target attribute, also covers the always-inline helpers)
#define BL_BODY
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#define BL_ISA 2
namespace isa_avx512 {
#include __FILE__
}
#undef BL_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define BL_ISA 1
namespace isa_avx2 {
#include __FILE__
}
#undef BL_ISA
#pragma GCC pop_options
#define BL_ISA 0
namespace isa_default {
#include __FILE__
}
#undef BL_ISA
#undef BL_BODY

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                          int64_t n_out, int64_t isa) {
  TORCH_CHECK(isa_supported(isa), "blocked_linear: ISA ", isa, " is not supported by this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "blocked_linear: x must be (M, K) fp32");
  const int64_t M = x.size(0), K = x.size(1), blocks = (n_out + COLS - 1) / COLS;
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == blocks && packed.size(1) == K && packed.size(2) == COLS,
              "blocked_linear: the packed weight must be (", blocks, ", ", K, ", ", COLS, ") fp32 contiguous, got ",
              packed.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_out,
                "blocked_linear: bias must be (", n_out, ") fp32");
  }
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, n_out}, x.options());
  if (M == 0 || n_out == 0) return y;
  Args a{xc.data_ptr<float>(), packed.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
         y.data_ptr<float>(), M, n_out, K};
  const int64_t chunks = (M + MC - 1) / MC;
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[MC * COLS];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / chunks, m0 = (t % chunks) * MC;
      if (isa == ISA_AVX512) isa_avx512::task(a, b, m0, buf);
      else if (isa == ISA_AVX2) isa_avx2::task(a, b, m0, buf);
      else isa_default::task(a, b, m0, buf);
    }
  });
  return y;
}

bool cpu_supports(int64_t isa) { return isa_supported(isa); }

}  // namespace

TORCH_LIBRARY(workbench_linear, m) {
  m.def("blocked_linear(Tensor x, Tensor packed, Tensor? bias, int n_out, int isa) -> Tensor");
  m.def("cpu_supports(int isa) -> bool", &cpu_supports);
}

TORCH_LIBRARY_IMPL(workbench_linear, CPU, m) { m.impl("blocked_linear", &blocked_linear); }

#else  // BL_BODY: one code path's kernels (BL_ISA: 0 baseline, 1 AVX2+FMA, 2 AVX-512)

#if BL_ISA == 2
constexpr int VW = 16;  // fp32 lanes per vector
constexpr int MR = 6;   // rows of x per micro-tile
#elif BL_ISA == 1
constexpr int VW = 8;
constexpr int MR = 3;
#else
constexpr int VW = 4;
constexpr int MR = 3;
#endif
constexpr int NV = 4;                     // vectors per row of a micro-tile
constexpr int PART = NV * VW;             // columns per micro-tile
constexpr int PARTS = int(COLS) / PART;   // micro-tiles across a block
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));

// rows m0 .. m0 + R - 1 of x times columns [0, PART) of w (a chunk of kc inputs, rows COLS apart), into c (rows
// COLS apart): c = (first ? init : c) + x w, init being the bias (or zeros)
template <int R>
static AI void micro(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t kc,
                     float* __restrict c, bool first, const float* __restrict init) {
  vf acc[R][NV];
  for (int m = 0; m < R; ++m) {
    for (int v = 0; v < NV; ++v) {
      if (!first) acc[m][v] = *reinterpret_cast<const vf*>(c + m * COLS + v * VW);
      else if (init) acc[m][v] = *reinterpret_cast<const vf*>(init + v * VW);
      else acc[m][v] = vf{};
    }
  }
  for (int64_t k = 0; k < kc; ++k, w += COLS) {
    vf wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = *reinterpret_cast<const vf*>(w + v * VW);
    for (int m = 0; m < R; ++m) {
      const float s = x[m * ldx + k];
      for (int v = 0; v < NV; ++v) acc[m][v] += s * wv[v];
    }
  }
  for (int m = 0; m < R; ++m) {
    for (int v = 0; v < NV; ++v) *reinterpret_cast<vf*>(c + m * COLS + v * VW) = acc[m][v];
  }
}

template <int R>
static void rows_of(const float* x, int64_t ldx, const float* w, int64_t kc, float* c, bool first,
                    const float* init) {
  for (int p = 0; p < PARTS; ++p) {
    micro<R>(x, ldx, w + p * PART, kc, c + p * PART, first, init ? init + p * PART : nullptr);
  }
}

// one task: block b of the weight times rows m0 .. m0 + MC - 1 of x (fewer at the end), into y
void task(const Args& a, int64_t b, int64_t m0, float* buf) {
  const int64_t rows = std::min<int64_t>(MC, a.M - m0), col0 = b * COLS, cols = std::min<int64_t>(COLS, a.N - col0);
  alignas(64) float bias[COLS] = {};
  const float* init = nullptr;
  if (a.bias) {
    std::memcpy(bias, a.bias + col0, cols * sizeof(float));
    init = bias;
  }
  const float* wb = a.w + b * a.K * COLS;
  const float* xb = a.x + m0 * a.K;
  const int64_t k_chunks = std::max<int64_t>(1, (a.K + KC - 1) / KC);  // one (empty) chunk when K is 0: y = bias
  for (int64_t c = 0; c < k_chunks; ++c) {
    const int64_t k0 = c * KC, kc = std::min<int64_t>(KC, a.K - k0);
    const bool first = c == 0;
    const float* w = wb + k0 * COLS;
    int64_t m = 0;
    for (; m + MR <= rows; m += MR) rows_of<MR>(xb + m * a.K + k0, a.K, w, kc, buf + m * COLS, first, init);
    switch (rows - m) {
#if BL_ISA == 2
      case 5: rows_of<5>(xb + m * a.K + k0, a.K, w, kc, buf + m * COLS, first, init); break;
      case 4: rows_of<4>(xb + m * a.K + k0, a.K, w, kc, buf + m * COLS, first, init); break;
      case 3: rows_of<3>(xb + m * a.K + k0, a.K, w, kc, buf + m * COLS, first, init); break;
#endif
      case 2: rows_of<2>(xb + m * a.K + k0, a.K, w, kc, buf + m * COLS, first, init); break;
      case 1: rows_of<1>(xb + m * a.K + k0, a.K, w, kc, buf + m * COLS, first, init); break;
      default: break;
    }
  }
  for (int64_t m = 0; m < rows; ++m) std::memcpy(a.y + (m0 + m) * a.N + col0, buf + m * COLS, cols * sizeof(float));
}

#endif  // BL_BODY
