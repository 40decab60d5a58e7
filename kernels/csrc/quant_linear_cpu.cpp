#ifndef QL_BODY
// Weight-only int8 / int4 matrix products on the CPU with fp32 activations, over weights packed 8 output rows
// interleaved (kernels/quant_linear_cpu.py packs them, builds this file and documents the op).
//
// Layouts (one tile = 8 output rows; the packed tensor is (N / 8, K * 8) bytes for int8, (N / 8, K * 4) for int4):
// - int8: chunk c of a tile holds 8 inputs (8c .. 8c + 7) of each of the 8 rows, row after row: 64 bytes, one
//   cache line, for 8 rows x 8 inputs. Scale per output row (N fp32, applied once at the end).
// - int4: chunk c holds 16 inputs (16c .. 16c + 15) of each of the 8 rows, 8 bytes a row: byte j carries input
//   16c + j in its low nibble and 16c + 8 + j in its high one. Per group and row a scale and an offset
//   (w = code * scale + offset), stored (N / 8, groups, 8): the 8 rows of a tile side by side.
//
// Batch 1 (decode): one pass over the tile's chunks, one activation vector load feeding 8 rows' FMAs, each row its
// own accumulator (8 independent chains), the codes widened and converted in registers (a sign-extending load and
// a convert), the 8 accumulators summed across lanes by a tree of pairwise adds into one vector of the 8 rows' sums;
// the AVX-512 body converts 16 codes at a time (two rows' chunk) and walks two ranges of the inputs side by side,
// prefetched far ahead (INT8_STREAMS).
// int4 quantizes x to int8 per group once per call and sums each group's code * xq exactly in integers, two rows per
// 32-byte load (int4_sums), weights prefetched ahead; it folds each group in as
// scale * xscale * sum(code * xq) + offset * sum(x) (sum(x) per group computed once per call).
// More rows (1 < M <= 32): a block of 256 inputs of the tile is dequantized once into an 8 KB fp32 buffer (L1),
// then every row of x is multiplied against it with the same 8 accumulators.
// Threads split the tiles (at::parallel_for).
//
// The same bodies are compiled three times, for AVX-512, AVX2+FMA and the baseline x86-64 (the file includes
// itself under GCC's target pragma); the caller picks one per call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"

namespace {

constexpr int64_t ROWS = 8;    // output rows per tile
constexpr int64_t BLOCK = 256;  // inputs dequantized together for M > 1
// int4 at M = 1: bytes of weights prefetched ahead of the loads (16 chunks). The int4 loop computes fast enough for the
// hardware prefetcher to fall behind: measured on the 2-core AMD EPYC (AVX2, bench-300m's matrices, one sweep of all
// of them, interleaved with int8), 2048 bytes ahead took the sweep from 1.3x to 1.7x faster than int8's; int8 gained
// nothing from it (its loop is bound by its converts), 4096 bytes ahead was no better
constexpr int64_t INT4_PREFETCH = 2048;
// int8 at M = 1 on AVX-512: the tile's inputs walked as INT8_STREAMS ranges at once, each prefetched INT8_PREFETCH
// bytes ahead (past the tile, into the next). Its 512-bit loop computes 25 G weights/s per core on data in cache (the
// 2-core Intel Xeon, AVX-512, bench-300m's matrices at one row), but one sequential stream per thread read only 8.8
// GB/s from memory there (fp32's GEMV 14 GB/s); the sweep of all of bench-300m's matrices at 2 threads, one stream,
// 2 KB ahead: 19.0 ms; two streams: 15.8 ms; two streams, 4 KB / 8 KB / 16 KB / 32 KB ahead: 13.8 / 13.0-13.2 /
// 12.6-12.7 / 13.7 ms; three or four streams were slower (13.9, 20.9 ms)
constexpr int64_t INT8_PREFETCH = 16384;
constexpr int INT8_STREAMS = 2;

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));
#define CV8(PTR) (*reinterpret_cast<const v8f*>(PTR))
#define V8(PTR) (*reinterpret_cast<v8f*>(PTR))

// lane r of the result: the sum of a[r]'s 8 lanes (the AVX hadd transpose as pairwise adds)
static AI v8f hsum8(const v8f* a) {
  const v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
  const v8i lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
  const v8f h01 = __builtin_shuffle(a[0], a[1], even) + __builtin_shuffle(a[0], a[1], odd);
  const v8f h23 = __builtin_shuffle(a[2], a[3], even) + __builtin_shuffle(a[2], a[3], odd);
  const v8f h45 = __builtin_shuffle(a[4], a[5], even) + __builtin_shuffle(a[4], a[5], odd);
  const v8f h67 = __builtin_shuffle(a[6], a[7], even) + __builtin_shuffle(a[6], a[7], odd);
  const v8f h0123 = __builtin_shuffle(h01, h23, even) + __builtin_shuffle(h01, h23, odd);
  const v8f h4567 = __builtin_shuffle(h45, h67, even) + __builtin_shuffle(h45, h67, odd);
  return __builtin_shuffle(h0123, h4567, lo) + __builtin_shuffle(h0123, h4567, hi);
}

struct Args {
  const float* x;        // (M, K) fp32
  const uint8_t* w;      // packed tiles
  const float* scale;    // int8: (N,); int4: (N / 8, groups, 8)
  const float* offset;   // int4: (N / 8, groups, 8)
  const float* xsum;     // int4, M = 1: (groups,) sums of x per group
  const int8_t* xq;      // int4, M = 1: x quantized to int8 per group (K,)
  const float* xscale;   // int4, M = 1: (groups,) its scales
  float* y;              // (M, N) fp32
  int64_t M, N, K, group;
  bool int4;
};

// the bodies below, compiled once per code path: this file includes itself under GCC's target pragma (which, unlike
// a target attribute, also covers the always-inline helpers and their intrinsics)
#define QL_BODY
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#define QL_ISA 2
namespace isa_avx512 {
#include __FILE__
}
#undef QL_ISA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define QL_ISA 1
namespace isa_avx2 {
#include __FILE__
}
#undef QL_ISA
#pragma GCC pop_options
#define QL_ISA 0
namespace isa_default {
#include __FILE__
}
#undef QL_ISA
#undef QL_BODY

at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor* offset,
               int64_t n_out, int64_t group, int64_t isa) {
  TORCH_CHECK(isa_supported(isa), "quant_linear: ISA ", isa, " is not supported by this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quant_linear: x must be (M, K) fp32");
  const int64_t M = x.size(0), K = x.size(1), tiles = (n_out + ROWS - 1) / ROWS;
  const bool int4 = offset != nullptr;
  TORCH_CHECK(packed.is_contiguous() && packed.size(0) == tiles, "quant_linear: packed weight of ", tiles, " tiles");
  TORCH_CHECK(packed.size(1) == (int4 ? K * ROWS / 2 : K * ROWS), "quant_linear: packed width does not match K ", K);
  TORCH_CHECK(K % (int4 ? 32 : 8) == 0 && (!int4 || (group % 32 == 0 && K % group == 0)), "quant_linear: K, group");
  TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat, "quant_linear: scale fp32 contiguous");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, n_out}, x.options());
  at::Tensor xsum, xq;
  Args a{};
  a.x = xc.data_ptr<float>();
  a.w = static_cast<const uint8_t*>(packed.data_ptr());
  a.scale = scale.data_ptr<float>();
  a.y = y.data_ptr<float>();
  a.M = M;
  a.N = n_out;
  a.K = K;
  a.group = group;
  a.int4 = int4;
  if (int4) {
    TORCH_CHECK(offset->is_contiguous() && offset->scalar_type() == at::kFloat, "quant_linear: offset");
    TORCH_CHECK(scale.numel() == tiles * (K / group) * ROWS && offset->numel() == scale.numel(),
                "quant_linear: scale/offset (tiles, groups, 8)");
    a.offset = offset->data_ptr<float>();
    if (M == 1) {
      // x per group: its sum, and int8 codes with scale max|x| / 127 (round half to even), the formula of
      // workbench.model.quant.quantize_int8 applied to x.view(groups, group)
      const int64_t groups = K / group;
      xq = at::empty({K}, x.options().dtype(at::kChar));
      xsum = at::empty({2 * groups}, x.options());
      int8_t* q = xq.data_ptr<int8_t>();
      float* sums = xsum.data_ptr<float>();
      const float* xp = a.x;
      for (int64_t g = 0; g < groups; ++g) {
        float amax = 0.0f, sum = 0.0f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          amax = std::max(amax, std::fabs(xp[k]));
          sum += xp[k];
        }
        const float s = std::max(amax, 1e-12f) / 127.0f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          q[k] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(xp[k] / s))));
        }
        sums[g] = sum;
        sums[groups + g] = s;
      }
      a.xq = q;
      a.xsum = sums;
      a.xscale = sums + groups;
    }
  } else {
    TORCH_CHECK(scale.numel() >= tiles * ROWS, "quant_linear: scale of ", tiles * ROWS, " rows (padded)");
  }
  // tiles per task: enough work per task (64 KB of weights at least) without starving threads
  const int64_t tile_bytes = int4 ? K * ROWS / 2 : K * ROWS;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(tile_bytes, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> work(M > 1 ? BLOCK * ROWS + M * ROWS : 0);
    float* buf = work.data();
    float* yt = M > 1 ? buf + BLOCK * ROWS : nullptr;
    if (isa == ISA_AVX512) isa_avx512::tiles(a, begin, end, buf, yt);
    else if (isa == ISA_AVX2) isa_avx2::tiles(a, begin, end, buf, yt);
    else isa_default::tiles(a, begin, end, buf, yt);
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n_out,
                       int64_t isa) {
  return run(x, packed, scale, nullptr, n_out, 0, isa);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& offset, int64_t n_out, int64_t group, int64_t isa) {
  return run(x, packed, scale, &offset, n_out, group, isa);
}

bool cpu_supports(int64_t isa) { return isa_supported(isa); }

}  // namespace

TORCH_LIBRARY(workbench_quant, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int n_out, int isa) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor offset, int n_out, int group, int isa) -> Tensor");
  m.def("cpu_supports(int isa) -> bool", &cpu_supports);
}

TORCH_LIBRARY_IMPL(workbench_quant, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}

#else  // QL_BODY: one code path's kernels (QL_ISA: 0 baseline, 1 AVX2+FMA, 2 AVX-512)

// 8 int8 codes as fp32, and 8 bytes widened to int32: one sign/zero-extending load (GCC's generic vector
// conversion of an 8-byte vector took a scalar convert per lane); the baseline path converts lane by lane
static AI v8f cvt_i8(const int8_t* p) {
#if QL_ISA >= 1
  return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  v8f r;
  for (int i = 0; i < 8; ++i) r[i] = float(p[i]);
  return r;
#endif
}

static AI v8i widen_u8(const uint8_t* p) {
#if QL_ISA >= 1
  return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  v8i r;
  for (int i = 0; i < 8; ++i) r[i] = p[i];
  return r;
#endif
}


// y[m, tile rows] for one tile at M = 1, int8
static AI void tile_int8_m1(const Args& a, int64_t t) {
  const int8_t* w = reinterpret_cast<const int8_t*>(a.w) + t * ROWS * a.K;
#if QL_ISA >= 2
  // AVX-512: 16 codes per sign-extend and convert (rows 2q and 2q + 1's 8 inputs of a chunk in one vector, the
  // chunk's 8 activations in both halves: twice the 256-bit loop's codes per convert, which bound that loop); the
  // chunks in INT8_STREAMS ranges walked side by side, each range its 4 accumulators, the leftover chunks (chunks
  // not a multiple of INT8_STREAMS) into the first range's; the ranges added at the end
  const int64_t chunks = a.K / 8, part = chunks / INT8_STREAMS;
  __m512 acc[INT8_STREAMS][4];
#pragma GCC unroll 16
  for (int i = 0; i < INT8_STREAMS * 4; ++i) acc[i / 4][i % 4] = _mm512_setzero_ps();
  // chunk c into one range's 4 accumulators
  const auto chunk = [&](int64_t c, __m512* r) __attribute__((always_inline)) {
    const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(a.x + 8 * c));
    const int8_t* p = w + 64 * c;
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * q));
      r[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), xv, r[q]);
    }
  };
  for (int64_t c = 0; c < part; ++c) {
#pragma GCC unroll 4
    for (int j = 0; j < INT8_STREAMS; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + 64 * (j * part + c) + INT8_PREFETCH), _MM_HINT_T0);
      chunk(j * part + c, acc[j]);
    }
  }
  for (int64_t c = INT8_STREAMS * part; c < chunks; ++c) chunk(c, acc[0]);
  v8f rows[ROWS];
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    __m512 s = acc[0][q];
#pragma GCC unroll 4
    for (int j = 1; j < INT8_STREAMS; ++j) s = _mm512_add_ps(s, acc[j][q]);
    rows[2 * q] = (v8f)_mm512_castps512_ps256(s);
    rows[2 * q + 1] = (v8f)_mm512_extractf32x8_ps(s, 1);
  }
  const v8f s = hsum8(rows) * CV8(a.scale + t * ROWS);
#else
  v8f acc[ROWS] = {};
  for (int64_t c = 0; c < a.K / 8; ++c) {
    const v8f xv = CV8(a.x + 8 * c);
    const int8_t* p = w + 64 * c;
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) acc[r] += xv * cvt_i8(p + 8 * r);
  }
  const v8f s = hsum8(acc) * CV8(a.scale + t * ROWS);
#endif
  float out[ROWS];
  V8(out) = s;
  for (int64_t r = 0; r < ROWS && t * ROWS + r < a.N; ++r) a.y[t * ROWS + r] = out[r];
}

// Exact int32 sums sum(code * xq) of the tile's 8 rows over int4 chunks c0 .. c1 (32 inputs each), lane r = row r.
// AVX2 / AVX-512: one 32-byte load holds two rows' 16 bytes (rows 2q, 2q + 1 in the low and high 128 bits), so one
// mask and one shift give both rows' 32 codes; vpmaddubsw multiplies the unsigned codes by the int8 inputs (the 16
// low-nibble inputs, then the 16 high-nibble ones, each broadcast to both halves) and adds pairs in int16. Up to 4
// chunks are summed in int16 (each lane at most 4 products per chunk of <= 15 * 127: 4 * 4 * 1905 = 30480 < 2^15),
// then vpmaddwd widens to int32; two vphaddd levels and one vpermd bring the 8 rows' lanes together at the end.
// The baseline path sums the same products one by one: every path returns the same integers.
static AI v8i int4_sums(const uint8_t* w, const int8_t* xq, int64_t c0, int64_t c1) {
#if QL_ISA >= 1
  const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int64_t b = c0; b < c1; b += 4) {
    __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    const int64_t e = std::min<int64_t>(b + 4, c1);
    for (int64_t c = b; c < e; ++c) {
      const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 32 * c)));
      const __m256i xh =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 32 * c + 16)));
      const uint8_t* p = w + 128 * c;
      _mm_prefetch(reinterpret_cast<const char*>(p + INT4_PREFETCH), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + INT4_PREFETCH + 64), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * q));
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        s[q] = _mm256_add_epi16(s[q], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
      }
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) acc[q] = _mm256_add_epi32(acc[q], _mm256_madd_epi16(s[q], ones));
  }
  // acc[q]: lanes 0-3 row 2q, 4-7 row 2q + 1 -> [r0 r2 r4 r6 | r1 r3 r5 r7] -> rows in order
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
  return (v8i)_mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#else
  v8i acc = {};
  for (int64_t c = c0; c < c1; ++c) {
    for (int r = 0; r < ROWS; ++r) {
      const uint8_t* p = w + 128 * c + 16 * r;
      const int8_t* x = xq + 32 * c;
      for (int j = 0; j < 16; ++j) acc[r] += int32_t(p[j] & 15) * x[j] + int32_t(p[j] >> 4) * x[16 + j];
    }
  }
  return acc;
#endif
}

// y[m, tile rows] for one tile at M = 1, int4: x quantized to int8 per group (xq, xscale), each group's products
// summed exactly in int32, then scale * xscale * sum(code * xq) + offset * sum(x) per row and group
static AI void tile_int4_m1(const Args& a, int64_t t) {
  const uint8_t* w = a.w + t * ROWS * a.K / 2;
  const int64_t groups = a.K / a.group, per_group = a.group / 32;
  const float* sc = a.scale + t * groups * ROWS;
  const float* of = a.offset + t * groups * ROWS;
  v8f tot = {};
  for (int64_t g = 0; g < groups; ++g) {
    const v8f dots = __builtin_convertvector(int4_sums(w, a.xq, g * per_group, (g + 1) * per_group), v8f);
    tot += dots * (CV8(sc + g * ROWS) * a.xscale[g]) + CV8(of + g * ROWS) * a.xsum[g];
  }
  float out[ROWS];
  V8(out) = tot;
  for (int64_t r = 0; r < ROWS && t * ROWS + r < a.N; ++r) a.y[t * ROWS + r] = out[r];
}

// inputs k0 .. k0 + n of one tile as fp32, chunk-major as the packed layout (8 rows x 8 inputs per 64 floats);
// int8 codes as they are (the row scale comes last), int4 as code * scale + offset
static AI void dequant_block(const Args& a, int64_t t, int64_t k0, int64_t n, float* buf) {
  if (!a.int4) {
    const int8_t* w = reinterpret_cast<const int8_t*>(a.w) + t * ROWS * a.K + k0 * ROWS;
    for (int64_t i = 0; i < n * ROWS; i += 8) V8(buf + i) = cvt_i8(w + i);
    return;
  }
  const uint8_t* w = a.w + t * ROWS * a.K / 2 + k0 * ROWS / 2;
  const int64_t groups = a.K / a.group;
  for (int64_t c = 0; c < n / 32; ++c) {
    const int64_t g = (k0 + 32 * c) / a.group;
    const float* sc = a.scale + (t * groups + g) * ROWS;
    const float* of = a.offset + (t * groups + g) * ROWS;
    // the 32-input chunk becomes four 8-input chunks of the fp32 layout: low nibbles of bytes 0-7, 8-15, then high
    float* dst = buf + 256 * c;
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const uint8_t* p = w + 128 * c + 16 * r;
      const v8i b0 = widen_u8(p), b1 = widen_u8(p + 8);
      V8(dst + 8 * r) = __builtin_convertvector(b0 & 15, v8f) * sc[r] + of[r];
      V8(dst + 64 + 8 * r) = __builtin_convertvector(b1 & 15, v8f) * sc[r] + of[r];
      V8(dst + 128 + 8 * r) = __builtin_convertvector(b0 >> 4, v8f) * sc[r] + of[r];
      V8(dst + 192 + 8 * r) = __builtin_convertvector(b1 >> 4, v8f) * sc[r] + of[r];
    }
  }
}

// y[:, tile rows] for one tile at M > 1: each block dequantized once, then every row of x against it
static AI void tile_rows(const Args& a, int64_t t, float* buf, float* ytile) {
  std::fill(ytile, ytile + a.M * ROWS, 0.0f);
  for (int64_t k0 = 0; k0 < a.K; k0 += BLOCK) {
    const int64_t n = std::min(BLOCK, a.K - k0);
    dequant_block(a, t, k0, n, buf);
    for (int64_t m = 0; m < a.M; ++m) {
      const float* xm = a.x + m * a.K + k0;
      v8f acc[ROWS] = {};
      for (int64_t c = 0; c < n / 8; ++c) {
        const v8f xv = CV8(xm + 8 * c);
        const float* p = buf + 64 * c;
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) acc[r] += xv * CV8(p + 8 * r);
      }
      V8(ytile + m * ROWS) += hsum8(acc);
    }
  }
  for (int64_t m = 0; m < a.M; ++m) {
    v8f s = CV8(ytile + m * ROWS);
    if (!a.int4) s *= CV8(a.scale + t * ROWS);
    float out[ROWS];
    V8(out) = s;
    for (int64_t r = 0; r < ROWS && t * ROWS + r < a.N; ++r) a.y[m * a.N + t * ROWS + r] = out[r];
  }
}

static AI void tiles_body(const Args& a, int64_t begin, int64_t end, float* buf, float* ytile) {
  for (int64_t t = begin; t < end; ++t) {
    if (a.M == 1 && a.int4) tile_int4_m1(a, t);
    else if (a.M == 1) tile_int8_m1(a, t);
    else tile_rows(a, t, buf, ytile);
  }
}

__attribute__((noinline)) void tiles(const Args& a, int64_t b, int64_t e, float* buf, float* yt) {
  tiles_body(a, b, e, buf, yt);
}

#endif  // QL_BODY
