// Paged decode attention on the CPU: one query token per sequence against its blocks, read where the pool holds
// them (kernels/paged_decode_cpu.py builds this file and documents the op).
//
// One task per sequence (all its KV heads, side by side in the pool) when the batch keeps every thread busy, else per
// (sequence, KV head); tasks are spread over torch's OpenMP threads. The context is walked block table by block
// table in tiles of at most TILE tokens; each tile's rows are found once, then per KV head read in place, 8 values
// at a time into registers and converted there (fp32 as is, bf16 by a shift, int8 to its integers, fp8 e4m3 by bits):
// nothing of the pool is copied or dequantized into memory, and the next tile's rows are prefetched a line at a
// time through the tile's work (NextTile: two schedules, the Xeon's and the AMD EPYC's). The group's query heads
// (GQA/MQA: num_heads / num_kv_heads) are scored together, up to 3 heads x 4 rows of accumulators, so each converted
// row serves every head of the block (fp32 rows: one head x 8 rows, or grouped too: head_block); a quantized row's
// scale (int8: per token and head; fp8: the layer's) multiplies the dot product, not the row. The scores go into an
// online softmax (running max, sum, exp on 8 lanes), and acc += p V the same way, the V scale folded into the weight
// p, the heads' accumulators held in registers across the rows. The new token's K/V (fp32), when given, are the last
// key.
//
// The same body is compiled three times, for AVX-512, AVX2+FMA+F16C and the baseline x86-64 (GCC's target
// attribute); the caller picks one per call (``isa``), and the Python side only offers what the CPU supports.
// A second op, prompt_attention (at the end of the file), attends whole prompts over their own K/V.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "cpu_isa.h"

namespace {

constexpr int64_t TILE = 32;  // tokens scored together before one online-softmax update

enum KvKind : int64_t { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8 = 3 };


// exp(x) for x <= 0 in a form the vectorizer takes (a libm call per score was most of the op's time): x = n ln2 + r,
// |r| <= ln2 / 2, Cephes' degree-6 polynomial for exp(r) (relative error about 2e-7), 2^n from the exponent bits;
// x is clamped at -87 (exp(-87) ~ 1.6e-38, a weight of 0 to fp32 next to the running maximum's 1)
static inline __attribute__((always_inline)) float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

struct Args {
  const float* q;         // (B, H, D) fp32, already scaled
  const uint8_t* k;       // pool (num_blocks, block_size, KVH, D) of `kind`
  const uint8_t* v;
  const float* k_scale;   // int8: (num_blocks, block_size, KVH); fp8: one element; else null
  const float* v_scale;
  const int32_t* tables;  // (B, max_blocks)
  const int64_t* lens;    // (B,) cached keys to read from the pool
  const float* k_new;     // (B, KVH, D) fp32 or null
  const float* v_new;
  float* out;             // (B, H, D) fp32
  int64_t kind, H, KVH, D, block_size, max_blocks;
  int64_t s_kb, s_kt, s_kh;  // pool strides in elements (block, token, head); the head dim is contiguous
  int64_t s_sb, s_st;        // int8 scale strides (block, token); the head is contiguous
  int64_t heads_per_task;    // KV heads one task walks together (all of a sequence's, or one)
  bool even;                 // the schedule: NextTile's even spread and head_block's fp32 groups (else as on Intel)
};

// 8 floats: GCC's vector extension, lowered to one ymm register under AVX2/AVX-512, two xmm ones on the baseline
typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define V8(PTR) (*reinterpret_cast<v8f*>(PTR))
#define CV8(PTR) (*reinterpret_cast<const v8f*>(PTR))

// exp_neg on a vector of lanes (8 or 16): n by the round-to-nearest of adding 1.5 * 2^23 (|x log2 e| <= 126 here),
// 2^n from the bits
template <typename VF, typename VI>
static AI VF exp_neg_lanes(VF x) {
  const VF lowest = VF{} - 87.0f;
  x = x < lowest ? lowest : x;
  const VF magic = VF{} + 12582912.0f;
  const VF n = (x * 1.44269504088896341f + magic) - magic;
  const VF r = x - n * 0.693359375f + n * 2.12194440e-4f;
  VF p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  VF two_n;
  std::memcpy(&two_n, &bits, sizeof(VF));
  return p * two_n;
}

static AI v8f exp_neg8(v8f x) { return exp_neg_lanes<v8f, v8i>(x); }

// The next tile's rows (this task's KV heads, K and V) asked of memory one cache line at a time, spread through this
// tile's work: a slot at each 8 values of a row scored and each V row weighted. One thread streams the pool at the
// rate of its outstanding misses (a handful of fill buffers a core): a burst of the whole tile's lines at its start
// (768 for SmolLM2-135M's fp32 rows) held the core until the burst was served, and memory and compute took turns.
// Two schedules (``Args::even``, ``SCHEDULES`` in kernels/paged_decode_cpu.py), each the faster where it was measured
// (`workbench bench attention --model SmolLM2-135M --threads 1 --batch 32 --prompt-len 1024`, which times both):
// - a line a slot, the lines left over at the tile's end (``even`` 0): on an AVX-512 Xeon fp32 KV 119-123 ms (12.3-12.7
//   GB/s; a plain read streams 15.6 GB/s) against 151-153 with the burst, 9.6 GB/s with no software prefetch at all,
//   slower at a line per two slots or two per slot;
// - the lines spread evenly over the slots the previous whole tile took (``even`` 1; a line a slot until one has been
//   counted): on an AMD EPYC (Zen 4) fp32 KV 99.0 ms (15.3 GB/s) against 126.3 (12.0) a line a slot, at batch 16 x
//   2,048 96.8 against 119.2, int8 KV within the runs' spread, batch 2 the same. In variants of this file alternated
//   in one process there, two lines a slot ran ahead of the tile where fp32 heads went one at a time (more slots than
//   half the lines), and a burst at the tile's start, or the lines of one head at a time, read no faster than no
//   prefetch at all (6.7-7.6 GB/s against 7.8).
struct NextTile {
  const uint8_t* k[TILE];
  const uint8_t* v[TILE];
  int64_t rows = 0, row = 0, line = 0, lines = 0;  // lines: a row's K and V lines, alternating K, V
  bool even = false;
  int64_t total = 0, slots = 0, credit = 0, counted = 0;  // even: this tile's lines, the last tile's slots
  AI void one() {
    __builtin_prefetch((line & 1 ? v[row] : k[row]) + (line >> 1) * 64);
    if (++line == lines) {
      line = 0;
      ++row;
    }
  }
  AI void step() {
    ++counted;
    if (!even || slots == 0) {
      if (row < rows) one();
      return;
    }
    for (credit += total; credit >= slots && row < rows; credit -= slots) one();
  }
  // after a tile: what its work left, and (a whole tile) its slots, the pace of the next
  AI void finish(bool whole) {
    while (row < rows) one();
    if (whole) slots = counted;
    counted = 0;
  }
};

constexpr int64_t elem_size(int KIND) { return KIND == KV_F32 ? 4 : KIND == KV_BF16 ? 2 : 1; }

typedef uint32_t v8u __attribute__((vector_size(32)));

// 8 int8 widened to 8 int32 lanes, 8 uint16 to 8 uint32: vpmovsxbd, vpmovzxwd on AVX2 and AVX-512 (GCC's builtins,
// not the intrinsics: these helpers are inlined into the target-attributed task functions, and only there is the ISA
// enabled), an element loop on the baseline (GCC 12 lowers a generic vector conversion of 8 bytes to a scalar
// conversion per lane: int8 decode at half the speed)
template <int ISA>
static AI v8i widen_i8(const uint8_t* p) {
  if constexpr (ISA != ISA_DEFAULT) {
    typedef char v16qi __attribute__((vector_size(16)));
    typedef long long v2di __attribute__((vector_size(16)));
    long long bytes;
    std::memcpy(&bytes, p, 8);
    return reinterpret_cast<v8i>(__builtin_ia32_pmovsxbd256(reinterpret_cast<v16qi>(v2di{bytes, 0})));
  } else {
    v8i x;
    for (int k = 0; k < 8; ++k) x[k] = int8_t(p[k]);
    return x;
  }
}

template <int ISA>
static AI v8i widen_u16(const uint8_t* p) {
  if constexpr (ISA != ISA_DEFAULT) {
    typedef short v8hi __attribute__((vector_size(16), aligned(1)));
    return reinterpret_cast<v8i>(__builtin_ia32_pmovzxwd256(*reinterpret_cast<const v8hi*>(p)));
  } else {
    v8i x;
    for (int k = 0; k < 8; ++k) {
      uint16_t h;
      std::memcpy(&h, p + 2 * k, 2);
      x[k] = h;
    }
    return x;
  }
}

// chunk c (8 values) of a row of KIND as 8 fp32 lanes in a register, nothing stored: fp32 read as is, bf16 widened by a
// shift, int8 as its integers (the per-row scale is applied to the dot product, or folded into the softmax weight),
// fp8 e4m3fn as 2^-8 times its value (the layer's scale times 2^8 applied like int8's). fp8 by bits, no table: on
// AVX2/AVX-512 the 7 magnitude bits placed under fp16's exponent and mantissa (sign to bit 15) are an fp16 of 2^-8
// times the value, normals and subnormals alike (both formats' subnormals line up), widened by F16C's vcvtph2ps;
// the baseline places them under fp32's exponent and mantissa (2^-120 times the value, sign to bit 31) and lifts
// that out of fp32's subnormal range by one exact multiply by 2^112 (on Intel CPUs every multiply of a subnormal
// takes a microcode assist: that path decoded fp8 at half of fp32's speed there). 0x7f/0xff (NaN) are never written
template <int KIND, int ISA>
static AI v8f load8(const uint8_t* row, int64_t c) {
  if constexpr (KIND == KV_F32) {
    return CV8(reinterpret_cast<const float*>(row) + 8 * c);
  } else if constexpr (KIND == KV_BF16) {
    return reinterpret_cast<v8f>(widen_u16<ISA>(row + 16 * c) << 16);
  } else if constexpr (KIND == KV_INT8) {
    return __builtin_convertvector(widen_i8<ISA>(row + 8 * c), v8f);
  } else if constexpr (ISA != ISA_DEFAULT) {
    typedef char v16qi __attribute__((vector_size(16)));
    typedef short v8hi __attribute__((vector_size(16)));
    typedef long long v2di __attribute__((vector_size(16)));
    long long bytes;
    std::memcpy(&bytes, row + 8 * c, 8);
    const v8hi x = __builtin_ia32_pmovzxbw128(reinterpret_cast<v16qi>(v2di{bytes, 0}));
    const v8hi h = ((x & 0x7F) << 7) | ((x & 0x80) << 8);
    return reinterpret_cast<v8f>(__builtin_ia32_vcvtph2ps256(h));
  } else {
    const v8u bits = (reinterpret_cast<v8u>(widen_i8<ISA>(row + 8 * c)) << 20) & 0x87F00000u;
    return reinterpret_cast<v8f>(bits) * 0x1p112f;
  }
}

// the row's last, partial chunk c (its first `valid` values, the rest read as zeros)
template <int KIND, int ISA>
static AI v8f load8_tail(const uint8_t* row, int64_t c, int64_t valid) {
  constexpr int64_t ES = elem_size(KIND);
  uint8_t tmp[32] = {};
  std::memcpy(tmp, row + 8 * c * ES, valid * ES);
  return load8<KIND, ISA>(tmp, 0);
}

// the 4 sums across lanes of a0..a3 (a tree of pairwise adds, the AVX hadd transpose)
static AI void sum4(v8f a0, v8f a1, v8f a2, v8f a3, float* out) {
  const v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
  const v8f h01 = __builtin_shuffle(a0, a1, even) + __builtin_shuffle(a0, a1, odd);
  const v8f h23 = __builtin_shuffle(a2, a3, even) + __builtin_shuffle(a2, a3, odd);
  const v8f h = __builtin_shuffle(h01, h23, even) + __builtin_shuffle(h01, h23, odd);  // a0..a3 low, then high
  for (int r = 0; r < 4; ++r) out[r] = h[r] + h[r + 4];
}

// the 8 sums across lanes of a[0..7], as one vector
static AI v8f sum8(const v8f* a) {
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

// raw dot products of GB query heads (q: GB rows of DP, padded with zeros) with R rows, one accumulator per (head,
// row): each 8 values of a row are loaded (and converted) once for all GB heads. out[g * TILE + r]. NCF whole
// chunks, then a partial one of `tail` values when D is not a multiple of 8
template <int KIND, int ISA, int GB, int R>
static AI void score_rows(const float* q, int64_t DP, const uint8_t* const* rows, int64_t NCF, int64_t tail,
                          float* out, NextTile* next) {
  v8f acc[GB][R];
#pragma GCC unroll 8
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[g][r] = v8f{};
  for (int64_t c = 0; c < NCF; ++c) {
    next->step();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const v8f x = load8<KIND, ISA>(rows[r], c);
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) acc[g][r] += CV8(q + g * DP + 8 * c) * x;
    }
  }
  if (tail) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const v8f x = load8_tail<KIND, ISA>(rows[r], NCF, tail);
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) acc[g][r] += CV8(q + g * DP + 8 * NCF) * x;
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
    if constexpr (R == 8) V8(out + g * TILE) = sum8(acc[g]);
    else sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], out + g * TILE);
  }
}

// acc (GB heads, each DP floats) chunks [c0, c0 + W) += sum_i w[g * TILE + i] * row_i: each 8 values of a row loaded
// (and converted) once for the GB heads, GB x W accumulators in registers across the rows; TAIL: the one partial
// chunk (W = 1) of `tail` values
template <int KIND, int ISA, int GB, int W, bool TAIL>
static AI void pv_rows(const float* w, const uint8_t* const* rows, int64_t n, int64_t c0, int64_t tail, float* acc,
                       int64_t DP, NextTile* next) {
  v8f a[GB][W];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) a[g][j] = CV8(acc + g * DP + 8 * (c0 + j));
  for (int64_t i = 0; i < n; ++i) {
    next->step();
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) {
      const v8f x = TAIL ? load8_tail<KIND, ISA>(rows[i], c0 + j, tail) : load8<KIND, ISA>(rows[i], c0 + j);
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) a[g][j] += w[g * TILE + i] * x;
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) V8(acc + g * DP + 8 * (c0 + j)) = a[g][j];
}

// query heads scored (and weighted) per block (GB): a converted row is shared by at most 3 (3 heads x 4 rows = 12
// accumulators, of AVX2's 16 vector registers; 4 as 2 + 2). An fp32 row needs no conversion, and on the Xeon its heads
// went faster one at a time, 8 rows at once (batch 16 x context 2,048, 1 thread: the old per-head fp32 body 0.83x as
// fast at 3 heads x 4 rows, 1.12x at 1 head x 8 rows: more rows in flight from DRAM); on the AMD EPYC, with the even
// prefetch, grouped (group_f32) when a task walks all of a sequence's KV heads (variants of this file alternated, batch
// 32 x 1,024: 114 against 134 ms), one at a time when it walks one (batch 1-2: 8% faster)
template <int KIND>
static AI int head_block(int64_t left, bool group_f32) {
  if (KIND == KV_F32 && !group_f32) return 1;
  return left >= 3 ? (left == 4 ? 2 : 3) : int(left);
}

// scores of the G heads (q: G rows of DP) against rows [0, n8) (n8 a multiple of 8; padding rows point at zeros)
template <int KIND, int ISA>
static AI void scores_tile(const float* q, int64_t G, int64_t DP, const uint8_t* const* rows, int64_t n8,
                           int64_t NCF, int64_t tail, float* p, NextTile* next, bool group_f32) {
  for (int64_t g = 0; g < G;) {
    const int gb = head_block<KIND>(G - g, group_f32);
    const float* qb = q + g * DP;
    float* pb = p + g * TILE;
    if (gb == 3)
      for (int64_t i = 0; i < n8; i += 4) score_rows<KIND, ISA, 3, 4>(qb, DP, rows + i, NCF, tail, pb + i, next);
    else if (gb == 2)
      for (int64_t i = 0; i < n8; i += 4) score_rows<KIND, ISA, 2, 4>(qb, DP, rows + i, NCF, tail, pb + i, next);
    else
      for (int64_t i = 0; i < n8; i += 8) score_rows<KIND, ISA, 1, 8>(qb, DP, rows + i, NCF, tail, pb + i, next);
    g += gb;
  }
}

// acc (the GB heads' DP floats) += the weights w (GB rows of TILE) times rows [0, n), chunk blocks of W
template <int KIND, int ISA, int GB, int W>
static AI void pv_heads(const float* w, const uint8_t* const* rows, int64_t n, int64_t NCF, int64_t tail, float* acc,
                        int64_t DP, NextTile* next) {
  int64_t c = 0;
  for (; c + W <= NCF; c += W) pv_rows<KIND, ISA, GB, W, false>(w, rows, n, c, 0, acc, DP, next);
  for (; c < NCF; ++c) pv_rows<KIND, ISA, GB, 1, false>(w, rows, n, c, 0, acc, DP, next);
  if (tail) pv_rows<KIND, ISA, GB, 1, true>(w, rows, n, NCF, tail, acc, DP, next);
}

template <int KIND, int ISA>
static AI void pv_tile(const float* w, int64_t G, int64_t DP, const uint8_t* const* rows, int64_t n, int64_t NCF,
                       int64_t tail, float* acc, NextTile* next, bool group_f32) {
  for (int64_t g = 0; g < G;) {
    const int gb = head_block<KIND>(G - g, group_f32);
    if (gb == 3) pv_heads<KIND, ISA, 3, 4>(w + g * TILE, rows, n, NCF, tail, acc + g * DP, DP, next);
    else if (gb == 2) pv_heads<KIND, ISA, 2, 4>(w + g * TILE, rows, n, NCF, tail, acc + g * DP, DP, next);
    else pv_heads<KIND, ISA, 1, 8>(w + g * TILE, rows, n, NCF, tail, acc + g * DP, DP, next);
    g += gb;
  }
}

// One tile of n <= TILE keys (rows of KIND, kr padded to a multiple of 8 with zero rows) for one KV head's G query
// heads: the G x n scores (times the rows' K scale when quantized), the online-softmax update of m, l and acc, and
// acc += p V (p times the rows' V scale when quantized). q, acc: G rows of DP; m, l: G; p: G rows of TILE.
template <int KIND, int ISA>
static AI void attend_tile(const uint8_t* const* kr, const uint8_t* const* vr, const float* ksc, const float* vsc,
                           int64_t n, int64_t G, int64_t D, const float* q, float* acc, float* m, float* l, float* p,
                           NextTile* next, bool group_f32) {
  constexpr bool SCALED = KIND == KV_INT8 || KIND == KV_FP8;
  const int64_t DP = (D + 7) / 8 * 8, NCF = D / 8, tail = D % 8, n8 = (n + 7) / 8 * 8;
  scores_tile<KIND, ISA>(q, G, DP, kr, n8, NCF, tail, p, next, group_f32);
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p + g * TILE;
    if constexpr (SCALED)
      for (int64_t i = 0; i < n8; i += 8) V8(pg + i) *= CV8(ksc + i);
    for (int64_t i = n; i < n8; ++i) pg[i] = -std::numeric_limits<float>::infinity();  // weight 0
    v8f mv = CV8(pg);
    for (int64_t i = 8; i < n8; i += 8) mv = mv > CV8(pg + i) ? mv : CV8(pg + i);
    float tile_max = mv[0];
    for (int c = 1; c < 8; ++c) tile_max = std::max(tile_max, mv[c]);
    const float m_new = std::max(m[g], tile_max);
    const float corr = exp_neg(m[g] - m_new);
    v8f sv = {};
    for (int64_t i = 0; i < n8; i += 8) {
      const v8f e = exp_neg8(CV8(pg + i) - m_new);
      sv += e;
      if constexpr (SCALED) V8(pg + i) = e * CV8(vsc + i);  // the weight of a V row of integers
      else V8(pg + i) = e;
    }
    const float sum = ((sv[0] + sv[4]) + (sv[1] + sv[5])) + ((sv[2] + sv[6]) + (sv[3] + sv[7]));
    l[g] = l[g] * corr + sum;
    m[g] = m_new;
    float* ag = acc + g * DP;
    if (corr != 1.0f)
      for (int64_t d = 0; d < DP; ++d) ag[d] *= corr;
  }
  pv_tile<KIND, ISA>(p, G, DP, vr, n, NCF, tail, acc, next, group_f32);
}

// Attention of sequence b's KV heads [h0, h0 + a.heads_per_task), each with its G query rows, over a pool of KIND.
// Per tile of TILE tokens: the rows' places in the pool (once for all heads), then per head attend_tile over the
// rows in place; the new token's K/V (fp32), when given, as a last tile of one key. work: q and acc G * DP per head,
// m and l G per head, a zero row DP, the weights G * TILE, the K and V scales of a tile TILE each.
template <int KIND, int ISA>
static AI void task_kind(const Args& a, int64_t b, int64_t h0, float* work) {
  constexpr int64_t ES = elem_size(KIND);
  const int64_t D = a.D, DP = (D + 7) / 8 * 8, G = a.H / a.KVH, NH = a.heads_per_task;
  float* qg = work;                 // (NH, G, DP)
  float* acc = qg + NH * G * DP;    // (NH, G, DP)
  float* ml = acc + NH * G * DP;    // m: (NH, G), l: (NH, G)
  float* zero = ml + 2 * NH * G;    // (DP)
  float* p = zero + DP;             // (G, TILE)
  float* ksc = p + G * TILE;        // (TILE)
  float* vsc = ksc + TILE;          // (TILE)
  std::fill(work, vsc + TILE, 0.0f);
  for (int64_t j = 0; j < NH * G; ++j) {
    const float* src = a.q + (b * a.H + h0 * G + j) * D;
    std::copy(src, src + D, qg + j * DP);
    ml[j] = -std::numeric_limits<float>::infinity();
  }
  if constexpr (KIND == KV_FP8) {  // one scale for the layer, times 2^8 (load8 gives 2^-8 times the value)
    std::fill(ksc, ksc + TILE, a.k_scale[0] * 256.0f);
    std::fill(vsc, vsc + TILE, a.v_scale[0] * 256.0f);
  }
  const uint8_t* zrow = reinterpret_cast<const uint8_t*>(zero);
  const int64_t n_cached = a.lens[b];
  const int32_t* table = a.tables + b * a.max_blocks;
  int64_t off[TILE], soff[TILE];
  const uint8_t* kr[TILE];
  const uint8_t* vr[TILE];
  NextTile next;
  next.even = a.even;
  const bool group_f32 = a.even && NH > 1;  // see head_block
  for (int64_t start = 0; start < n_cached; start += TILE) {
    const int64_t n = std::min(TILE, n_cached - start), n8 = (n + 7) / 8 * 8;
    int64_t logical = start / a.block_size, t = start % a.block_size;  // one division a tile
    for (int64_t i = 0; i < n; ++i) {  // where each row lives: walk the block table
      const int64_t blk = table[logical];
      off[i] = blk * a.s_kb + t * a.s_kt;
      soff[i] = blk * a.s_sb + t * a.s_st;
      if (++t == a.block_size) { t = 0; ++logical; }
    }
    // where the next tile's rows (this task's heads) live, for the prefetches spread through this tile (NextTile)
    next.rows = std::max<int64_t>(0, std::min(TILE, n_cached - start - TILE));
    next.row = next.line = 0;
    next.lines = 2 * ((NH * a.s_kh * ES + 63) / 64);
    next.total = next.rows * next.lines;
    next.credit = 0;
    for (int64_t i = 0, nl = logical, nt = t; i < next.rows; ++i) {
      const int64_t o = (table[nl] * a.s_kb + nt * a.s_kt + h0 * a.s_kh) * ES;
      next.k[i] = a.k + o;
      next.v[i] = a.v + o;
      if (++nt == a.block_size) { nt = 0; ++nl; }
    }
    for (int64_t i = n; i < n8; ++i) kr[i] = zrow;  // scored, never weighted
    for (int64_t hh = 0; hh < NH; ++hh) {
      const int64_t h = h0 + hh;
      for (int64_t i = 0; i < n; ++i) {
        kr[i] = a.k + (off[i] + h * a.s_kh) * ES;
        vr[i] = a.v + (off[i] + h * a.s_kh) * ES;
      }
      if constexpr (KIND == KV_INT8)
        for (int64_t i = 0; i < n; ++i) {
          ksc[i] = a.k_scale[soff[i] + h];
          vsc[i] = a.v_scale[soff[i] + h];
        }
      attend_tile<KIND, ISA>(kr, vr, ksc, vsc, n, G, D, qg + hh * G * DP, acc + hh * G * DP, ml + hh * G,
                        ml + NH * G + hh * G, p, &next, group_f32);
    }
    next.finish(n == TILE);
  }
  next.rows = 0;
  if (a.k_new) {  // the new token's K/V, the last key
    for (int64_t i = 1; i < 8; ++i) kr[i] = zrow;
    for (int64_t hh = 0; hh < NH; ++hh) {
      const int64_t h = h0 + hh;
      kr[0] = reinterpret_cast<const uint8_t*>(a.k_new + (b * a.KVH + h) * D);
      vr[0] = reinterpret_cast<const uint8_t*>(a.v_new + (b * a.KVH + h) * D);
      attend_tile<KV_F32, ISA>(kr, vr, nullptr, nullptr, 1, G, D, qg + hh * G * DP, acc + hh * G * DP, ml + hh * G,
                          ml + NH * G + hh * G, p, &next, false);
    }
  }
  for (int64_t j = 0; j < NH * G; ++j) {
    float* o = a.out + (b * a.H + h0 * G + j) * D;
    const float l = ml[NH * G + j];
    const float inv = l > 0 ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[j * DP + d] * inv;
  }
}

template <int ISA>
static AI void task_body(const Args& a, int64_t b, int64_t h0, float* work) {
  if (a.kind == KV_INT8) task_kind<KV_INT8, ISA>(a, b, h0, work);
  else if (a.kind == KV_FP8) task_kind<KV_FP8, ISA>(a, b, h0, work);
  else if (a.kind == KV_BF16) task_kind<KV_BF16, ISA>(a, b, h0, work);
  else task_kind<KV_F32, ISA>(a, b, h0, work);
}

__attribute__((noinline, target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))) void task_avx512(const Args& a, int64_t b,
                                                                                   int64_t h, float* work) {
  task_body<ISA_AVX512>(a, b, h, work);
}

__attribute__((noinline, target("avx2,fma,f16c"))) void task_avx2(const Args& a, int64_t b, int64_t h, float* work) {
  task_body<ISA_AVX2>(a, b, h, work);
}

__attribute__((noinline)) void task_default(const Args& a, int64_t b, int64_t h, float* work) {
  task_body<ISA_DEFAULT>(a, b, h, work);
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& cached_lens,
                        const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                        const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new, double scale,
                        int64_t kind, int64_t isa, int64_t schedule) {
  TORCH_CHECK(isa_supported(isa, /*need_f16c=*/true), "paged_decode: ISA ", isa, " is not supported by this CPU");
  TORCH_CHECK(schedule == 0 || schedule == 1, "paged_decode: schedule ", schedule, " is not 0 or 1 (SCHEDULES)");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode: q (B, H, D), caches (blocks, bs, KVH, D)");
  TORCH_CHECK(k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1, "paged_decode: cache strides");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "paged_decode: tables");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0 && H / KVH <= 64 && k_cache.size(3) == D, "paged_decode: head shapes");
  at::Tensor qf = (q.to(at::kFloat) * scale).contiguous();
  at::Tensor lens = cached_lens.to(at::kLong).contiguous();
  at::Tensor out = at::empty({B, H, D}, q.options().dtype(at::kFloat));
  at::Tensor kn, vn, ks, vs;
  Args a{};
  a.q = qf.data_ptr<float>();
  a.k = static_cast<const uint8_t*>(k_cache.data_ptr());
  a.v = static_cast<const uint8_t*>(v_cache.data_ptr());
  if (kind == KV_INT8 || kind == KV_FP8) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "paged_decode: a quantized pool needs its scales");
    ks = k_scale->contiguous();
    vs = v_scale->contiguous();
    a.k_scale = ks.data_ptr<float>();
    a.v_scale = vs.data_ptr<float>();
    if (kind == KV_INT8) {
      a.s_sb = ks.stride(0);
      a.s_st = ks.stride(1);
    }
  }
  if (k_new.has_value()) {
    kn = k_new->to(at::kFloat).contiguous();
    vn = v_new->to(at::kFloat).contiguous();
    a.k_new = kn.data_ptr<float>();
    a.v_new = vn.data_ptr<float>();
  }
  a.tables = block_tables.data_ptr<int32_t>();
  a.lens = lens.data_ptr<int64_t>();
  a.out = out.data_ptr<float>();
  a.kind = kind;
  a.even = schedule == 1;
  a.H = H;
  a.KVH = KVH;
  a.D = D;
  a.block_size = k_cache.size(1);
  a.max_blocks = block_tables.size(1);
  a.s_kb = k_cache.stride(0);
  a.s_kt = k_cache.stride(1);
  a.s_kh = k_cache.stride(2);
  // a task per sequence (all its KV heads, which lie side by side in the pool) when there are enough sequences
  // to keep every thread busy, else a task per (sequence, KV head)
  a.heads_per_task = B >= 4 * at::get_num_threads() ? KVH : 1;
  const int64_t NH = a.heads_per_task, tasks_per_seq = KVH / NH;
  const int64_t G = H / KVH, DP = (D + 7) / 8 * 8;
  const int64_t work_floats = 2 * NH * G * DP + 2 * NH * G + DP + G * TILE + 2 * TILE;
  at::parallel_for(0, B * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(work_floats);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / tasks_per_seq, h0 = (i % tasks_per_seq) * NH;
      if (isa == ISA_AVX512) task_avx512(a, b, h0, work.data());
      else if (isa == ISA_AVX2) task_avx2(a, b, h0, work.data());
      else task_default(a, b, h0, work.data());
    }
  });
  return out.to(q.scalar_type());
}


// ---- prompt attention: a whole prompt's queries against its own keys, causal (the step's K/V as written) --------
// A chunk of a ragged step that is its sequence's whole context (a fresh prompt) attends to the step's K/V, which
// the model has just computed (rows of its QKV projection, a per-token stride apart). Its work is a product, not a
// stream: each key serves every later query. So a task takes a block of query positions of one KV head (the group's
// query heads of each position: ~32 query rows, GQA without expanding K/V) and walks the keys up to its last position
// in tiles of KT = NV x W keys (W the vector width: 16 floats on AVX-512, 8 on AVX2 and the baseline; NV vectors of
// scores a row between two softmax updates: 2 on AVX-512, 1 elsewhere). K is transposed once per call into (tile, KV
// head, D, KT) so that a tile's scores are NV vectors per query row, accumulated over D with the query's value
// broadcast (8 rows at once: a register-blocked product, each K vector loaded once for 8 rows); the
// causal mask on the diagonal tile, an online softmax per row, then o += p V with 2 rows x 4 vectors of accumulators,
// V read where the step holds it (or padded when D is not a multiple of W). Tasks go out one at a time, the most
// expensive (the last positions) first.

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));

constexpr int64_t PROWS = 32;  // query rows (positions x the group's heads) a task scores against each tile
constexpr int64_t PKT_AVX512 = 32;  // keys a tile on AVX-512: 2 vectors of 16 scores a row
constexpr int64_t PKT_NARROW = 8;   // on AVX2 and the baseline: 1 vector of 8

// a vector's worth of floats at p, at any alignment (a template argument drops a typedef's aligned(4): the plain
// dereference of a VF* would compile to an aligned load)
template <typename VF>
static AI VF loadv(const float* p) {
  VF x;
  std::memcpy(&x, p, sizeof(VF));
  return x;
}

template <typename VF>
static AI void storev(float* p, VF x) {
  std::memcpy(p, &x, sizeof(VF));
}

// the lanes of a vector reduced by halving (W = 16 or 8): its two halves combined (the larger, or the sum), down to
// 4 lanes, then those 4
typedef float v4f __attribute__((vector_size(16), aligned(4)));

template <typename VF, int W, bool MAX>
static AI v4f fold(VF x) {
  if constexpr (W == 4) {
    return x;
  } else {
    typedef float vh __attribute__((vector_size(W * 2)));
    vh lo, hi;
    std::memcpy(&lo, &x, W * 2);
    std::memcpy(&hi, reinterpret_cast<const char*>(&x) + W * 2, W * 2);
    if constexpr (MAX) return fold<vh, W / 2, MAX>(lo > hi ? lo : hi);
    else return fold<vh, W / 2, MAX>(lo + hi);
  }
}

template <typename VF, int W>
static AI float lanes_max(VF x) {
  const v4f c = fold<VF, W, true>(x);
  return std::max(std::max(c[0], c[1]), std::max(c[2], c[3]));
}

template <typename VF, int W>
static AI float lanes_sum(VF x) {
  const v4f c = fold<VF, W, false>(x);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

struct PromptArgs {
  const float* q;  // (T, H, D), already scaled, contiguous
  const float* k;  // (T, KVH, D) rows sk apart
  const float* v;  // (T, KVH, D) rows sv apart
  float* out;      // (T, H, D) rows so apart
  const float* kt;  // K transposed per tile: (tiles, KVH, D, W), zeros past a prompt's end
  const int64_t* starts;  // each prompt's first row in T
  const int64_t* lens;
  const int64_t* tile0;  // each prompt's first tile in kt
  int64_t H, KVH, D, G, QB;
  int64_t sq, sk, sv, so;
};

// one task: prompt c, KV head h, query positions [p0, p0 + QB). A tile holds KT = NV * W keys (NV vectors of scores
// a row between two online-softmax updates). work: q and o (R8 x DP), a V tile (KT x DP), scores (R8 x KT), m and l
// (R8); DP is D rounded up to a multiple of 16
template <typename VF, typename VI, int W, int NV>
static AI void prompt_task(const PromptArgs& a, int64_t c, int64_t h, int64_t p0, float* work) {
  constexpr int64_t KT = NV * W;
  const int64_t D = a.D, DP = (D + 15) / 16 * 16, G = a.G, L = a.lens[c], s0 = a.starts[c];
  const int64_t np = std::min(a.QB, L - p0), R = np * G, R8 = (R + 7) / 8 * 8;
  float* qs = work;
  float* o = qs + R8 * DP;
  float* vt = o + R8 * DP;
  float* s = vt + KT * DP;
  float* m = s + R8 * KT;
  float* l = m + R8;
  std::fill(qs, qs + 2 * R8 * DP, 0.0f);
  for (int64_t i = 0; i < np; ++i)
    for (int64_t g = 0; g < G; ++g)
      std::memcpy(qs + (i * G + g) * DP, a.q + (s0 + p0 + i) * a.sq + (h * G + g) * D, D * 4);
  std::fill(m, m + R8, -std::numeric_limits<float>::infinity());
  std::fill(l, l + R8, 0.0f);
  const int64_t kend = p0 + np;  // the keys the block's last position reads
  const int64_t DV = (D + W - 1) / W * W;  // the values a V row is read in
  for (int64_t j0 = 0; j0 < kend; j0 += KT) {
    const int64_t n = std::min<int64_t>(KT, kend - j0);
    const float* ktile = a.kt + ((a.tile0[c] + j0 / KT) * a.KVH + h) * D * KT;
    const float* vrows = a.v + (s0 + j0) * a.sv + h * D;
    int64_t vstride = a.sv;
    if (D % W) {  // a padded copy, so that a row is whole vectors
      for (int64_t jj = 0; jj < n; ++jj) {
        std::memcpy(vt + jj * DP, vrows + jj * a.sv, D * 4);
        std::fill(vt + jj * DP + D, vt + jj * DP + DP, 0.0f);
      }
      vrows = vt;
      vstride = DP;
    }
    for (int64_t r = 0; r < R8; r += 8) {  // scores, 8 rows x NV vectors at once
      VF acc[8][NV] = {};
      const float* q0 = qs + r * DP;
      for (int64_t d = 0; d < D; ++d) {
        VF kv[NV];
#pragma GCC unroll 2
        for (int u = 0; u < NV; ++u) kv[u] = loadv<VF>(ktile + d * KT + u * W);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const float qv = q0[i * DP + d];
#pragma GCC unroll 2
          for (int u = 0; u < NV; ++u) acc[i][u] += qv * kv[u];
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
#pragma GCC unroll 2
        for (int u = 0; u < NV; ++u) storev<VF>(s + (r + i) * KT + u * W, acc[i][u]);
    }
    for (int64_t r = 0; r < R; ++r) {  // the causal mask, then the online softmax
      const int64_t allowed = std::min(n, p0 + r / G - j0 + 1);  // keys j0 .. the row's position
      float* sr = s + r * KT;
      if (allowed <= 0) {  // the tile lies past this row's position: weight 0
        std::fill(sr, sr + KT, 0.0f);
        continue;
      }
      for (int64_t jj = allowed; jj < KT; ++jj) sr[jj] = -std::numeric_limits<float>::infinity();
      VF x[NV];
      VF mx = loadv<VF>(sr);
      x[0] = mx;
      for (int u = 1; u < NV; ++u) {
        x[u] = loadv<VF>(sr + u * W);
        mx = mx > x[u] ? mx : x[u];
      }
      const float m_new = std::max(m[r], lanes_max<VF, W>(mx));
      VF sum = {};
      for (int u = 0; u < NV; ++u) {
        const VF e = exp_neg_lanes<VF, VI>(x[u] - m_new);
        sum += e;
        storev<VF>(sr + u * W, e);
      }
      const float corr = m[r] == -std::numeric_limits<float>::infinity() ? 0.0f : exp_neg(m[r] - m_new);
      l[r] = l[r] * corr + lanes_sum<VF, W>(sum);
      m[r] = m_new;
      if (corr != 1.0f)
        for (int64_t d = 0; d < DV; d += W) storev<VF>(o + r * DP + d, loadv<VF>(o + r * DP + d) * corr);
    }
    for (int64_t r = R; r < R8; ++r) std::fill(s + r * KT, s + r * KT + KT, 0.0f);
    for (int64_t r = 0; r < R; r += 4) {  // o += p V: 4 rows x up to 4 vectors at a time (rows past R: weight 0)
      for (int64_t c0 = 0; c0 < DV; c0 += 4 * W) {
        const int64_t nv = std::min<int64_t>(4, (DV - c0) / W);
        VF acc[4][4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) acc[i][j] = j < nv ? loadv<VF>(o + (r + i) * DP + c0 + W * j) : VF{};
        const float* p0r = s + r * KT;
        for (int64_t jj = 0; jj < n; ++jj) {
          const float* vr = vrows + jj * vstride + c0;
          const float w0 = p0r[jj], w1 = p0r[KT + jj], w2 = p0r[2 * KT + jj], w3 = p0r[3 * KT + jj];
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j)
            if (j < nv) {
              const VF vv = loadv<VF>(vr + W * j);
              acc[0][j] += w0 * vv;
              acc[1][j] += w1 * vv;
              acc[2][j] += w2 * vv;
              acc[3][j] += w3 * vv;
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < nv; ++j) storev<VF>(o + (r + i) * DP + c0 + W * j, acc[i][j]);
      }
    }
  }
  for (int64_t i = 0; i < np; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const float inv = 1.0f / l[r];  // the row's own key is always allowed: l > 0
      float* dst = a.out + (s0 + p0 + i) * a.so + (h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = o[r * DP + d] * inv;
    }
}

__attribute__((noinline, target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))) void prompt_avx512(
    const PromptArgs& a, int64_t c, int64_t h, int64_t p0, float* work) {
  prompt_task<v16f, v16i, 16, PKT_AVX512 / 16>(a, c, h, p0, work);
}

__attribute__((noinline, target("avx2,fma,f16c"))) void prompt_avx2(const PromptArgs& a, int64_t c, int64_t h,
                                                                    int64_t p0, float* work) {
  prompt_task<v8f, v8i, 8, PKT_NARROW / 8>(a, c, h, p0, work);
}

__attribute__((noinline)) void prompt_default(const PromptArgs& a, int64_t c, int64_t h, int64_t p0, float* work) {
  prompt_task<v8f, v8i, 8, PKT_NARROW / 8>(a, c, h, p0, work);
}

void prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor out,
                      at::IntArrayRef starts, at::IntArrayRef lens, double scale, int64_t isa) {
  TORCH_CHECK(isa_supported(isa, /*need_f16c=*/true), "prompt_attention: ISA ", isa, " is not supported by this CPU");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "prompt_attention: q, k, v, out 3-D");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v, &out})  // q: scaled into a copy
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "prompt_attention: fp32 rows of (heads, D) contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "prompt_attention: fp32 q");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), C = starts.size();
  TORCH_CHECK(H % KVH == 0 && k.size(2) == D && v.sizes() == k.sizes() && out.sizes() == q.sizes() &&
              k.size(0) == T && lens.size() == starts.size(), "prompt_attention: shapes");
  const int64_t KT = isa == ISA_AVX512 ? PKT_AVX512 : PKT_NARROW;  // keys a tile, as prompt_task's
  std::vector<int64_t> tile0(C + 1, 0);
  for (int64_t c = 0; c < C; ++c) {
    TORCH_CHECK(lens[c] > 0 && starts[c] >= 0 && starts[c] + lens[c] <= T, "prompt_attention: prompt ", c);
    tile0[c + 1] = tile0[c] + (lens[c] + KT - 1) / KT;
  }
  at::Tensor qs = q * scale;  // contiguous
  at::Tensor ktb = at::zeros({tile0[C], KVH, D, KT}, q.options());
  PromptArgs a{};
  a.q = qs.data_ptr<float>();
  a.k = k.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.out = out.data_ptr<float>();
  a.kt = ktb.data_ptr<float>();
  a.starts = starts.data();
  a.lens = lens.data();
  a.tile0 = tile0.data();
  a.H = H;
  a.KVH = KVH;
  a.D = D;
  a.G = H / KVH;
  a.QB = std::max<int64_t>(1, PROWS / a.G);
  a.sq = qs.stride(0);
  a.sk = k.stride(0);
  a.sv = v.stride(0);
  a.so = out.stride(0);
  float* kt = ktb.data_ptr<float>();
  at::parallel_for(0, tile0[C] * KVH, 16, [&](int64_t begin, int64_t end) {  // K transposed, tile by tile
    for (int64_t t = begin; t < end; ++t) {
      const int64_t tile = t / KVH, h = t % KVH;
      const int64_t c = std::upper_bound(tile0.begin(), tile0.end(), tile) - tile0.begin() - 1;
      const int64_t j0 = (tile - tile0[c]) * KT, n = std::min(KT, lens[c] - j0);
      float* dst = kt + t * D * KT;
      for (int64_t jj = 0; jj < n; ++jj) {
        const float* kr = a.k + (starts[c] + j0 + jj) * a.sk + h * D;
        for (int64_t d = 0; d < D; ++d) dst[d * KT + jj] = kr[d];
      }
    }
  });
  std::vector<int64_t> block_c, block_p;  // (prompt, first position) of every block of QB positions
  for (int64_t c = 0; c < C; ++c)
    for (int64_t p0 = 0; p0 < lens[c]; p0 += a.QB) {
      block_c.push_back(c);
      block_p.push_back(p0);
    }
  const int64_t tasks = static_cast<int64_t>(block_c.size()) * KVH;
  const int64_t DP = (D + 15) / 16 * 16, R8 = (a.QB * a.G + 7) / 8 * 8;
  const int64_t work_floats = 2 * R8 * DP + KT * DP + R8 * KT + 2 * R8;
  // a block's cost grows with its position (causal): tasks are handed out one at a time, the last blocks first
  // (at::parallel_for would give each thread one contiguous range: one thread the cheap half, the other the dear one)
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> work(work_floats);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = tasks - 1; t >= 0; --t) {
      const int64_t b = t / KVH, h = t % KVH;
      if (isa == ISA_AVX512) prompt_avx512(a, block_c[b], h, block_p[b], work.data());
      else if (isa == ISA_AVX2) prompt_avx2(a, block_c[b], h, block_p[b], work.data());
      else prompt_default(a, block_c[b], h, block_p[b], work.data());
    }
  }
}

bool cpu_supports(int64_t isa) { return isa_supported(isa, /*need_f16c=*/true); }

}  // namespace

TORCH_LIBRARY(workbench_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cached_lens, "
      "Tensor? k_scale, Tensor? v_scale, Tensor? k_new, Tensor? v_new, float scale, int kind, int isa, int schedule) "
      "-> Tensor");
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int[] starts, int[] lens, float scale, "
        "int isa) -> ()");
  m.def("cpu_supports(int isa) -> bool", &cpu_supports);
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("prompt_attention", &prompt_attention);
}
