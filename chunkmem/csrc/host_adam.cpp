// One-pass Adam/AdamW update of a flat chunk on the host (x86-64: AVX2 + FMA + F16C, AVX-512 where the
// CPU has it).
//
// Plain C ABI, loaded with ctypes by chunkmem/optim/host_adam_ext.py: no torch headers, no pybind11, no
// ninja; one `g++ -O3 -shared` of this file (which includes host_adam_vec.h twice), with -fopenmp where
// that shares the OpenMP runtime torch loaded (host_adam_ext._build). The arithmetic mirrors, operation
// by operation and rounding by rounding, the torch-op formulation in chunkmem/optim/adam_math.py (itself
// torch.optim.Adam/AdamW with foreach=False):
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
//
// The square root is the instruction set's (correctly rounded), or, where torch's Tensor.sqrt is not
// correctly rounded (MKL builds, whose sqrt goes through MKL VML: one ulp off for some inputs on some
// CPUs), the same library function torch calls, handed in by the Python side as a function pointer and
// applied to tiles of the chunk held in the L1 cache (adam_range_tiled).
//
// torch.optim.AdamW(fused=True) on the CPU rounds like the FMA variant with the instruction set's square
// root, except in the last (numel mod 8) elements of each tensor, which its compiled loop handles one
// by one and rounds exp_avg_sq as fma(v, beta2, (omb2*g)*g). The caller names those elements (tail
// runs, see chunkmem_host_adam) when it wants that reference's results bit for bit.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <pthread.h>
#include <thread>
#include <vector>

#include "parallel_range.h"

#define CM_TARGET __attribute__((target("avx2,fma,f16c")))
#define CM_EXPORT extern "C" __attribute__((visibility("default")))
#define CM_INLINE inline __attribute__((always_inline))

namespace {

enum DType : int { kNone = -1, kF32 = 0, kF16 = 1, kBF16 = 2 };

enum Flags : int {
  kApplyMult = 1,    // multiply the gradient by mult
  kDecoupled = 2,    // AdamW decay: p *= decay
  kL2 = 4,           // Adam decay: g += wd * p
};

// A square root over an array, called like MKL's vmsSqrt(n, a, r, mode). MKL_INT n is 32 bits in the
// LP64 interface (the callee reads the low half of the register) and 64 in ILP64: passing 64 bits and
// n < 2^31 serves both.
using VecSqrt = void (*)(int64_t n, const float* a, float* r, int64_t mode);

struct Args {
  float mult, decay, wd, w, beta2, omb2, bc2s, eps, nss;
  int flags;
  bool small;          // |w| < 0.5: the lerp's first branch
  VecSqrt vsqrt;       // nullptr: the correctly rounded square root of the instruction set
  int64_t vsqrt_mode;  // the mode argument of vsqrt
};

// ---------------------------------------------------------------------------------------------------
// Scalar element (tails, heads and thread boundaries): the same operations as the vector body, in two
// halves: the moments (and the decayed master), then, given sqrt(v), the master.

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

template <int GD, bool FMA>
CM_TARGET inline void moments1(float* __restrict p, const void* __restrict g, float* __restrict m,
                               float* __restrict v, int64_t i, const Args& a) {
  float gi = load_grad1<GD>(g, i);
  if (a.flags & kApplyMult) gi = gi * a.mult;
  float pi = p[i];
  if (a.flags & kDecoupled) p[i] = pi = pi * a.decay;
  if (a.flags & kL2) gi = madd(pi, a.wd, gi, FMA);
  float mi = m[i];
  float diff = gi - mi;
  m[i] = a.small ? madd(a.w, diff, mi, FMA) : madd(a.w - 1.0f, diff, gi, FMA);
  float vi = v[i] * a.beta2;
  v[i] = madd(a.omb2 * gi, gi, vi, FMA);
}

template <int OD>
CM_TARGET inline void finish1(float* __restrict p, const float* __restrict m, void* __restrict out, int64_t i,
                              float sqrt_v, const Args& a) {
  float d = (a.bc2s == 1.0f ? sqrt_v : sqrt_v / a.bc2s) + a.eps;  // x / 1 == x, exactly
  float pi = p[i] + (a.nss * m[i]) / d;
  p[i] = pi;
  store_out1<OD>(out, i, pi);
}

template <int GD, int OD, bool FMA>
CM_TARGET inline void adam_scalar(float* __restrict p, const void* __restrict g, float* __restrict m,
                                  float* __restrict v, void* __restrict out, int64_t i, const Args& a) {
  moments1<GD, FMA>(p, g, m, v, i, a);
  finish1<OD>(p, m, out, i, std::sqrt(v[i]), a);
}

// One element of a tail run: the FMA rounding, except exp_avg_sq = fma(v, beta2, (omb2*g)*g).
CM_TARGET inline void adam_tail1(float* __restrict p, const float* __restrict g, float* __restrict m,
                                 float* __restrict v, int64_t i, const Args& a) {
  float gi = g[i];
  if (a.flags & kApplyMult) gi = gi * a.mult;
  float pi = p[i];
  if (a.flags & kDecoupled) p[i] = pi = pi * a.decay;
  if (a.flags & kL2) gi = std::fmaf(pi, a.wd, gi);
  float mi = m[i];
  float diff = gi - mi;
  m[i] = a.small ? std::fmaf(a.w, diff, mi) : std::fmaf(a.w - 1.0f, diff, gi);
  v[i] = std::fmaf(v[i], a.beta2, (a.omb2 * gi) * gi);
  finish1<kNone>(p, m, nullptr, i, std::sqrt(v[i]), a);
}

// ---------------------------------------------------------------------------------------------------
// Vector body (host_adam_vec.h), compiled twice: for AVX2 (8 lanes) and for AVX-512 (16 lanes), which
// runs where the CPU and the OS have it. In the cache AVX-512 updates twice the elements a cycle; from
// memory both are near the bandwidth, but with the core less busy the loads run further ahead.

// How far ahead of the iteration it is at the vector loop asks for the cache lines of the streams it
// reads (elements): the hardware prefetchers alone leave the update a few percent under the bandwidth
// of the machine (measured on AMD EPYC with AVX-512: 1.5-2.5% faster with 256; 512 and 1024 no better).
constexpr int64_t kPrefetchAhead = 256;
// Elements a tile of adam_range_tiled, whose buffers stay in the L1 cache between its two halves.
constexpr int64_t kTile = 512;

using RangeFn = void (*)(float*, const void*, float*, float*, void*, int64_t, int64_t, const Args&);

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

struct V {
  using F = __m256;
  using Mask = __m256;  // every bit of a lane set, or none
  static constexpr int kLanes = 8;

  static F set1(float x) { return _mm256_set1_ps(x); }
  static F loadu(const float* x) { return _mm256_loadu_ps(x); }
  static void storeu(float* x, F a) { _mm256_storeu_ps(x, a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static Mask mask(bool on) { return _mm256_castsi256_ps(_mm256_set1_epi32(on ? -1 : 0)); }
  static F select(Mask k, F a, F b) { return _mm256_blendv_ps(b, a, k); }  // a where k is set, else b

  template <int GD>
  static void load_grad2(const void* g, int64_t i, F& g0, F& g1) {
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

  static __m256i bf16_round(F x) {  // 8 x (bf16 bits in the low half of each int32)
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256 ord = _mm256_cmp_ps(x, x, _CMP_ORD_Q);
    return _mm256_blendv_epi8(_mm256_set1_epi32(0x7FC0), r, _mm256_castps_si256(ord));
  }

  template <int OD, bool NT>
  static void store_out2(void* o, int64_t i, F p0, F p1) {
    if constexpr (OD == kF16 || OD == kBF16) {
      __m256i packed;
      if constexpr (OD == kF16) {
        packed = _mm256_set_m128i(_mm256_cvtps_ph(p1, _MM_FROUND_TO_NEAREST_INT),
                                  _mm256_cvtps_ph(p0, _MM_FROUND_TO_NEAREST_INT));
      } else {
        packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_round(p0), bf16_round(p1)), 0xD8);
      }
      __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(o) + i);
      if constexpr (NT) _mm256_stream_si256(dst, packed);
      else _mm256_storeu_si256(dst, packed);
    }
  }
};

#include "host_adam_vec.h"

}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw")
namespace avx512 {

struct V {
  using F = __m512;
  using Mask = __mmask16;
  static constexpr int kLanes = 16;

  static F set1(float x) { return _mm512_set1_ps(x); }
  static F loadu(const float* x) { return _mm512_loadu_ps(x); }
  static void storeu(float* x, F a) { _mm512_storeu_ps(x, a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static Mask mask(bool on) { return on ? Mask(0xFFFF) : Mask(0); }
  static F select(Mask k, F a, F b) { return _mm512_mask_blend_ps(k, b, a); }  // a where k is set, else b

  template <int GD>
  static void load_grad2(const void* g, int64_t i, F& g0, F& g1) {
    if constexpr (GD == kF32) {
      const float* gf = static_cast<const float*>(g) + i;
      g0 = _mm512_loadu_ps(gf);
      g1 = _mm512_loadu_ps(gf + 16);
    } else {
      const uint16_t* gh = static_cast<const uint16_t*>(g) + i;
      __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gh));
      __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gh + 16));
      if constexpr (GD == kF16) {
        g0 = _mm512_cvtph_ps(lo);
        g1 = _mm512_cvtph_ps(hi);
      } else {  // bf16 bits into the high halves of 32-bit lanes
        g0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(lo), 16));
        g1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
      }
    }
  }

  // The bf16 rounding of 16 floats, each in the high half of its 32-bit lane (the low half is garbage).
  static __m512i bf16_round_high(F x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_set1_epi32(0x7FC00000), r);
  }

  template <int OD, bool NT>
  static void store_out2(void* o, int64_t i, F p0, F p1) {
    if constexpr (OD == kF16 || OD == kBF16) {
      __m512i packed;
      if constexpr (OD == kF16) {
        packed = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(p0, _MM_FROUND_TO_NEAREST_INT)),
                                    _mm512_cvtps_ph(p1, _MM_FROUND_TO_NEAREST_INT), 1);
      } else {  // the high 16-bit words of p0's lanes, then of p1's
        const __m512i odd_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                                   31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        packed = _mm512_permutex2var_epi16(bf16_round_high(p0), odd_words, bf16_round_high(p1));
      }
      void* dst = static_cast<uint16_t*>(o) + i;
      if constexpr (NT) _mm512_stream_si512(static_cast<__m512i*>(dst), packed);
      else _mm512_storeu_si512(dst, packed);
    }
  }
};

#include "host_adam_vec.h"

}  // namespace avx512
#pragma GCC pop_options

// Ranges of parallel_range (parallel_range.h) are kBlock elements: a block of each buffer stays in the cache.
constexpr int64_t kBlock = 1 << 16;

template <typename Body>
void parallel_range(int64_t n, int nthreads, int64_t min_per_thread, Body body) {
  parallel_range(n, nthreads, min_per_thread, kBlock, body);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Exported C ABI.

CM_EXPORT int chunkmem_host_adam_abi(void) { return 7; }

CM_EXPORT int chunkmem_host_adam_cpu_ok(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// Whether the library runs its threads on the OpenMP runtime (built with -fopenmp).
CM_EXPORT int chunkmem_host_adam_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

// Whether the AVX-512 body can run here (libgcc's check includes the OS saving the zmm registers).
CM_EXPORT int chunkmem_host_adam_avx512_ok(void) {
  __builtin_cpu_init();
  return chunkmem_host_adam_cpu_ok() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

// Copies src[b, e) to dst[b, e) with streaming stores where dst allows them: an undo copy is read back
// rarely, so its lines should not take the cache's room (nor be read in before they are overwritten).
CM_TARGET static void copy_streaming(float* __restrict dst, const float* __restrict src, int64_t b, int64_t e) {
  int64_t i = b;
  for (; i < e && (reinterpret_cast<uintptr_t>(dst + i) % 32) != 0; ++i) dst[i] = src[i];
  if ((reinterpret_cast<uintptr_t>(dst + i) % 32) == 0) {
    for (; i + 16 <= e; i += 16) {
      const __m256 a = _mm256_loadu_ps(src + i), c = _mm256_loadu_ps(src + i + 8);
      _mm256_stream_ps(dst + i, a);
      _mm256_stream_ps(dst + i + 8, c);
    }
  }
  for (; i < e; ++i) dst[i] = src[i];
}

// Returns 0 on success, nonzero for an unsupported combination (nothing written then). vsqrt: nullptr
// for the instruction set's square root, else a VecSqrt called with vsqrt_mode. tail_runs: ntail
// [start, end) pairs of elements, sorted and disjoint, updated with adam_tail1 (fp32 gradient, no 16-bit
// copy, FMA rounding, the instruction set's square root only). nseg == 0: g is the gradient of all n
// elements. nseg > 0: the gradient comes in pieces, g ignored: piece k covers the elements
// [seg_bounds[2k], seg_bounds[2k+1]) (sorted, disjoint) and starts at seg_grads[k]; elements no piece
// covers are left as they are. avx512: 1 for the AVX-512 body (the caller has checked
// chunkmem_host_adam_avx512_ok), 0 for the AVX2 one: the same results either way. undo_p, undo_m,
// undo_v: nullptr, or buffers of n elements that receive every element of p, m and v as it was before
// the update (all n, also those no piece covers), each block copied just before the update reads it from
// the cache: the undo copy of step_in_backward for 12 bytes an element instead of a pass of its own.
CM_EXPORT int chunkmem_host_adam(float* p, const void* g, int grad_dtype, float* m, float* v, void* out,
                                 int out_dtype, int64_t n, float mult, float decay, float wd, float w,
                                 float beta2, float omb2, float bc2s, float eps, float nss, int flags, int fma,
                                 void* vsqrt, int64_t vsqrt_mode, int nthreads, int64_t nt_min,
                                 const int64_t* tail_runs, int64_t ntail, const void* const* seg_grads,
                                 const int64_t* seg_bounds, int64_t nseg, int avx512, float* undo_p,
                                 float* undo_m, float* undo_v) {
  if (out == nullptr) out_dtype = kNone;
  if (ntail > 0 && (grad_dtype != kF32 || out_dtype != kNone || fma == 0 || vsqrt != nullptr)) return 2;
  // streaming stores only where some element of the 16-bit copy is aligned for them
  const bool nt = n >= nt_min && (reinterpret_cast<uintptr_t>(out) & 1) == 0;
  RangeFn fn = avx512 ? avx512::pick(grad_dtype, out_dtype, nt, fma != 0, vsqrt != nullptr)
                      : avx2::pick(grad_dtype, out_dtype, nt, fma != 0, vsqrt != nullptr);
  if (fn == nullptr) return 1;
  const Args a{mult, decay, wd, w, beta2, omb2, bc2s, eps, nss, flags, std::fabs(w) < 0.5f,
               reinterpret_cast<VecSqrt>(vsqrt), vsqrt_mode};
  const int64_t out_size = out_dtype == kNone ? 0 : 2;
  const int64_t whole[2] = {0, n};
  if (nseg == 0) {
    seg_grads = &g;
    seg_bounds = whole;
    nseg = 1;
  }
  // [b, e) of piece k: the body up to each tail run, then the run; every pointer is moved to the piece's
  // first element (element i of the buffers is index i - origin of the moved pointers)
  auto piece = [&](int64_t k, int64_t b, int64_t e) {
    const int64_t origin = seg_bounds[2 * k];
    float *pk = p + origin, *mk = m + origin, *vk = v + origin;
    void* ok = out == nullptr ? nullptr : static_cast<char*>(out) + origin * out_size;
    const void* gk = seg_grads[k];
    int64_t lo = 0, hi = ntail;  // the first run that ends after b (binary search on the ends)
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (tail_runs[2 * mid + 1] <= b) lo = mid + 1;
      else hi = mid;
    }
    int64_t i = b;
    for (int64_t r = lo; r < ntail && tail_runs[2 * r] < e; ++r) {
      const int64_t run_start = std::max(tail_runs[2 * r], i), run_end = std::min(tail_runs[2 * r + 1], e);
      if (i < run_start) fn(pk, gk, mk, vk, ok, i - origin, run_start - origin, a);
      for (int64_t j = run_start; j < run_end; ++j)
        adam_tail1(pk, static_cast<const float*>(gk), mk, vk, j - origin, a);
      i = std::max(i, run_end);
    }
    if (i < e) fn(pk, gk, mk, vk, ok, i - origin, e - origin, a);
  };
  auto update = [&](int64_t b, int64_t e) {
    int64_t lo = 0, hi = nseg;  // the first piece that ends after b
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (seg_bounds[2 * mid + 1] <= b) lo = mid + 1;
      else hi = mid;
    }
    for (int64_t k = lo; k < nseg && seg_bounds[2 * k] < e; ++k)
      piece(k, std::max(seg_bounds[2 * k], b), std::min(seg_bounds[2 * k + 1], e));
  };
  if (undo_p == nullptr) {
    parallel_range(n, nthreads, 1 << 15, update);
    return 0;
  }
  parallel_range(n, nthreads, 1 << 15, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; s += kBlock) {  // a block of each buffer (768 KiB together) stays in the cache
      const int64_t se = std::min(e, s + kBlock);
      copy_streaming(undo_p, p, s, se);
      copy_streaming(undo_m, m, s, se);
      copy_streaming(undo_v, v, s, se);
      update(s, se);
    }
    _mm_sfence();  // this thread's streaming stores are visible before the region ends
  });
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
    avx2::V::load_grad2<kF16>(g, i, g0, g1);
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
    avx2::V::store_out2<kF16, true>(o, i, a0, a1);
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

// ---------------------------------------------------------------------------------------------------
// Sum of squares (the gradient norm's), in double. Every square is exact in double (a float has 24
// significant bits, its square at most 48), so only the additions round; they run in a fixed order
// within blocks of kNormBlock elements and the block sums are added in block order, so the result does
// not depend on the thread count.

namespace {

// parallel_range hands out ranges that start at multiples of kBlock: each is a whole number of norm blocks
constexpr int64_t kNormBlock = 1 << 16;
static_assert(kBlock % kNormBlock == 0, "a norm block must not straddle two ranges of parallel_range");

template <int D>
CM_TARGET double sum_squares_block(const void* x, int64_t begin, int64_t end) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m256 a, b;
    avx2::V::load_grad2<D>(x, i, a, b);
    const __m256d a0 = _mm256_cvtps_pd(_mm256_castps256_ps128(a)), a1 = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
    const __m256d b0 = _mm256_cvtps_pd(_mm256_castps256_ps128(b)), b1 = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
    acc[0] = _mm256_fmadd_pd(a0, a0, acc[0]);
    acc[1] = _mm256_fmadd_pd(a1, a1, acc[1]);
    acc[2] = _mm256_fmadd_pd(b0, b0, acc[2]);
    acc[3] = _mm256_fmadd_pd(b1, b1, acc[3]);
  }
  const __m256d sum = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  double lanes[4];
  _mm256_storeu_pd(lanes, sum);
  double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < end; ++i) {
    const double d = load_grad1<D>(x, i);
    total += d * d;
  }
  return total;
}

}  // namespace

// *out = the sum of the squares of the n elements at x (dtype: kF32, kF16 or kBF16). Returns 0, or 1 for
// an unknown dtype (nothing written).
CM_EXPORT int chunkmem_sum_squares(const void* x, int dtype, int64_t n, int nthreads, double* out) {
  double (*block)(const void*, int64_t, int64_t) = nullptr;
  if (dtype == kF32) block = sum_squares_block<kF32>;
  else if (dtype == kF16) block = sum_squares_block<kF16>;
  else if (dtype == kBF16) block = sum_squares_block<kBF16>;
  if (block == nullptr) return 1;
  std::vector<double> sums(size_t((n + kNormBlock - 1) / kNormBlock), 0.0);
  parallel_range(n, nthreads, kNormBlock, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; s += kNormBlock) sums[size_t(s / kNormBlock)] = block(x, s, std::min(e, s + kNormBlock));
  });
  double total = 0.0;
  for (double s : sums) total += s;
  *out = total;
  return 0;
}
