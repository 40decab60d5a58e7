// Paged decode attention on the CPU: one query token per sequence against its blocks, read where the pool holds
// them (kernels/paged_decode_cpu.py builds this file and documents the op).
//
// One task per sequence (all its KV heads, side by side in the pool) when the batch keeps every thread busy, else per
// (sequence, KV head); tasks are spread over torch's OpenMP threads. The context is walked block table by block
// table in tiles of at most TILE tokens; each tile's rows are found once, then per KV head read in place (fp32 of a
// width of 8s) or dequantized into a small fp32 buffer (int8: one scale per token and head; fp8 e4m3: one scale for
// the layer, by bits; bf16: a shift), the group's query heads (GQA/MQA: num_heads / num_kv_heads rows) scored against
// them 8 rows at a time (8 accumulators over head_dim, summed by a pairwise-add tree), the scores folded into an
// online softmax (running max, sum, exp on 8 lanes) and acc += p V with up to 8 chunks of the row in registers. The
// new token's K/V, when given, are the last key. Nothing of the pool is copied.
//
// The same body is compiled three times, for AVX-512, AVX2+FMA and the baseline x86-64 (GCC's target attribute);
// the caller picks one per call (``isa``), and the Python side only offers what the CPU supports.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t TILE = 32;  // tokens scored together before one online-softmax update

enum KvKind : int64_t { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8 = 3 };
enum Isa : int64_t { ISA_DEFAULT = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };


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
};

// 8 floats: GCC's vector extension, lowered to one ymm register under AVX2/AVX-512, two xmm ones on the baseline
typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define V8(PTR) (*reinterpret_cast<v8f*>(PTR))
#define CV8(PTR) (*reinterpret_cast<const v8f*>(PTR))
#define AI inline __attribute__((always_inline))

// exp_neg on 8 lanes: n by the round-to-nearest of adding 1.5 * 2^23 (|x log2 e| <= 126 here), 2^n from the bits
static AI v8f exp_neg8(v8f x) {
  const v8f lowest = v8f{} - 87.0f;
  x = x < lowest ? lowest : x;
  const v8f magic = v8f{} + 12582912.0f;
  const v8f n = (x * 1.44269504088896341f + magic) - magic;
  const v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f two_n;
  std::memcpy(&two_n, &bits, 32);
  return p * two_n;
}

// one cached row of K or V as D fp32 values (the padding to DP stays zero); OFF its offset in the pool (elements),
// SOFF its int8 scale's
static AI void load_row(int64_t kind, const uint8_t* pool, const float* scale, int64_t off, int64_t soff, int64_t D,
                        float* __restrict dst) {
  if (kind == KV_BF16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(pool) + off;
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t bits = uint32_t(src[d]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      dst[d] = f;
    }
  } else if (kind == KV_INT8) {
    const int8_t* src = reinterpret_cast<const int8_t*>(pool) + off;
    const float sc = scale[soff];
    for (int64_t d = 0; d < D; ++d) dst[d] = float(src[d]) * sc;
  } else if (kind == KV_FP8) {
    // e4m3fn by bits: the 7 magnitude bits placed under fp32's exponent and mantissa give 2^-120 times the value
    // (normals and subnormals alike, no table), the sign bit moves to bit 31; 0x7f/0xff (NaN) are never written
    const uint8_t* src = pool + off;
    const float sc = scale[0] * 0x1p120f;
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t x = src[d];
      const uint32_t bits = ((x & 0x80u) << 24) | ((x & 0x7fu) << 20);
      float f;
      std::memcpy(&f, &bits, 4);
      dst[d] = f * sc;
    }
  } else {
    const float* src = reinterpret_cast<const float*>(pool) + off;
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d];
  }
}

// 8 dot products of q (NC chunks of 8) with 8 rows, each in its own accumulator, summed across lanes by a tree of
// pairwise adds (the AVX hadd transpose): one vector of 8 scores
static AI void scores8(const float* q, const float* const* r, int64_t NC, float* out) {
  v8f a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
  for (int64_t c = 0; c < NC; ++c) {
    const v8f qv = CV8(q + 8 * c);
    a0 += qv * CV8(r[0] + 8 * c);
    a1 += qv * CV8(r[1] + 8 * c);
    a2 += qv * CV8(r[2] + 8 * c);
    a3 += qv * CV8(r[3] + 8 * c);
    a4 += qv * CV8(r[4] + 8 * c);
    a5 += qv * CV8(r[5] + 8 * c);
    a6 += qv * CV8(r[6] + 8 * c);
    a7 += qv * CV8(r[7] + 8 * c);
  }
  const v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
  const v8i lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
  const v8f h01 = __builtin_shuffle(a0, a1, even) + __builtin_shuffle(a0, a1, odd);
  const v8f h23 = __builtin_shuffle(a2, a3, even) + __builtin_shuffle(a2, a3, odd);
  const v8f h45 = __builtin_shuffle(a4, a5, even) + __builtin_shuffle(a4, a5, odd);
  const v8f h67 = __builtin_shuffle(a6, a7, even) + __builtin_shuffle(a6, a7, odd);
  const v8f h0123 = __builtin_shuffle(h01, h23, even) + __builtin_shuffle(h01, h23, odd);
  const v8f h4567 = __builtin_shuffle(h45, h67, even) + __builtin_shuffle(h45, h67, odd);
  V8(out) = __builtin_shuffle(h0123, h4567, lo) + __builtin_shuffle(h0123, h4567, hi);
}

// acc (NC chunks of 8) += sum_i p[i] * row_i, W chunks of acc held in registers across the rows
template <int W>
static AI void pv_chunks(const float* p, const float* const* r, int64_t n, int64_t c0, float* acc) {
  v8f a[W];
#pragma GCC unroll 8
  for (int j = 0; j < W; ++j) a[j] = CV8(acc + 8 * (c0 + j));
  for (int64_t i = 0; i < n; ++i) {
    const float w = p[i];
    const float* row = r[i] + 8 * c0;
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) a[j] += w * CV8(row + 8 * j);
  }
#pragma GCC unroll 8
  for (int j = 0; j < W; ++j) V8(acc + 8 * (c0 + j)) = a[j];
}

static AI void pv(const float* p, const float* const* r, int64_t n, int64_t NC, float* acc) {
  int64_t c = 0;
  for (; c + 8 <= NC; c += 8) pv_chunks<8>(p, r, n, c, acc);
  for (; c + 4 <= NC; c += 4) pv_chunks<4>(p, r, n, c, acc);
  for (; c < NC; ++c) pv_chunks<1>(p, r, n, c, acc);
}

// Attention of sequence b's KV heads [h0, h0 + a.heads_per_task), each with its G query rows. Per tile of TILE
// tokens: the rows' places in the pool (once for all heads), then per head its K rows (read in place when they are
// fp32 of a width of 8s, else dequantized into a padded buffer), the G x tile scores 8 rows at a time, the
// online-softmax update, and acc += p V. work: q and acc G * DP per head, m and l G per head, two row buffers
// TILE * DP, a zero row DP, the weights G * TILE.
static AI void task_body(const Args& a, int64_t b, int64_t h0, float* work) {
  const int64_t D = a.D, DP = (D + 7) / 8 * 8, NC = DP / 8, G = a.H / a.KVH, NH = a.heads_per_task;
  float* qg = work;                 // (NH, G, DP)
  float* acc = qg + NH * G * DP;    // (NH, G, DP)
  float* ml = acc + NH * G * DP;    // m: (NH, G), l: (NH, G)
  float* kbuf = ml + 2 * NH * G;    // (TILE, DP)
  float* vbuf = kbuf + TILE * DP;   // (TILE, DP)
  float* zero = vbuf + TILE * DP;   // (DP)
  float* p = zero + DP;             // (G, TILE)
  std::fill(work, p, 0.0f);
  for (int64_t j = 0; j < NH * G; ++j) {
    const float* src = a.q + (b * a.H + h0 * G + j) * D;
    std::copy(src, src + D, qg + j * DP);
    ml[j] = -std::numeric_limits<float>::infinity();
  }
  const bool direct = a.kind == KV_F32 && D == DP;  // fp32 rows of whole chunks: no copy
  const int64_t n_cached = a.lens[b];
  const int64_t total = n_cached + (a.k_new ? 1 : 0);
  const int32_t* table = a.tables + b * a.max_blocks;
  int64_t off[TILE], soff[TILE];
  const float* kr[TILE];
  const float* vr[TILE];
  for (int64_t start = 0; start < total; start += TILE) {
    const int64_t n = std::min(TILE, total - start), n8 = (n + 7) / 8 * 8;
    const int64_t n_pool = std::max<int64_t>(0, std::min(n, n_cached - start));  // the rest: the new key
    int64_t logical = start / a.block_size, t = start % a.block_size;  // one division a tile
    for (int64_t i = 0; i < n_pool; ++i) {  // where each row lives: walk the block table
      const int64_t blk = table[logical];
      off[i] = blk * a.s_kb + t * a.s_kt;
      soff[i] = blk * a.s_sb + t * a.s_st;
      if (++t == a.block_size) { t = 0; ++logical; }
    }
    for (int64_t hh = 0; hh < NH; ++hh) {
      const int64_t h = h0 + hh;
      for (int64_t i = 0; i < n_pool; ++i) {
        if (direct) {
          kr[i] = reinterpret_cast<const float*>(a.k) + off[i] + h * a.s_kh;
          vr[i] = reinterpret_cast<const float*>(a.v) + off[i] + h * a.s_kh;
        } else {
          load_row(a.kind, a.k, a.k_scale, off[i] + h * a.s_kh, soff[i] + h, D, kbuf + i * DP);
          load_row(a.kind, a.v, a.v_scale, off[i] + h * a.s_kh, soff[i] + h, D, vbuf + i * DP);
          kr[i] = kbuf + i * DP;
          vr[i] = vbuf + i * DP;
        }
      }
      if (n_pool < n) {  // the new token's K/V, the last key
        const float* ks = a.k_new + (b * a.KVH + h) * D;
        const float* vs = a.v_new + (b * a.KVH + h) * D;
        if (D == DP) {
          kr[n_pool] = ks;
          vr[n_pool] = vs;
        } else {
          std::copy(ks, ks + D, kbuf + n_pool * DP);
          std::copy(vs, vs + D, vbuf + n_pool * DP);
          kr[n_pool] = kbuf + n_pool * DP;
          vr[n_pool] = vbuf + n_pool * DP;
        }
      }
      for (int64_t i = n; i < n8; ++i) kr[i] = zero;  // scored, never weighted
      for (int64_t g = 0; g < G; ++g) {  // scores, then the online-softmax update
        const int64_t j = hh * G + g;
        float* pg = p + g * TILE;
        for (int64_t i = 0; i < n; i += 8) scores8(qg + j * DP, kr + i, NC, pg + i);
        for (int64_t i = n; i < n8; ++i) pg[i] = -std::numeric_limits<float>::infinity();  // weight 0
        v8f mv = CV8(pg);
        for (int64_t i = 8; i < n8; i += 8) mv = mv > CV8(pg + i) ? mv : CV8(pg + i);
        float tile_max = mv[0];
        for (int c = 1; c < 8; ++c) tile_max = std::max(tile_max, mv[c]);
        float& m = ml[j];
        float& l = ml[NH * G + j];
        const float m_new = std::max(m, tile_max);
        const float corr = exp_neg(m - m_new);
        v8f sv = {};
        for (int64_t i = 0; i < n8; i += 8) {
          const v8f e = exp_neg8(CV8(pg + i) - m_new);
          V8(pg + i) = e;
          sv += e;
        }
        const float sum = ((sv[0] + sv[4]) + (sv[1] + sv[5])) + ((sv[2] + sv[6]) + (sv[3] + sv[7]));
        l = l * corr + sum;
        m = m_new;
        float* ag = acc + j * DP;
        if (corr != 1.0f)
          for (int64_t d = 0; d < DP; ++d) ag[d] *= corr;
        pv(pg, vr, n, NC, ag);
      }
    }
  }
  for (int64_t j = 0; j < NH * G; ++j) {
    float* o = a.out + (b * a.H + h0 * G + j) * D;
    const float l = ml[NH * G + j];
    const float inv = l > 0 ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[j * DP + d] * inv;
  }
}

__attribute__((noinline, target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void task_avx512(const Args& a, int64_t b,
                                                                                   int64_t h, float* work) {
  task_body(a, b, h, work);
}

__attribute__((noinline, target("avx2,fma"))) void task_avx2(const Args& a, int64_t b, int64_t h, float* work) {
  task_body(a, b, h, work);
}

__attribute__((noinline)) void task_default(const Args& a, int64_t b, int64_t h, float* work) {
  task_body(a, b, h, work);
}

bool isa_supported(int64_t isa) {
  __builtin_cpu_init();
  if (isa == ISA_AVX512) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return true;
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& cached_lens,
                        const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                        const c10::optional<at::Tensor>& k_new, const c10::optional<at::Tensor>& v_new, double scale,
                        int64_t kind, int64_t isa) {
  TORCH_CHECK(isa_supported(isa), "paged_decode: ISA ", isa, " is not supported by this CPU");
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
  const int64_t work_floats = 2 * NH * G * DP + 2 * NH * G + 2 * TILE * DP + DP + G * TILE;
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

bool cpu_supports(int64_t isa) { return isa_supported(isa); }

}  // namespace

TORCH_LIBRARY(workbench_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cached_lens, "
      "Tensor? k_scale, Tensor? v_scale, Tensor? k_new, Tensor? v_new, float scale, int kind, int isa) -> Tensor");
  m.def("cpu_supports(int isa) -> bool", &cpu_supports);
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
