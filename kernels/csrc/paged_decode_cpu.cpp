// Paged decode attention on the CPU: one query token per sequence against its blocks, read where the pool holds
// them (kernels/paged_decode_cpu.py builds this file and documents the op).
//
// One task per (sequence, KV head): the group's query heads (GQA/MQA: num_heads / num_kv_heads rows) share every
// K/V row it loads. The context is walked block table by block table in tiles of at most TILE tokens; each tile's
// rows are dequantized into a small fp32 buffer (int8: one scale per token and head; fp8 e4m3: one scale for the
// layer; bf16: a shift), scored, and folded into an online softmax (running max, sum, fp32 accumulator). The new
// token's K/V, when given, are the last key. Nothing of the pool is copied.
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

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {  // float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf
      int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
      float x;
      if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
      else if (e == 0) x = std::ldexp(m / 8.0f, -6);
      else x = std::ldexp(1.0f + m / 8.0f, e - 7);
      v[b] = s ? -x : x;
    }
  }
};
const Fp8Table FP8;

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
  int64_t kind, H, KVH, D, block_size, max_blocks, elem;
  int64_t s_kb, s_kt, s_kh;  // pool strides in elements (block, token, head); the head dim is contiguous
  int64_t s_sb, s_st;        // int8 scale strides (block, token); the head is contiguous
};

// one cached row of K or V as fp32: OFF its offset in the pool (elements), SOFF its int8 scale's
#define LOAD_ROW(POOL, SCALE, OFF, SOFF, DST)                                                  \
  do {                                                                                         \
    if (a.kind == KV_F32) {                                                                    \
      const float* src = reinterpret_cast<const float*>(POOL) + OFF;                           \
      for (int64_t d = 0; d < D; ++d) DST[d] = src[d];                                         \
    } else if (a.kind == KV_BF16) {                                                            \
      const uint16_t* src = reinterpret_cast<const uint16_t*>(POOL) + OFF;                     \
      for (int64_t d = 0; d < D; ++d) {                                                        \
        uint32_t bits = uint32_t(src[d]) << 16;                                                \
        float f;                                                                               \
        std::memcpy(&f, &bits, 4);                                                             \
        DST[d] = f;                                                                            \
      }                                                                                        \
    } else if (a.kind == KV_INT8) {                                                            \
      const int8_t* src = reinterpret_cast<const int8_t*>(POOL) + OFF;                         \
      const float sc = SCALE[SOFF];                                                            \
      for (int64_t d = 0; d < D; ++d) DST[d] = float(src[d]) * sc;                             \
    } else {                                                                                   \
      const uint8_t* src = reinterpret_cast<const uint8_t*>(POOL) + OFF;                       \
      const float sc = SCALE[0];                                                               \
      for (int64_t d = 0; d < D; ++d) DST[d] = FP8.v[src[d]] * sc;                             \
    }                                                                                          \
  } while (0)


// 8 floats: GCC's vector extension, lowered to one ymm register under AVX2/AVX-512, two xmm ones on the baseline
typedef float v8f __attribute__((vector_size(32), aligned(4)));
#define V8(PTR) (*reinterpret_cast<v8f*>(PTR))
#define CV8(PTR) (*reinterpret_cast<const v8f*>(PTR))

// Attention of the G query rows of (sequence b, KV head h). Rows are padded with zeros to DP (a multiple of 8)
// floats; work holds q: G * DP, acc: G * DP, the tile's rows: TILE * DP, its weights p: G * TILE.
#define TASK_BODY                                                                               \
  const int64_t D = a.D, DP = (D + 7) / 8 * 8, NC = DP / 8, G = a.H / a.KVH;                   \
  float* qg = work;                                                                            \
  float* acc = qg + G * DP;                                                                    \
  float* kbuf = acc + G * DP;                                                                  \
  float* p = kbuf + TILE * DP;                                                                 \
  std::fill(work, p, 0.0f);                                                                    \
  for (int64_t g = 0; g < G; ++g)                                                              \
    for (int64_t d = 0; d < D; ++d) qg[g * DP + d] = a.q[(b * a.H + h * G + g) * D + d];       \
  float m[64], l[64];                                                                          \
  int64_t off[TILE], soff[TILE];                                                               \
  for (int64_t g = 0; g < G; ++g) { m[g] = -std::numeric_limits<float>::infinity(); l[g] = 0; } \
  const int64_t n_cached = a.lens[b];                                                          \
  const int64_t total = n_cached + (a.k_new ? 1 : 0);                                          \
  const int32_t* table = a.tables + b * a.max_blocks;                                          \
  for (int64_t start = 0; start < total; start += TILE) {                                      \
    const int64_t n = std::min(TILE, total - start);                                           \
    const int64_t n_pool = std::max<int64_t>(0, std::min(n, n_cached - start)); /* rest: new */\
    int64_t logical = start / a.block_size, t = start % a.block_size; /* one division a tile */\
    for (int64_t i = 0; i < n_pool; ++i) { /* where each row lives: walk the block table */    \
      const int64_t blk = table[logical];                                                      \
      off[i] = blk * a.s_kb + t * a.s_kt + h * a.s_kh;                                         \
      soff[i] = blk * a.s_sb + t * a.s_st + h;                                                 \
      if (++t == a.block_size) { t = 0; ++logical; }                                           \
    }                                                                                          \
    for (int64_t i = 0; i < n_pool; ++i) { /* K rows of the tile, fp32 */                      \
      float* dst = kbuf + i * DP;                                                              \
      LOAD_ROW(a.k, a.k_scale, off[i], soff[i], dst);                                          \
    }                                                                                          \
    if (n_pool < n) { /* the new token's K, the last key */                                    \
      const float* src = a.k_new + (b * a.KVH + h) * D;                                        \
      for (int64_t d = 0; d < D; ++d) kbuf[n_pool * DP + d] = src[d];                          \
    }                                                                                          \
    for (int64_t g = 0; g < G; ++g) { /* scores, then the online-softmax update */             \
      const float* qr = qg + g * DP;                                                           \
      float* pg = p + g * TILE;                                                                \
      float tile_max = -std::numeric_limits<float>::infinity();                                \
      for (int64_t i = 0; i < n; ++i) {                                                        \
        const float* kr = kbuf + i * DP;                                                       \
        v8f sv = CV8(qr) * CV8(kr);                                                            \
        for (int64_t c = 1; c < NC; ++c) sv += CV8(qr + 8 * c) * CV8(kr + 8 * c);              \
        const float s = ((sv[0] + sv[4]) + (sv[1] + sv[5])) + ((sv[2] + sv[6]) + (sv[3] + sv[7])); \
        pg[i] = s;                                                                             \
        tile_max = std::max(tile_max, s);                                                      \
      }                                                                                        \
      const float m_new = std::max(m[g], tile_max);                                            \
      const float corr = exp_neg(m[g] - m_new);                                                \
      float sum = 0.0f;                                                                        \
      _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < n; ++i) {                 \
        pg[i] = exp_neg(pg[i] - m_new);                                                        \
        sum += pg[i];                                                                          \
      }                                                                                        \
      l[g] = l[g] * corr + sum;                                                                \
      m[g] = m_new;                                                                            \
      float* ag = acc + g * DP;                                                                \
      for (int64_t d = 0; d < DP; ++d) ag[d] *= corr;                                          \
    }                                                                                          \
    for (int64_t i = 0; i < n_pool; ++i) { /* V rows of the tile into the K buffer */          \
      float* dst = kbuf + i * DP;                                                              \
      LOAD_ROW(a.v, a.v_scale, off[i], soff[i], dst);                                          \
    }                                                                                          \
    if (n_pool < n) {                                                                          \
      const float* src = a.v_new + (b * a.KVH + h) * D;                                        \
      for (int64_t d = 0; d < D; ++d) kbuf[n_pool * DP + d] = src[d];                          \
    }                                                                                          \
    for (int64_t g = 0; g < G; ++g) { /* acc += p V, 8 columns at a time held in a register */ \
      const float* pg = p + g * TILE;                                                          \
      float* ag = acc + g * DP;                                                                \
      for (int64_t c = 0; c < NC; ++c) {                                                       \
        v8f av = CV8(ag + 8 * c);                                                              \
        for (int64_t i = 0; i < n; ++i) av += pg[i] * CV8(kbuf + i * DP + 8 * c);              \
        V8(ag + 8 * c) = av;                                                                   \
      }                                                                                        \
    }                                                                                          \
  }                                                                                            \
  for (int64_t g = 0; g < G; ++g) {                                                            \
    float* o = a.out + (b * a.H + h * G + g) * D;                                              \
    const float inv = l[g] > 0 ? 1.0f / l[g] : 0.0f;                                           \
    for (int64_t d = 0; d < D; ++d) o[d] = acc[g * DP + d] * inv;                              \
  }

__attribute__((noinline, target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void task_avx512(const Args& a, int64_t b,
                                                                                   int64_t h, float* work) {
  TASK_BODY
}

__attribute__((noinline, target("avx2,fma"))) void task_avx2(const Args& a, int64_t b, int64_t h, float* work) { TASK_BODY }

__attribute__((noinline)) void task_default(const Args& a, int64_t b, int64_t h, float* work) { TASK_BODY }

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
  const int64_t G = H / KVH, DP = (D + 7) / 8 * 8, work_floats = 2 * G * DP + TILE * DP + G * TILE;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(work_floats);
    for (int64_t i = begin; i < end; ++i) {
      if (isa == ISA_AVX512) task_avx512(a, i / KVH, i % KVH, work.data());
      else if (isa == ISA_AVX2) task_avx2(a, i / KVH, i % KVH, work.data());
      else task_default(a, i / KVH, i % KVH, work.data());
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
