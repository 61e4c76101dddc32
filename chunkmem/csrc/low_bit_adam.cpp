// One-pass Adam/AdamW update with blockwise 8-bit moments on the host (x86-64: AVX2 + FMA + F16C).
//
// Plain C ABI, loaded with ctypes by chunkmem/optim/low_bit_adam.py. For each block of 256 elements it
// dequantizes exp_avg and exp_avg_sq (code's map entry * block scale), updates master, moments and the
// 16-bit parameter copy in fp32, and quantizes the new moments (absmax scale, nearest map entry, ties up),
// reading and writing each byte once. The arithmetic mirrors, operation by operation and rounding by
// rounding, the torch-op formulation in chunkmem/optim/low_bit_adam.py (torchao's AdamW8bit / Adam8bit step
// run eagerly), which the Python side checks bit for bit when it loads this library:
//
//   g = float(grad) [* mult]
//   p = p - lr_wd * p                 (AdamW)        g = g + wd * p        (Adam)
//   m = lerp(deq(m), g, w1)           torch's lerp: |w| < 0.5 ? fma(w, g - m, m) : fma(-(g - m), 1 - w, g)
//   v = lerp(deq(v), g * g, w2)
//   codes, scales = quantize(m), quantize(v)          (the update reads the unquantized m and v)
//   d = sqrt(v) / bc2s + eps
//   p = p - (lr * (m / bc1)) / d
//   out = half/bfloat16(p), round to nearest even
//   (or, where bf16 parameters are their own masters: p = bf16(p) rounded stochastically, as torchao's
//   bf16_stochastic_round, with random numbers drawn by the caller)
//
// Segments of a chunk whose state is too small to quantize keep fp32 moments and skip the (de)quantization.
// The square root is the instruction set's, or the library function torch's Tensor.sqrt calls (MKL VML),
// handed in as a function pointer and applied to each tile of kTile elements. Compiled with -ffp-contract=off:
// the only fused multiply-adds are the lerp's, written out as torch's vectorized kernel computes them. The tiles
// are spread over torch's OpenMP threads (parallel_range.h).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel_range.h"

#define CM_TARGET __attribute__((target("avx2,fma,f16c")))
#define CM_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kBlock = 256;
constexpr int kTile = 1024;  // elements updated together, a multiple of kBlock
// Quantizing is counting: the code of a scaled value y is the number of the map's 255 rounding thresholds (the
// smallest floats that round up past each entry) at or below y. Floats are compared as order-preserving
// unsigned keys (negative ones bit-inverted, positive ones with the sign bit set); the keys of |y| <= 1 fall in
// the buckets kFirstBucket .. kFirstBucket + kBuckets - 1 of their top 16 bits, and each bucket holds at most
// one threshold (the Python side checks it). A bucket's word: the count of thresholds below it << 17 | the
// low 16 bits of its threshold's key (0x10000: none).
constexpr int32_t kFirstBucket = 0x407f;
constexpr int32_t kBuckets = 0xbf80 - kFirstBucket + 1;

enum DType : int { kNone = -1, kF32 = 0, kF16 = 1, kBF16 = 2 };
enum Flags : int { kApplyMult = 1, kDecoupled = 2, kL2 = 4, kQuantized = 8 };

using VecSqrt = void (*)(int64_t n, const float* a, float* r, int64_t mode);

// One run of elements updated with one set of hyper-parameters (a parameter, or this rank's piece of it).
struct Segment {
  int64_t start;       // first element in the chunk's buffers
  int64_t n;           // elements; a multiple of 256 where quantized
  int64_t state_base;  // quantized: index of its first block scale; else of its first fp32 moment
  int32_t flags;
  int32_t pad;
  int64_t random_base; // with bf16 masters: index of its first random number
  float lr, lr_wd, wd, w1, w2, bc1, bc2s, eps, mult;
};

struct Buffers {
  void* master;           // fp32, or bf16 parameters that are their own masters (rounded stochastically)
  int master_dtype;
  const int32_t* random;  // with bf16 masters: one number in [0, 2^16) per element, per segment in order
  const void* grad;
  int grad_dtype;
  void* out;
  int out_dtype;
  uint8_t* m_codes;
  uint8_t* v_codes;
  float* m_scales;
  float* v_scales;
  void* m_plain;          // fp32, or bf16 beside bf16 masters (as the reference keeps a small bf16 tensor's state)
  void* v_plain;
  int plain_dtype;
  const float* qmap_signed;
  const float* qmap_unsigned;
  const uint32_t* words_signed;    // kBuckets words each (see kFirstBucket)
  const uint32_t* words_unsigned;
  VecSqrt vsqrt;
  int64_t vsqrt_mode;
};

CM_TARGET void load_grad(const void* grad, int dtype, int64_t at, int n, float* g) {
  if (dtype == kF32) {
    std::memcpy(g, static_cast<const float*>(grad) + at, sizeof(float) * n);
  } else if (dtype == kBF16) {
    const uint16_t* h = static_cast<const uint16_t*>(grad) + at;
    for (int i = 0; i < n; ++i) {
      uint32_t bits = static_cast<uint32_t>(h[i]) << 16;
      std::memcpy(g + i, &bits, 4);
    }
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(grad) + at;
    int i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(g + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
    for (; i < n; ++i) g[i] = _cvtsh_ss(h[i]);
  }
}

// The 16-bit copy, rounded to nearest even (a NaN stays a quiet NaN).
CM_TARGET void store_out(void* out, int dtype, int64_t at, int n, const float* p) {
  uint16_t* h = static_cast<uint16_t*>(out) + at;
  if (dtype == kBF16) {
    for (int i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, p + i, 4);
      uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
      h[i] = static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded);
    }
  } else if (dtype == kF16) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(p + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) h[i] = _cvtss_sh(p[i], _MM_FROUND_TO_NEAREST_INT);
  }
}

// Eight codes (int32) of the scaled values y; lanes whose |y| > 1 or NaN (a block that is not finite) are
// encoded one by one: NaN takes code 0, a value above 1 the last code, one below -1 the first.
CM_TARGET inline __m256i encode8(__m256 y, const uint32_t* words) {
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i flip = _mm256_or_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(INT32_MIN));
  const __m256i key = _mm256_xor_si256(bits, flip);
  const __m256i bucket = _mm256_sub_epi32(_mm256_srli_epi32(key, 16), _mm256_set1_epi32(kFirstBucket));
  const __m256i outside = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_setzero_si256(), bucket),
                                          _mm256_cmpgt_epi32(bucket, _mm256_set1_epi32(kBuckets - 1)));
  const __m256i word = _mm256_i32gather_epi32(reinterpret_cast<const int*>(words),
                                              _mm256_andnot_si256(outside, bucket), 4);
  const __m256i below = _mm256_srli_epi32(word, 17);
  const __m256i threshold = _mm256_and_si256(word, _mm256_set1_epi32(0x1ffff));
  const __m256i low = _mm256_and_si256(key, _mm256_set1_epi32(0xffff));
  __m256i code = _mm256_sub_epi32(below, _mm256_cmpgt_epi32(low, _mm256_sub_epi32(threshold, _mm256_set1_epi32(1))));
  if (_mm256_movemask_ps(_mm256_castsi256_ps(outside))) {
    alignas(32) float lanes[8];
    alignas(32) int32_t codes[8];
    _mm256_store_ps(lanes, y);
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes), code);
    for (int i = 0; i < 8; ++i)
      if (std::isnan(lanes[i]) || std::fabs(lanes[i]) > 1.0f) codes[i] = lanes[i] > 1.0f ? 255 : 0;
    code = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes));
  }
  return code;
}

// The block's scale from its values' largest magnitude (lanes of `largest`) and whether one is NaN (lanes of
// `nan`): NaN for a block that is not finite, else at least 1e-12.
CM_TARGET inline float block_scale(__m256 largest, __m256 nan) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  float absmax = 0.0f;
  for (float a : lanes) absmax = std::max(absmax, a);
  return _mm256_movemask_ps(nan) ? NAN : std::max(absmax, 1e-12f);
}

// A block's codes: each value divided by the block's scale, then counted against the map's thresholds.
CM_TARGET void encode_block(const float* values, float scale, const uint32_t* words, uint8_t* codes) {
  alignas(32) int32_t wide[kBlock];
  const __m256 vs = _mm256_set1_ps(scale);
  for (int i = 0; i < kBlock; i += 8)
    _mm256_store_si256(reinterpret_cast<__m256i*>(wide + i), encode8(_mm256_div_ps(_mm256_loadu_ps(values + i), vs), words));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' interleaving of lanes
  for (int i = 0; i < kBlock; i += 32) {
    const __m256i* w = reinterpret_cast<const __m256i*>(wide + i);
    const __m256i low = _mm256_packs_epi32(_mm256_load_si256(w), _mm256_load_si256(w + 1));
    const __m256i high = _mm256_packs_epi32(_mm256_load_si256(w + 2), _mm256_load_si256(w + 3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i),
                        _mm256_permutevar8x32_epi32(_mm256_packus_epi16(low, high), order));
  }
}

// Eight scalar loads beat one gather on the CPUs measured (Zen 3: 0.26 against 0.50 ns an element).
CM_TARGET inline __m256 lookup8(const float* table, const uint8_t* codes) {
  uint64_t w;
  std::memcpy(&w, codes, 8);
  return _mm256_setr_ps(table[w & 255], table[(w >> 8) & 255], table[(w >> 16) & 255], table[(w >> 24) & 255],
                        table[(w >> 32) & 255], table[(w >> 40) & 255], table[(w >> 48) & 255], table[w >> 56]);
}

CM_TARGET void store_plain(void* state, int dtype, int64_t at, int n, const float* values) {
  if (dtype == kF32) {
    std::memcpy(static_cast<float*>(state) + at, values, sizeof(float) * n);
  } else {
    store_out(state, dtype, at, n, values);
  }
}

// bf16 by stochastic rounding: away from zero where the random number is below the 16 bits cut off (with the
// probability of their share of a unit in the last place), else towards zero.
CM_TARGET void store_stochastic(uint16_t* out, const int32_t* random, int n, const float* p) {
  for (int i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, 4);
    uint32_t kept = bits & 0xffff0000u;
    out[i] = static_cast<uint16_t>(((static_cast<uint32_t>(random[i]) < (bits & 0xffffu)) ? kept + 0x10000u : kept) >> 16);
  }
}

// torch's lerp(a, b, w) as its vectorized kernel computes it: |w| < 0.5 ? fma(w, b - a, a) : fma(-(b - a), 1 - w, b).
CM_TARGET inline __m256 lerp8(__m256 a, __m256 b, __m256 w, __m256 rest, bool small) {
  const __m256 d = _mm256_sub_ps(b, a);
  return small ? _mm256_fmadd_ps(w, d, a) : _mm256_fnmadd_ps(d, rest, b);
}

// The first half of a step on elements whose moments are quantized, eight at a time and block by block: the
// gradient (times the multiplier), the weight decay, the moments dequantized and moved towards the gradient and
// its square, and each block's new scales (written over the old ones once read). In: g (gradient), p
// (master); out: p, m, v.
CM_TARGET void quantized_moments(const Buffers& b, const Segment& s, int64_t at, int64_t block, int n, const float* g,
                                 float* p, float* m, float* v) {
  const bool apply_mult = s.flags & kApplyMult, decoupled = s.flags & kDecoupled, l2 = s.flags & kL2;
  const bool small1 = std::fabs(s.w1) < 0.5f, small2 = std::fabs(s.w2) < 0.5f;
  const __m256 mult = _mm256_set1_ps(s.mult), lr_wd = _mm256_set1_ps(s.lr_wd), wd = _mm256_set1_ps(s.wd);
  const __m256 w1 = _mm256_set1_ps(s.w1), rest1 = _mm256_set1_ps(1.0f - s.w1);
  const __m256 w2 = _mm256_set1_ps(s.w2), rest2 = _mm256_set1_ps(1.0f - s.w2);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int k = 0; k < n; k += kBlock) {
    const __m256 scale_m = _mm256_set1_ps(b.m_scales[block + k / kBlock]);
    const __m256 scale_v = _mm256_set1_ps(b.v_scales[block + k / kBlock]);
    __m256 largest_m = _mm256_setzero_ps(), nan_m = _mm256_setzero_ps();
    __m256 largest_v = _mm256_setzero_ps(), nan_v = _mm256_setzero_ps();
    for (int i = k; i < k + kBlock; i += 8) {
      __m256 gi = _mm256_load_ps(g + i), pi = _mm256_load_ps(p + i);
      if (apply_mult) gi = _mm256_mul_ps(gi, mult);
      if (decoupled) {
        pi = _mm256_sub_ps(pi, _mm256_mul_ps(lr_wd, pi));
      } else if (l2) {
        gi = _mm256_add_ps(gi, _mm256_mul_ps(wd, pi));
      }
      const __m256 mi = _mm256_mul_ps(lookup8(b.qmap_signed, b.m_codes + at + i), scale_m);
      const __m256 vi = _mm256_mul_ps(lookup8(b.qmap_unsigned, b.v_codes + at + i), scale_v);
      const __m256 new_m = lerp8(mi, gi, w1, rest1, small1);
      const __m256 new_v = lerp8(vi, _mm256_mul_ps(gi, gi), w2, rest2, small2);
      _mm256_store_ps(p + i, pi);
      _mm256_store_ps(m + i, new_m);
      _mm256_store_ps(v + i, new_v);
      const __m256 abs_m = _mm256_and_ps(new_m, magnitude), abs_v = _mm256_and_ps(new_v, magnitude);
      nan_m = _mm256_or_ps(nan_m, _mm256_cmp_ps(abs_m, abs_m, _CMP_UNORD_Q));
      nan_v = _mm256_or_ps(nan_v, _mm256_cmp_ps(abs_v, abs_v, _CMP_UNORD_Q));
      largest_m = _mm256_max_ps(largest_m, abs_m);
      largest_v = _mm256_max_ps(largest_v, abs_v);
    }
    b.m_scales[block + k / kBlock] = block_scale(largest_m, nan_m);
    b.v_scales[block + k / kBlock] = block_scale(largest_v, nan_v);
  }
}

// The same for moments kept plain (fp32, or bf16 beside bf16 masters), element by element.
CM_TARGET void plain_moments(const Buffers& b, const Segment& s, int64_t offset, int n, float* g, float* p, float* m,
                             float* v) {
  if (s.flags & kApplyMult)
    for (int i = 0; i < n; ++i) g[i] = g[i] * s.mult;
  if (s.flags & kDecoupled) {
    for (int i = 0; i < n; ++i) p[i] = p[i] - s.lr_wd * p[i];
  } else if (s.flags & kL2) {
    for (int i = 0; i < n; ++i) g[i] = g[i] + s.wd * p[i];
  }
  load_grad(b.m_plain, b.plain_dtype, s.state_base + offset, n, m);
  load_grad(b.v_plain, b.plain_dtype, s.state_base + offset, n, v);
  if (std::fabs(s.w1) < 0.5f) {
    for (int i = 0; i < n; ++i) m[i] = std::fma(s.w1, g[i] - m[i], m[i]);
  } else {
    const float rest = 1.0f - s.w1;
    for (int i = 0; i < n; ++i) m[i] = std::fma(-(g[i] - m[i]), rest, g[i]);
  }
  for (int i = 0; i < n; ++i) g[i] = g[i] * g[i];
  if (std::fabs(s.w2) < 0.5f) {
    for (int i = 0; i < n; ++i) v[i] = std::fma(s.w2, g[i] - v[i], v[i]);
  } else {
    const float rest = 1.0f - s.w2;
    for (int i = 0; i < n; ++i) v[i] = std::fma(-(g[i] - v[i]), rest, g[i]);
  }
}

// One tile: up to kTile elements of one segment, from element `offset` of it (a multiple of kTile); the
// square root of a whole tile is one call, as MKL's has a cost per call.
CM_TARGET void update_tile(const Buffers& b, const Segment& s, int64_t offset, int n) {
  alignas(64) float g[kTile], p[kTile], m[kTile], v[kTile], root[kTile];
  const int64_t at = s.start + offset;
  const bool quantized = s.flags & kQuantized;
  load_grad(b.grad, b.grad_dtype, at, n, g);
  if (b.master_dtype == kBF16) {
    load_grad(b.master, kBF16, at, n, p);
  } else {
    std::memcpy(p, static_cast<float*>(b.master) + at, sizeof(float) * n);
  }
  const int64_t block = s.state_base + offset / kBlock;
  if (quantized) {
    quantized_moments(b, s, at, block, n, g, p, m, v);
  } else {
    plain_moments(b, s, offset, n, g, p, m, v);
  }
  if (quantized) {
    for (int k = 0; k < n; k += kBlock) {
      encode_block(m + k, b.m_scales[block + k / kBlock], b.words_signed, b.m_codes + at + k);
      encode_block(v + k, b.v_scales[block + k / kBlock], b.words_unsigned, b.v_codes + at + k);
    }
  } else {
    store_plain(b.m_plain, b.plain_dtype, s.state_base + offset, n, m);
    store_plain(b.v_plain, b.plain_dtype, s.state_base + offset, n, v);
  }
  if (b.vsqrt != nullptr) {
    b.vsqrt(n, v, root, b.vsqrt_mode);
  } else {
    for (int i = 0; i < n; ++i) root[i] = std::sqrt(v[i]);
  }
  for (int i = 0; i < n; ++i) p[i] = p[i] - (s.lr * (m[i] / s.bc1)) / (root[i] / s.bc2s + s.eps);
  if (b.master_dtype == kBF16) {
    store_stochastic(static_cast<uint16_t*>(b.master) + at, b.random + s.random_base + offset, n, p);
  } else {
    std::memcpy(static_cast<float*>(b.master) + at, p, sizeof(float) * n);
  }
  if (b.out != nullptr && b.out_dtype != kNone) store_out(b.out, b.out_dtype, at, n, p);
}

void run_tiles(const Buffers& b, const Segment* segments, const std::vector<int64_t>& first_tile, int64_t begin,
               int64_t end) {
  int64_t k = std::upper_bound(first_tile.begin(), first_tile.end(), begin) - first_tile.begin() - 1;
  for (int64_t t = begin; t < end; ++t) {
    while (t >= first_tile[k + 1]) ++k;
    const Segment& s = segments[k];
    int64_t offset = (t - first_tile[k]) * kTile;
    update_tile(b, s, offset, static_cast<int>(std::min<int64_t>(kTile, s.n - offset)));
  }
}

}  // namespace

CM_EXPORT int chunkmem_low_bit_adam_abi() { return 6; }

CM_EXPORT int chunkmem_low_bit_adam_cpu_ok() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

CM_EXPORT int chunkmem_low_bit_first_bucket() { return kFirstBucket; }
CM_EXPORT int chunkmem_low_bit_buckets() { return kBuckets; }

// Updates every segment; returns 0, or -1 where a quantized segment is not made of whole blocks. The threads take
// 16 tiles at a time (parallel_range.h), at least 16 tiles each.
CM_EXPORT int chunkmem_low_bit_adam(const Buffers* buffers, const Segment* segments, int64_t count, int nthreads) {
  std::vector<int64_t> first_tile(count + 1, 0);
  for (int64_t k = 0; k < count; ++k) {
    if ((segments[k].flags & kQuantized) && segments[k].n % kBlock) return -1;
    first_tile[k + 1] = first_tile[k] + (segments[k].n + kTile - 1) / kTile;
  }
  parallel_range(first_tile[count], nthreads, 16, 16, [&](int64_t begin, int64_t end) {
    run_tiles(*buffers, segments, first_tile, begin, end);
  });
  return 0;
}

// Whether the library runs its threads on the OpenMP runtime (built with -fopenmp).
CM_EXPORT int chunkmem_low_bit_adam_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}
