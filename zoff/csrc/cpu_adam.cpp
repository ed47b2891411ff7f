// Fused CPU Adam/AdamW step: one pass over memory per element (design.md section 3).
//
// Reads p (fp32), g (fp32 | bf16 | fp16, widened in registers and optionally times a scale), m, v (fp32);
// writes p, m, v and optionally the round-to-nearest-even 16-bit copy of the new p. The float operations follow torch's Adam op for op (see
// adam_elem), so results equal torch's fused CPU AdamW bit for bit, and torch.optim.AdamW(foreach=False) to
// ~1 ulp (its sqrt is not correctly rounded on large tensors). Compile with -ffp-contract=off so the compiler
// adds no FMAs of its own.
//
// ISA paths (AVX-512, AVX2+FMA+F16C, portable scalar) are compiled per function with target attributes, so
// one binary carries all of them and the caller picks one at run time.

#include <torch/extension.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
using fp16 = c10::Half;
struct NoOut {};  // "no 16-bit copy" marker type

// Per-step constants. Computed in double (as Python does for torch's optimizer), then rounded to float once,
// exactly where torch rounds its Python-float scalars to the tensor dtype.
struct Consts {
  float decay;     // 1 - lr*wd            (AdamW: p *= decay)
  float wd;        // wd                   (L2:    g = fma(p, wd, g))
  float w1_coeff;  // lerp weight w1 = 1 - beta1, or w1 - 1 when |w1| >= 0.5 (torch's lerp then uses base g)
  bool w1_small;
  float b2;        // beta2
  float c2;        // 1 - beta2
  float bc2s;      // sqrt(1 - beta2^t)
  float rbc2s;     // RN(1 / bc2s), for the divider-free exact division (see div_bc2s)
  float eps;
  float neg_step;  // -(lr / (1 - beta1^t))
  float gscale;    // the gradient's scale (unscaling and clipping): g = RN(g * gscale), as g.float().mul_(s)
  bool do_decay;
  bool do_l2;
  bool do_scale;
};

Consts make_consts(int64_t step, double lr, double beta1, double beta2, double eps, double wd, bool adamw,
                   bool bias_correction, double grad_scale) {
  Consts c{};
  // std::pow matches Python's float ** float (both call libm pow).
  const double t = static_cast<double>(step);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, t) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, t) : 1.0;
  c.do_decay = adamw && wd != 0.0;
  c.do_l2 = !adamw && wd != 0.0;
  c.decay = static_cast<float>(1.0 - lr * wd);
  c.wd = static_cast<float>(wd);
  const float w1 = static_cast<float>(1.0 - beta1);
  c.w1_small = std::fabs(w1) < 0.5f;
  c.w1_coeff = c.w1_small ? w1 : w1 - 1.0f;
  c.b2 = static_cast<float>(beta2);
  c.c2 = static_cast<float>(1.0 - beta2);
  c.bc2s = static_cast<float>(std::pow(bc2, 0.5));
  c.rbc2s = 1.0f / c.bc2s;
  c.eps = static_cast<float>(eps);
  c.neg_step = static_cast<float>(-(lr / bc1));
  // torch's mul_(python float) on an fp32 tensor multiplies by the scalar rounded to float, one rounding.
  // x * 1.0f is exact, so a scale of 1 skips the multiply with the same bits.
  c.gscale = static_cast<float>(grad_scale);
  c.do_scale = c.gscale != 1.0f;
  return c;
}

// ---------------------------------------------------------------------------------------------------------
// Scalar element update; also the tail of the AVX2 path (inlined there, where std::fma is one instruction).
inline float widen(float x) { return x; }
inline float widen(bf16 x) { return static_cast<float>(x); }
inline float widen(fp16 x) { return static_cast<float>(x); }

// The operation order below is torch's (adam.py _single_tensor_adam and the fused CPU kernel), one rounding
// per torch op, with FMAs exactly where torch's vectorised kernels use them:
//   g = g * gscale                                 (the caller's grad.float().mul_(scale), fused here)
//   p = p * decay                                  (AdamW, param.mul_)
//   g = fma(p, wd, g)                              (L2, grad.add(param, alpha=wd))
//   m = fma(w1, g - m, m)                          (exp_avg.lerp_(grad, 1 - beta1); |w1| >= 0.5 -> base g)
//   v = fma(c2 * g, g, v * b2)                     (exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2))
//   d = sqrt(v) / bc2s + eps                       (denom, correctly rounded sqrt)
//   p = p + (neg_step * m) / d                     (param.addcdiv_(exp_avg, denom, value=-step_size))
template <typename G, typename O>
inline void adam_elem(float* p, const G* g, float* m, float* v, O* out, int64_t i, const Consts& c) {
  float pi = p[i], gi = widen(g[i]), mi = m[i], vi = v[i];
  if (c.do_scale) gi = gi * c.gscale;
  if (c.do_decay) pi = pi * c.decay;
  if (c.do_l2) gi = std::fma(pi, c.wd, gi);
  mi = std::fma(c.w1_coeff, gi - mi, c.w1_small ? mi : gi);
  vi = std::fma(c.c2 * gi, gi, vi * c.b2);
  const float d = std::sqrt(vi) / c.bc2s + c.eps;
  pi = pi + (c.neg_step * mi) / d;
  p[i] = pi;
  m[i] = mi;
  v[i] = vi;
  if constexpr (!std::is_same_v<O, NoOut>) out[i] = O(pi);  // c10 conversions round to nearest even
}

// Software prefetch on every stream at two distances: 256 elements (1 KiB of fp32) into L1 and 2048 elements
// (8 KiB) into L2, one prefetch per 64-byte line. The divides and the sqrt of an Adam step fill the
// out-of-order window, so the core stops issuing loads early enough: ~85% of the probe's bandwidth at 16M
// params (2 threads) without prefetch, ~92% with the L1 one alone. The L2 one keeps enough lines in flight
// while the divider drains a burst of arrivals: ~96-100% (16M, 64M). Halving the divider's work instead (an
// inexact timing experiment) gained nothing, so the gap was memory-level parallelism, not compute. The
// write-only 16-bit copy needs its own L2 prefetch: with the other streams far ahead, its
// read-for-ownership misses became the laggard (mixed step ~80% of the probe without it, ~93-98% with it).
// The probe uses the same prefetch (it gains 1-5% from it), so the ceiling stays honest. Costs: up to 9
// prefetch instructions per 16 elements, and ~40 KiB per thread prefetched past its range (harmless).
// Non-temporal stores measured ~25% slower, for step and probe alike (p, m, v are read first, so their lines
// are in cache anyway when written).
constexpr int64_t kPrefetchL1 = 256;
constexpr int64_t kPrefetchL2 = 2048;
// always_inline: GCC split these helpers into out-of-line parts for some instantiations, judged a function
// holding only prefetches pure, and deleted the calls (no prefetch at all in e.g. the mixed step's loop).
#define ZOFF_PREFETCH inline __attribute__((always_inline))

template <typename T>
ZOFF_PREFETCH void prefetch_stream(const T* x, int64_t i) {
  // Called per 16 elements: a 16-bit stream crosses a line every other call.
  if (sizeof(T) == 4 || (i & 31) == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(x + i + kPrefetchL1), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(x + i + kPrefetchL2), _MM_HINT_T1);
  }
}

// Call once per 16 elements.
template <typename G, typename O = NoOut>
ZOFF_PREFETCH void prefetch_ahead(const float* p, const G* g, const float* m, const float* v, int64_t i,
                                  const O* out = nullptr) {
  prefetch_stream(p, i);
  prefetch_stream(g, i);
  prefetch_stream(m, i);
  prefetch_stream(v, i);
  if constexpr (!std::is_same_v<O, NoOut>) {
    if ((i & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(out + i + kPrefetchL2), _MM_HINT_T1);
  }
}

template <typename G, typename O>
void adam_scalar(float* p, const G* g, float* m, float* v, O* out, int64_t n, Consts c) {
  for (int64_t i = 0; i < n; ++i) adam_elem(p, g, m, v, out, i, c);
}

// ---------------------------------------------------------------------------------------------------------
// AVX-512 (16 lanes). The tail uses masked loads/stores, so every element takes the same vector code.
#define ZOFF_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

template <typename G>
ZOFF_AVX512 inline __m512 load16_g(const G* g, __mmask16 k) {
  if constexpr (std::is_same_v<G, float>) {
    return _mm512_maskz_loadu_ps(k, g);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, g);
    if constexpr (std::is_same_v<G, bf16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

template <typename O>
ZOFF_AVX512 inline void store16_out(O* out, __m512 x, __mmask16 k) {
  if constexpr (std::is_same_v<O, bf16>) {
    // Integer round-to-nearest-even (same as c10::BFloat16), not VCVTNEPS2BF16, which flushes denormals.
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(out, k, _mm512_cvtepi32_epi16(r));
  } else if constexpr (std::is_same_v<O, fp16>) {
    _mm256_mask_storeu_epi16(out, k, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// x / bc2s, bit-identical to the division but without the divider, whose throughput (not memory) limited the
// in-cache step to ~1 ns/elem: with y = RN(1/b) and q = RN(x*y), the remainder x - q*b is exact and
// RN(q + rem*y) = RN(x/b) (Markstein's theorem; also checked exhaustively over x's significands for 3000
// random divisors). An infinite x gives a NaN remainder, so keep q (= inf) there.
ZOFF_AVX512 inline __m512 div_bc2s(__m512 x, const Consts& c) {
  const __m512 b = _mm512_set1_ps(c.bc2s), y = _mm512_set1_ps(c.rbc2s);
  const __m512 q = _mm512_mul_ps(x, y);
  const __m512 q1 = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, b, x), y, q);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(q1, q1, _CMP_ORD_Q), q, q1);
}

template <typename G, typename O>
ZOFF_AVX512 inline void adam16(float* p, const G* g, float* m, float* v, O* out, int64_t i, __mmask16 k,
                               const Consts& c) {
  __m512 pv = _mm512_maskz_loadu_ps(k, p + i);
  __m512 gv = load16_g(g + i, k);
  __m512 mv = _mm512_maskz_loadu_ps(k, m + i);
  __m512 vv = _mm512_maskz_loadu_ps(k, v + i);
  if (c.do_scale) gv = _mm512_mul_ps(gv, _mm512_set1_ps(c.gscale));
  if (c.do_decay) pv = _mm512_mul_ps(pv, _mm512_set1_ps(c.decay));
  if (c.do_l2) gv = _mm512_fmadd_ps(pv, _mm512_set1_ps(c.wd), gv);
  mv = _mm512_fmadd_ps(_mm512_set1_ps(c.w1_coeff), _mm512_sub_ps(gv, mv), c.w1_small ? mv : gv);
  vv = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c.c2), gv), gv, _mm512_mul_ps(vv, _mm512_set1_ps(c.b2)));
  const __m512 d = _mm512_add_ps(div_bc2s(_mm512_sqrt_ps(vv), c), _mm512_set1_ps(c.eps));
  pv = _mm512_add_ps(pv, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c.neg_step), mv), d));
  _mm512_mask_storeu_ps(p + i, k, pv);
  _mm512_mask_storeu_ps(m + i, k, mv);
  _mm512_mask_storeu_ps(v + i, k, vv);
  if constexpr (!std::is_same_v<O, NoOut>) store16_out(out + i, pv, k);
}

template <typename G, typename O>
ZOFF_AVX512 void adam_avx512(float* p, const G* g, float* m, float* v, O* out, int64_t n, Consts c) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(p, g, m, v, i, out);
    adam16(p, g, m, v, out, i, static_cast<__mmask16>(0xFFFF), c);
  }
  if (i < n) adam16(p, g, m, v, out, i, static_cast<__mmask16>((1u << (n - i)) - 1u), c);
}

// ---------------------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C (8 lanes); the tail goes through adam_elem, which computes the same float ops.
#define ZOFF_AVX2 __attribute__((target("avx2,fma,f16c")))

template <typename G>
ZOFF_AVX2 inline __m256 load8_g(const G* g) {
  if constexpr (std::is_same_v<G, float>) {
    return _mm256_loadu_ps(g);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
    if constexpr (std::is_same_v<G, bf16>) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

template <typename O>
ZOFF_AVX2 inline void store8_out(O* out, __m256 x) {
  __m128i h;
  if constexpr (std::is_same_v<O, bf16>) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  } else {
    h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h);
}

template <typename G, typename O>
ZOFF_AVX2 void adam_avx2(float* p, const G* g, float* m, float* v, O* out, int64_t n, Consts c) {
  const __m256 decay = _mm256_set1_ps(c.decay), wd = _mm256_set1_ps(c.wd), w1 = _mm256_set1_ps(c.w1_coeff);
  const __m256 b2 = _mm256_set1_ps(c.b2), c2 = _mm256_set1_ps(c.c2), bc2s = _mm256_set1_ps(c.bc2s);
  const __m256 rbc2s = _mm256_set1_ps(c.rbc2s);
  const __m256 eps = _mm256_set1_ps(c.eps), ns = _mm256_set1_ps(c.neg_step), gs = _mm256_set1_ps(c.gscale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if ((i & 15) == 0) prefetch_ahead(p, g, m, v, i, out);
    __m256 pv = _mm256_loadu_ps(p + i);
    __m256 gv = load8_g(g + i);
    __m256 mv = _mm256_loadu_ps(m + i);
    __m256 vv = _mm256_loadu_ps(v + i);
    if (c.do_scale) gv = _mm256_mul_ps(gv, gs);
    if (c.do_decay) pv = _mm256_mul_ps(pv, decay);
    if (c.do_l2) gv = _mm256_fmadd_ps(pv, wd, gv);
    mv = _mm256_fmadd_ps(w1, _mm256_sub_ps(gv, mv), c.w1_small ? mv : gv);
    vv = _mm256_fmadd_ps(_mm256_mul_ps(c2, gv), gv, _mm256_mul_ps(vv, b2));
    const __m256 sq = _mm256_sqrt_ps(vv), q = _mm256_mul_ps(sq, rbc2s);  // sq / bc2s as in div_bc2s
    const __m256 q1 = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, bc2s, sq), rbc2s, q);
    const __m256 d = _mm256_add_ps(_mm256_blendv_ps(q, q1, _mm256_cmp_ps(q1, q1, _CMP_ORD_Q)), eps);
    pv = _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(ns, mv), d));
    _mm256_storeu_ps(p + i, pv);
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
    if constexpr (!std::is_same_v<O, NoOut>) store8_out(out + i, pv);
  }
  for (; i < n; ++i) adam_elem(p, g, m, v, out, i, c);
}

// ---------------------------------------------------------------------------------------------------------
// Dispatch.
enum class Simd { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

bool cpu_has(Simd s) {
  __builtin_cpu_init();
  switch (s) {
    case Simd::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Simd::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    default:
      return true;
  }
}

const char* simd_name(Simd s) { return s == Simd::kAvx512 ? "avx512" : s == Simd::kAvx2 ? "avx2" : "scalar"; }

Simd resolve_simd(const std::string& want) {
  if (want.empty() || want == "auto") {
    return cpu_has(Simd::kAvx512) ? Simd::kAvx512 : cpu_has(Simd::kAvx2) ? Simd::kAvx2 : Simd::kScalar;
  }
  Simd s;
  if (want == "avx512") s = Simd::kAvx512;
  else if (want == "avx2") s = Simd::kAvx2;
  else if (want == "scalar") s = Simd::kScalar;
  else TORCH_CHECK(false, "zoff cpu_adam: unknown SIMD level '", want, "' (expected avx512|avx2|scalar|auto)");
  TORCH_CHECK(cpu_has(s), "zoff cpu_adam: SIMD level '", want, "' was requested but this CPU lacks it");
  return s;
}

// 8192 fp32 elements = 32 KiB per array: tiles are the unit of OpenMP work; with schedule(static) each thread
// gets one contiguous run of tiles, which keeps the hardware prefetchers on long streams.
constexpr int64_t kTile = 8192;
// Below this many elements per thread, a parallel region costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 15;

int pick_threads(int64_t threads, int64_t n) {
  int64_t t = threads > 0 ? threads : at::get_num_threads();
  t = std::min<int64_t>(t, std::max<int64_t>(1, n / kMinPerThread));
  return static_cast<int>(std::max<int64_t>(t, 1));
}

template <typename F>
void for_tiles(int64_t n, int nthreads, F&& body) {
  const int64_t ntiles = (n + kTile - 1) / kTile;
  if (nthreads <= 1) {
    body(0, n);
    return;
  }
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t t = 0; t < ntiles; ++t) {
    const int64_t lo = t * kTile;
    body(lo, std::min(n, lo + kTile));
  }
}

template <typename G, typename O>
void run_typed(Simd s, float* p, const G* g, float* m, float* v, O* out, int64_t n, const Consts& c,
               int nthreads) {
  // Consts by value: a local copy cannot alias the arrays, so the compiler keeps it in registers.
  using Fn = void (*)(float*, const G*, float*, float*, O*, int64_t, Consts);
  Fn fn = s == Simd::kAvx512 ? &adam_avx512<G, O> : s == Simd::kAvx2 ? &adam_avx2<G, O> : &adam_scalar<G, O>;
  for_tiles(n, nthreads, [&](int64_t lo, int64_t hi) {
    fn(p + lo, g + lo, m + lo, v + lo, out ? out + lo : nullptr, hi - lo, c);
  });
}

template <typename G>
void run_out(Simd s, float* p, const G* g, float* m, float* v, const c10::optional<at::Tensor>& out, int64_t n,
             const Consts& c, int nt) {
  if (!out.has_value()) {
    run_typed<G, NoOut>(s, p, g, m, v, nullptr, n, c, nt);
  } else if (out->scalar_type() == at::kBFloat16) {
    run_typed<G, bf16>(s, p, g, m, v, out->data_ptr<bf16>(), n, c, nt);
  } else {
    run_typed<G, fp16>(s, p, g, m, v, out->data_ptr<fp16>(), n, c, nt);
  }
}

bool flat_cpu(const at::Tensor& t, int64_t n) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && t.numel() == n;
}

bool half_type(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

}  // namespace

// In-place Adam step on flat contiguous CPU tensors. Returns the SIMD level used, or "" when the kernel does not
// take these tensors (dtypes, layouts, sizes), for the caller to run the torch path instead. The checks live
// here, not in Python, and so does the step count: with `step_t` (the optimizer's `step` tensor) the
// count is incremented here and `step` is ignored. Right after a large step has streamed through the caches,
// the interpreter and torch's dispatcher run cold: a Python-side `step += 1`, `.item()` and layout checks cost
// ~0.4 ms per call there (measured at 16M params, ~3% of the step), against ~13 us when warm.
std::string adam_step(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, c10::optional<at::Tensor> out16,
                      c10::optional<at::Tensor> step_t, int64_t step, double lr, double beta1, double beta2,
                      double eps, double weight_decay, bool adamw_mode, bool bias_correction, int64_t threads,
                      const std::string& simd, double grad_scale) {
  const int64_t n = p.numel();
  const auto gt = g.scalar_type();
  if (p.scalar_type() != at::kFloat || m.scalar_type() != at::kFloat || v.scalar_type() != at::kFloat) return "";
  if (gt != at::kFloat && !half_type(gt)) return "";
  if (!flat_cpu(p, n) || !flat_cpu(g, n) || !flat_cpu(m, n) || !flat_cpu(v, n)) return "";
  if (out16.has_value() && !(half_type(out16->scalar_type()) && flat_cpu(*out16, n))) return "";
  // The counter is read and bumped through its pointer: item() and add_() would go through torch's
  // dispatcher, which is what this call exists to avoid.
  float* count32 = nullptr;  // torch's AdamW counts in float32, or float64 when the default dtype was float64
  double* count64 = nullptr;
  if (step_t.has_value()) {
    if (step_t->numel() != 1 || !step_t->device().is_cpu()) return "";
    if (step_t->scalar_type() == at::kFloat) count32 = step_t->data_ptr<float>();
    else if (step_t->scalar_type() == at::kDouble) count64 = step_t->data_ptr<double>();
    else return "";
    step = count32 != nullptr ? static_cast<int64_t>(*count32 + 1.0f) : static_cast<int64_t>(*count64 + 1.0);
  }
  TORCH_CHECK(step >= 1, "zoff cpu_adam: step must be >= 1 (the count after this update), got ", step);
  // The environment is read here, with the GIL still held (os.environ.get costs ~50 us cold); then released
  // so a background thread (delayed parameter update) can step while Python runs.
  if (const char* backend = std::getenv("ZOFF_CPU_ADAM_BACKEND")) {
    std::string b(backend);
    for (char& ch : b) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (b == "torch") return "";  // forced fallback, as _extension() honours it
  }
  const char* env_simd = simd.empty() ? std::getenv("ZOFF_CPU_ADAM_SIMD") : nullptr;
  const Simd s = resolve_simd(env_simd != nullptr ? std::string(env_simd) : simd);
  pybind11::gil_scoped_release nogil;
  const Consts c =
      make_consts(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale);
  const int nt = pick_threads(threads, n);
  float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  if (gt == at::kFloat) run_out(s, pp, g.data_ptr<float>(), mp, vp, out16, n, c, nt);
  else if (gt == at::kBFloat16) run_out(s, pp, g.data_ptr<bf16>(), mp, vp, out16, n, c, nt);
  else run_out(s, pp, g.data_ptr<fp16>(), mp, vp, out16, n, c, nt);
  if (count32 != nullptr) *count32 += 1.0f;  // in the counter's own dtype, as torch's AdamW counts
  if (count64 != nullptr) *count64 += 1.0;
  return simd_name(s);
}

std::vector<std::string> simd_levels() {
  std::vector<std::string> r;
  for (Simd s : {Simd::kAvx512, Simd::kAvx2, Simd::kScalar}) {
    if (cpu_has(s)) r.emplace_back(simd_name(s));
  }
  return r;
}

// ---------------------------------------------------------------------------------------------------------
// Bandwidth ceilings for scripts/bench_adam.py, threaded exactly like adam_step.
namespace {
ZOFF_AVX512 void probe_avx512(float* p, const float* g, float* m, float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(p, g, m, v, i);
    const __m512 gv = _mm512_loadu_ps(g + i);
    _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), gv));
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gv));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gv));
  }
  for (; i < n; ++i) p[i] += g[i], m[i] += g[i], v[i] += g[i];
}
void probe_generic(float* p, const float* g, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] += g[i], m[i] += g[i], v[i] += g[i];
}
ZOFF_AVX512 void triad_avx512(float* a, const float* b, const float* c, float s, int64_t n) {
  int64_t i = 0;
  const __m512 sv = _mm512_set1_ps(s);
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(a + i, _mm512_fmadd_ps(sv, _mm512_loadu_ps(c + i), _mm512_loadu_ps(b + i)));
  }
  for (; i < n; ++i) a[i] = b[i] + s * c[i];
}
void triad_generic(float* a, const float* b, const float* c, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}
}  // namespace

// Adam-traffic probe: reads p, g, m, v and writes p, m, v (28 B/elem), with trivial arithmetic.
void stream_probe(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, int64_t threads) {
  const int64_t n = p.numel();
  float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const bool wide = cpu_has(Simd::kAvx512);
  for_tiles(n, pick_threads(threads, n), [&](int64_t lo, int64_t hi) {
    (wide ? probe_avx512 : probe_generic)(pp + lo, gp + lo, mp + lo, vp + lo, hi - lo);
  });
}

// STREAM triad a = b + s*c (12 B/elem counted as STREAM does, without write-allocate traffic).
void stream_triad(at::Tensor a, at::Tensor b, at::Tensor c, double s, int64_t threads) {
  const int64_t n = a.numel();
  float* ap = a.data_ptr<float>();
  const float *bp = b.data_ptr<float>(), *cp = c.data_ptr<float>();
  const bool wide = cpu_has(Simd::kAvx512);
  for_tiles(n, pick_threads(threads, n), [&](int64_t lo, int64_t hi) {
    (wide ? triad_avx512 : triad_generic)(ap + lo, bp + lo, cp + lo, static_cast<float>(s), hi - lo);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  namespace py = pybind11;
  // adam_step releases the GIL itself, once it has read the environment.
  mod.def("adam_step", &adam_step, "Fused in-place Adam/AdamW step", py::arg("param"), py::arg("grad"),
          py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out16"), py::arg("step_t"), py::arg("step"),
          py::arg("lr"),
          py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"),
          py::arg("bias_correction"), py::arg("threads"), py::arg("simd"), py::arg("grad_scale") = 1.0);
  mod.def("simd_levels", &simd_levels, "SIMD levels this CPU supports, best first");
  mod.def("stream_probe", &stream_probe, py::call_guard<py::gil_scoped_release>());
  mod.def("stream_triad", &stream_triad, py::call_guard<py::gil_scoped_release>());
}
