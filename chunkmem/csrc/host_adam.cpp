// One-pass Adam/AdamW update of a flat chunk on the host (x86-64, AVX2 + FMA + F16C).
//
// Plain C ABI, loaded with ctypes by chunkmem/host_adam_ext.py: no torch headers, no pybind11, no
// ninja; one `g++ -O3 -shared` of this file. The arithmetic mirrors, operation by operation and rounding
// by rounding, the torch-op formulation in chunkmem/adam_kernels.py (itself torch.optim.Adam/AdamW with
// foreach=False):
//
//   g  = float(grad) [* mult]                    grad.float().mul_(mult)
//   p  = p * decay                                 master.mul_(1 - lr*wd)            (AdamW, wd != 0)
//   g  = g + wd*p                                  g.add(master, alpha=wd)           (Adam,  wd != 0)
//   m  = m + w*(g - m)          (|w| < 0.5)        exp_avg.lerp_(g, w = 1 - beta1)
//   m  = g + (w - 1)*(g - m)    (otherwise)
//   v  = v * beta2;  v = v + (omb2*g)*g            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1-beta2)
//   d  = sqrt(v) / bc2s + eps                      (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps)
//   p  = p + (nss*m) / d                           master.addcdiv_(exp_avg, denom, value=-step_size)
//   out = half/bfloat16(p), round to nearest even  param_out.copy_(master)
//
// Every scalar is the fp32 rounding of the double the Python side computes, as torch casts a Python
// scalar to the tensor's dtype. torch's vectorized CPU kernels (AVX2/AVX-512 builds) evaluate the
// add-with-alpha, the lerp and the addcmul with fused multiply-adds; its DEFAULT (no-FMA) build does
// not. The template parameter FMA picks one or the other, so the result can match torch bit for bit in
// both cases; the Python side checks which one does at load time. This file is compiled with
// -ffp-contract=off so that the compiler never fuses on its own.
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#define CM_TARGET __attribute__((target("avx2,fma,f16c")))
#define CM_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

enum DType : int { kNone = -1, kF32 = 0, kF16 = 1, kBF16 = 2 };

enum Flags : int {
  kApplyMult = 1,    // multiply the gradient by mult
  kDecoupled = 2,    // AdamW decay: p *= decay
  kL2 = 4,           // Adam decay: g += wd * p
};

struct Args {
  float mult, decay, wd, w, beta2, omb2, bc2s, eps, nss;
  int flags;
};

// ---------------------------------------------------------------------------------------------------
// Scalar element (tails, heads and thread boundaries): the same operations as the vector body.

CM_TARGET inline float madd(float a, float b, float c, bool fma) {
  return fma ? std::fmaf(a, b, c) : a * b + c;  // -ffp-contract=off: a*b + c stays two roundings
}

CM_TARGET inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

CM_TARGET inline uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <int GD>
CM_TARGET inline float load_grad1(const void* g, int64_t i) {
  if constexpr (GD == kF32) return static_cast<const float*>(g)[i];
  else if constexpr (GD == kF16) return _cvtsh_ss(static_cast<const uint16_t*>(g)[i]);
  else return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
}

template <int OD>
CM_TARGET inline void store_out1(void* o, int64_t i, float p) {
  if constexpr (OD == kF16) static_cast<uint16_t*>(o)[i] = _cvtss_sh(p, _MM_FROUND_TO_NEAREST_INT);
  else if constexpr (OD == kBF16) static_cast<uint16_t*>(o)[i] = f32_to_bf16(p);
}

template <int GD, int OD, bool FMA>
CM_TARGET inline void adam_scalar(float* __restrict p, const void* __restrict g, float* __restrict m,
                                  float* __restrict v, void* __restrict out, int64_t i, const Args& a,
                                  bool small) {
  float gi = load_grad1<GD>(g, i);
  if (a.flags & kApplyMult) gi = gi * a.mult;
  float pi = p[i];
  if (a.flags & kDecoupled) pi = pi * a.decay;
  if (a.flags & kL2) gi = madd(pi, a.wd, gi, FMA);
  float mi = m[i];
  float diff = gi - mi;
  mi = small ? madd(a.w, diff, mi, FMA) : madd(a.w - 1.0f, diff, gi, FMA);
  float vi = v[i] * a.beta2;
  vi = madd(a.omb2 * gi, gi, vi, FMA);
  float d = (a.bc2s == 1.0f ? std::sqrt(vi) : std::sqrt(vi) / a.bc2s) + a.eps;  // x / 1 == x, exactly
  pi = pi + (a.nss * mi) / d;
  p[i] = pi;
  m[i] = mi;
  v[i] = vi;
  store_out1<OD>(out, i, pi);
}

// ---------------------------------------------------------------------------------------------------
// Vector body: 8 lanes per __m256, 16 elements per iteration.

template <bool FMA>
CM_TARGET inline __m256 vmadd(__m256 a, __m256 b, __m256 c) {
  if constexpr (FMA) return _mm256_fmadd_ps(a, b, c);
  else return _mm256_add_ps(_mm256_mul_ps(a, b), c);
}

template <int GD>
CM_TARGET inline void load_grad16(const void* g, int64_t i, __m256& g0, __m256& g1) {
  if constexpr (GD == kF32) {
    const float* gf = static_cast<const float*>(g) + i;
    g0 = _mm256_loadu_ps(gf);
    g1 = _mm256_loadu_ps(gf + 8);
  } else {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (GD == kF16) {
      g0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
      g1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    } else {  // bf16 bits into the high halves of 32-bit lanes: quads (0 2 | 1 3), then interleave with 0
      h = _mm256_permute4x64_epi64(h, 0xD8);
      g0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), h));
      g1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), h));
    }
  }
}

CM_TARGET inline __m256i bf16_round8(__m256 x) {  // 8 x (bf16 bits in the low half of each int32)
  __m256i u = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  __m256 ord = _mm256_cmp_ps(x, x, _CMP_ORD_Q);
  return _mm256_blendv_epi8(_mm256_set1_epi32(0x7FC0), r, _mm256_castps_si256(ord));
}

template <int OD, bool NT>
CM_TARGET inline void store_out16(void* o, int64_t i, __m256 p0, __m256 p1) {
  if constexpr (OD == kNone || OD == kF32) {
    return;
  } else {
    __m256i packed;
    if constexpr (OD == kF16) {
      packed = _mm256_set_m128i(_mm256_cvtps_ph(p1, _MM_FROUND_TO_NEAREST_INT),
                                _mm256_cvtps_ph(p0, _MM_FROUND_TO_NEAREST_INT));
    } else {
      packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_round8(p0), bf16_round8(p1)), 0xD8);
    }
    __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o) + i);
    if constexpr (NT) _mm256_stream_si256(dst, packed);
    else _mm256_storeu_si256(dst, packed);
  }
}

template <int GD, int OD, bool FMA, bool NT>
CM_TARGET void adam_range_vec(float* __restrict p, const void* __restrict g, float* __restrict m,
                              float* __restrict v, void* __restrict out, int64_t begin, int64_t end,
                              const Args& a, bool small) {
  const __m256 mult = _mm256_set1_ps(a.mult), decay = _mm256_set1_ps(a.decay), wd = _mm256_set1_ps(a.wd);
  const __m256 w = _mm256_set1_ps(small ? a.w : a.w - 1.0f);
  const __m256 beta2 = _mm256_set1_ps(a.beta2), omb2 = _mm256_set1_ps(a.omb2);
  const __m256 bc2s = _mm256_set1_ps(a.bc2s), eps = _mm256_set1_ps(a.eps), nss = _mm256_set1_ps(a.nss);
  const bool apply_mult = a.flags & kApplyMult, decoupled = a.flags & kDecoupled, l2 = a.flags & kL2;
  // sqrt(v) / 1 == sqrt(v) exactly: with bias correction off, or once 1 - beta2^step rounds to 1 (after
  // some 17,000 steps with beta2 = 0.999), skip that division (a third of the divider's work)
  const bool div_bc2 = a.bc2s != 1.0f;
  int64_t i = begin;
  if constexpr (NT) {  // streaming stores of the 16-bit copy need it 32-byte aligned
    while (i < end && (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(out) + i) & 31) != 0)
      adam_scalar<GD, OD, FMA>(p, g, m, v, out, i++, a, small);
  }
  for (; i + 16 <= end; i += 16) {
    __m256 g0, g1;
    load_grad16<GD>(g, i, g0, g1);
    if (apply_mult) {
      g0 = _mm256_mul_ps(g0, mult);
      g1 = _mm256_mul_ps(g1, mult);
    }
    __m256 p0 = _mm256_loadu_ps(p + i), p1 = _mm256_loadu_ps(p + i + 8);
    if (decoupled) {
      p0 = _mm256_mul_ps(p0, decay);
      p1 = _mm256_mul_ps(p1, decay);
    }
    if (l2) {
      g0 = vmadd<FMA>(p0, wd, g0);
      g1 = vmadd<FMA>(p1, wd, g1);
    }
    __m256 m0 = _mm256_loadu_ps(m + i), m1 = _mm256_loadu_ps(m + i + 8);
    __m256 base0 = small ? m0 : g0, base1 = small ? m1 : g1;
    m0 = vmadd<FMA>(w, _mm256_sub_ps(g0, m0), base0);
    m1 = vmadd<FMA>(w, _mm256_sub_ps(g1, m1), base1);
    __m256 v0 = _mm256_mul_ps(_mm256_loadu_ps(v + i), beta2), v1 = _mm256_mul_ps(_mm256_loadu_ps(v + i + 8), beta2);
    v0 = vmadd<FMA>(_mm256_mul_ps(omb2, g0), g0, v0);
    v1 = vmadd<FMA>(_mm256_mul_ps(omb2, g1), g1, v1);
    __m256 d0 = _mm256_sqrt_ps(v0), d1 = _mm256_sqrt_ps(v1);
    if (div_bc2) {
      d0 = _mm256_div_ps(d0, bc2s);
      d1 = _mm256_div_ps(d1, bc2s);
    }
    d0 = _mm256_add_ps(d0, eps);
    d1 = _mm256_add_ps(d1, eps);
    p0 = _mm256_add_ps(p0, _mm256_div_ps(_mm256_mul_ps(nss, m0), d0));
    p1 = _mm256_add_ps(p1, _mm256_div_ps(_mm256_mul_ps(nss, m1), d1));
    _mm256_storeu_ps(p + i, p0);
    _mm256_storeu_ps(p + i + 8, p1);
    _mm256_storeu_ps(m + i, m0);
    _mm256_storeu_ps(m + i + 8, m1);
    _mm256_storeu_ps(v + i, v0);
    _mm256_storeu_ps(v + i + 8, v1);
    store_out16<OD, NT>(out, i, p0, p1);
  }
  for (; i < end; ++i) adam_scalar<GD, OD, FMA>(p, g, m, v, out, i, a, small);
  if constexpr (NT) _mm_sfence();
}

using RangeFn = void (*)(float*, const void*, float*, float*, void*, int64_t, int64_t, const Args&, bool);

template <int GD, int OD, bool FMA>
RangeFn pick_nt(bool nt) {
  if constexpr (OD == kF16 || OD == kBF16) {
    if (nt) return &adam_range_vec<GD, OD, FMA, true>;
  }
  return &adam_range_vec<GD, OD, FMA, false>;
}

template <int GD, bool FMA>
RangeFn pick_out(int od, bool nt) {
  switch (od) {
    case kF16: return pick_nt<GD, kF16, FMA>(nt);
    case kBF16: return pick_nt<GD, kBF16, FMA>(nt);
    case kNone: return pick_nt<GD, kNone, FMA>(nt);
    default: return nullptr;
  }
}

template <bool FMA>
RangeFn pick_grad(int gd, int od, bool nt) {
  switch (gd) {
    case kF32: return pick_out<kF32, FMA>(od, nt);
    case kF16: return pick_out<kF16, FMA>(od, nt);
    case kBF16: return pick_out<kBF16, FMA>(od, nt);
    default: return nullptr;
  }
}

// Runs body(begin, end) over [0, n) on up to nthreads threads (the calling thread one of them), at
// least min_per_thread elements each. The threads take blocks of kBlock elements in turn from a shared
// counter rather than fixed shares, so that on a shared machine a thread whose core is busy with
// another process does less of the work instead of holding everyone up.
constexpr int64_t kBlock = 1 << 16;

template <typename Body>
void parallel_range(int64_t n, int nthreads, int64_t min_per_thread, Body body) {
  int64_t t = nthreads < 1 ? 1 : nthreads;
  if (min_per_thread < 1) min_per_thread = 1;
  if (n / min_per_thread < t) t = n / min_per_thread;
  if (t <= 1 || n <= kBlock) {
    body(int64_t(0), n);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t b; (b = next.fetch_add(kBlock, std::memory_order_relaxed)) < n;)
      body(b, b + kBlock < n ? b + kBlock : n);
  };
  std::vector<std::thread> workers;
  workers.reserve(size_t(t - 1));
  try {
    for (int64_t i = 1; i < t; ++i) workers.emplace_back(work);
  } catch (...) {  // could not start a thread: the ones running (and this one) do the work
  }
  work();
  for (auto& th : workers) th.join();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Exported C ABI.

CM_EXPORT int chunkmem_host_adam_abi(void) { return 1; }

CM_EXPORT int chunkmem_host_adam_cpu_ok(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// Returns 0 on success, nonzero for an unsupported dtype combination (nothing written then).
CM_EXPORT int chunkmem_host_adam(float* p, const void* g, int grad_dtype, float* m, float* v, void* out,
                                 int out_dtype, int64_t n, float mult, float decay, float wd, float w,
                                 float beta2, float omb2, float bc2s, float eps, float nss, int flags, int fma,
                                 int nthreads, int64_t nt_min) {
  if (out == nullptr) out_dtype = kNone;
  RangeFn fn = fma ? pick_grad<true>(grad_dtype, out_dtype, n >= nt_min)
                   : pick_grad<false>(grad_dtype, out_dtype, n >= nt_min);
  if (fn == nullptr) return 1;
  const Args a{mult, decay, wd, w, beta2, omb2, bc2s, eps, nss, flags};
  const bool small = std::fabs(w) < 0.5f;
  parallel_range(n, nthreads, 1 << 15, [&](int64_t b, int64_t e) { fn(p, g, m, v, out, b, e, a, small); });
  return 0;
}

// The bandwidth reference: in place, 4 fp32 streams read and 3 written (28 bytes per element), with
// trivial arithmetic, split over threads like the update.
CM_TARGET static void stream_range(float* __restrict a, float* __restrict b, float* __restrict c,
                                   const float* __restrict d, int64_t begin, int64_t end, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {  // all loads of an iteration before its stores, as in the update
    __m256 d0 = _mm256_loadu_ps(d + i), d1 = _mm256_loadu_ps(d + i + 8);
    __m256 a0 = _mm256_loadu_ps(a + i), a1 = _mm256_loadu_ps(a + i + 8);
    __m256 b0 = _mm256_loadu_ps(b + i), b1 = _mm256_loadu_ps(b + i + 8);
    __m256 c0 = _mm256_loadu_ps(c + i), c1 = _mm256_loadu_ps(c + i + 8);
    _mm256_storeu_ps(a + i, _mm256_fmadd_ps(a0, vs, d0));
    _mm256_storeu_ps(a + i + 8, _mm256_fmadd_ps(a1, vs, d1));
    _mm256_storeu_ps(b + i, _mm256_fmadd_ps(b0, vs, d0));
    _mm256_storeu_ps(b + i + 8, _mm256_fmadd_ps(b1, vs, d1));
    _mm256_storeu_ps(c + i, _mm256_fmadd_ps(c0, vs, d0));
    _mm256_storeu_ps(c + i + 8, _mm256_fmadd_ps(c1, vs, d1));
  }
  for (; i < end; ++i) {
    a[i] = a[i] * s + d[i];
    b[i] = b[i] * s + d[i];
    c[i] = c[i] * s + d[i];
  }
}

CM_EXPORT void chunkmem_stream_4r3w(float* a, float* b, float* c, const float* d, int64_t n, float s,
                                    int nthreads) {
  parallel_range(n, nthreads, 1 << 15, [&](int64_t lo, int64_t hi) { stream_range(a, b, c, d, lo, hi, s); });
}

// The same memory traffic as a mixed-precision update (fp16 stream read, 3 fp32 streams read and
// written in place, fp16 stream written with streaming stores; 28 bytes an element) with trivial
// arithmetic instead of Adam's: what the update would cost if its arithmetic were free.
CM_TARGET static void stream_mixed_range(float* __restrict a, float* __restrict b, float* __restrict c,
                                         const uint16_t* __restrict g, uint16_t* __restrict o, int64_t begin,
                                         int64_t end, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = begin;
  while (i < end && (reinterpret_cast<uintptr_t>(o + i) & 31) != 0) {
    float gi = _cvtsh_ss(g[i]);
    a[i] = a[i] * s + gi;
    b[i] = b[i] * s + gi;
    c[i] = c[i] * s + gi;
    o[i] = _cvtss_sh(a[i], _MM_FROUND_TO_NEAREST_INT);
    ++i;
  }
  for (; i + 16 <= end; i += 16) {
    __m256 g0, g1;
    load_grad16<kF16>(g, i, g0, g1);
    __m256 a0 = _mm256_loadu_ps(a + i), a1 = _mm256_loadu_ps(a + i + 8);
    __m256 b0 = _mm256_loadu_ps(b + i), b1 = _mm256_loadu_ps(b + i + 8);
    __m256 c0 = _mm256_loadu_ps(c + i), c1 = _mm256_loadu_ps(c + i + 8);
    a0 = _mm256_fmadd_ps(a0, vs, g0);
    a1 = _mm256_fmadd_ps(a1, vs, g1);
    _mm256_storeu_ps(a + i, a0);
    _mm256_storeu_ps(a + i + 8, a1);
    _mm256_storeu_ps(b + i, _mm256_fmadd_ps(b0, vs, g0));
    _mm256_storeu_ps(b + i + 8, _mm256_fmadd_ps(b1, vs, g1));
    _mm256_storeu_ps(c + i, _mm256_fmadd_ps(c0, vs, g0));
    _mm256_storeu_ps(c + i + 8, _mm256_fmadd_ps(c1, vs, g1));
    store_out16<kF16, true>(o, i, a0, a1);
  }
  for (; i < end; ++i) {
    float gi = _cvtsh_ss(g[i]);
    a[i] = a[i] * s + gi;
    b[i] = b[i] * s + gi;
    c[i] = c[i] * s + gi;
    o[i] = _cvtss_sh(a[i], _MM_FROUND_TO_NEAREST_INT);
  }
  _mm_sfence();
}

CM_EXPORT void chunkmem_stream_mixed(float* a, float* b, float* c, const uint16_t* g, uint16_t* o, int64_t n,
                                     float s, int nthreads) {
  parallel_range(n, nthreads, 1 << 15,
                 [&](int64_t lo, int64_t hi) { stream_mixed_range(a, b, c, g, o, lo, hi, s); });
}
