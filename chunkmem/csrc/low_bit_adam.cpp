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
//
// Segments of a chunk whose state is too small to quantize keep fp32 moments and skip the (de)quantization.
// The square root is the instruction set's, or the library function torch's Tensor.sqrt calls (MKL VML),
// handed in as a function pointer and applied to each block. Compiled with -ffp-contract=off: the only
// fused multiply-adds are the lerp's, written out as torch's vectorized kernel computes them.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#define CM_TARGET __attribute__((target("avx2,fma,f16c")))
#define CM_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kBlock = 256;
constexpr uint32_t kBuckets = 0x3f81;  // top 16 bits of a float of magnitude <= 1: 0 .. 0x3f80

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
  float lr, lr_wd, wd, w1, w2, bc1, bc2s, eps, mult;
};

struct Buffers {
  float* master;
  const void* grad;
  int grad_dtype;
  void* out;
  int out_dtype;
  uint8_t* m_codes;
  uint8_t* v_codes;
  float* m_scales;
  float* v_scales;
  float* m_plain;
  float* v_plain;
  const float* qmap_signed;
  const float* qmap_unsigned;
  const uint8_t* bucket_signed;    // largest code at or below each bucket's lowest value
  const uint8_t* bucket_unsigned;
  VecSqrt vsqrt;
  int64_t vsqrt_mode;
};

CM_TARGET inline float load_grad(const void* g, int dtype, int64_t i) {
  switch (dtype) {
    case kF32: return static_cast<const float*>(g)[i];
    case kF16: return _cvtsh_ss(static_cast<const uint16_t*>(g)[i]);
    default: {
      uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(g)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
  }
}

CM_TARGET inline void store_out(void* out, int dtype, int64_t i, float p) {
  if (dtype == kF16) {
    static_cast<uint16_t*>(out)[i] = _cvtss_sh(p, _MM_FROUND_TO_NEAREST_INT);
  } else if (dtype == kBF16) {
    uint32_t bits;
    std::memcpy(&bits, &p, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
      static_cast<uint16_t*>(out)[i] = static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
    } else {
      static_cast<uint16_t*>(out)[i] = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
  }
}

CM_TARGET inline float lerp(float self, float end, float w) {
  float d = end - self;
  return std::fabs(w) < 0.5f ? std::fma(w, d, self) : std::fma(-d, 1.0f - w, end);
}

// The code of the scaled value y: the largest map entry at or below y (0 where none is, and for NaN), plus one
// where y lies at least half-way to the next entry.
CM_TARGET inline uint8_t encode(float y, const float* qmap, const uint8_t* buckets) {
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  uint32_t top = bits >> 16, magnitude = top & 0x7fffu;
  int c;
  if (magnitude < kBuckets) {
    c = buckets[(top & 0x8000u) ? kBuckets + magnitude : magnitude];
    while (c < 255 && qmap[c + 1] <= y) ++c;
  } else if (std::isnan(y)) {
    return 0;
  } else {  // |y| > 1 (a block scale is its largest magnitude, so never for a finite block)
    c = y > 0.0f ? 255 : 0;
  }
  int up = std::min(c + 1, 255);
  float low = qmap[c], high = qmap[up];
  return static_cast<uint8_t>(y - low >= (high - low) * 0.5f ? up : c);
}

CM_TARGET void quantize_block(const float* values, int n, const float* qmap, const uint8_t* buckets, uint8_t* codes,
                              float* scale) {
  float absmax = 0.0f;
  bool nan = false;
  for (int i = 0; i < n; ++i) {
    float a = std::fabs(values[i]);
    nan |= std::isnan(a);
    absmax = a > absmax ? a : absmax;
  }
  float s = nan ? NAN : std::max(absmax, 1e-12f);
  *scale = s;
  for (int i = 0; i < n; ++i) codes[i] = encode(values[i] / s, qmap, buckets);
}

// One tile: up to 256 elements of one segment, from element `offset` of it.
CM_TARGET void update_tile(const Buffers& b, const Segment& s, int64_t offset, int n) {
  alignas(64) float g[kBlock], p[kBlock], m[kBlock], v[kBlock], root[kBlock];
  const int64_t at = s.start + offset;
  const bool quantized = s.flags & kQuantized;
  const int64_t block = s.state_base + offset / kBlock;
  for (int i = 0; i < n; ++i) g[i] = load_grad(b.grad, b.grad_dtype, at + i);
  if (s.flags & kApplyMult)
    for (int i = 0; i < n; ++i) g[i] = g[i] * s.mult;
  for (int i = 0; i < n; ++i) p[i] = b.master[at + i];
  if (s.flags & kDecoupled) {
    for (int i = 0; i < n; ++i) p[i] = p[i] - s.lr_wd * p[i];
  } else if (s.flags & kL2) {
    for (int i = 0; i < n; ++i) g[i] = g[i] + s.wd * p[i];
  }
  if (quantized) {
    const float ms = b.m_scales[block], vs = b.v_scales[block];
    for (int i = 0; i < n; ++i) m[i] = b.qmap_signed[b.m_codes[at + i]] * ms;
    for (int i = 0; i < n; ++i) v[i] = b.qmap_unsigned[b.v_codes[at + i]] * vs;
  } else {
    std::memcpy(m, b.m_plain + s.state_base + offset, sizeof(float) * n);
    std::memcpy(v, b.v_plain + s.state_base + offset, sizeof(float) * n);
  }
  for (int i = 0; i < n; ++i) m[i] = lerp(m[i], g[i], s.w1);
  for (int i = 0; i < n; ++i) v[i] = lerp(v[i], g[i] * g[i], s.w2);
  if (quantized) {
    quantize_block(m, n, b.qmap_signed, b.bucket_signed, b.m_codes + at, b.m_scales + block);
    quantize_block(v, n, b.qmap_unsigned, b.bucket_unsigned, b.v_codes + at, b.v_scales + block);
  } else {
    std::memcpy(b.m_plain + s.state_base + offset, m, sizeof(float) * n);
    std::memcpy(b.v_plain + s.state_base + offset, v, sizeof(float) * n);
  }
  if (b.vsqrt != nullptr) {
    b.vsqrt(n, v, root, b.vsqrt_mode);
  } else {
    for (int i = 0; i < n; ++i) root[i] = std::sqrt(v[i]);
  }
  for (int i = 0; i < n; ++i) {
    float d = root[i] / s.bc2s + s.eps;
    p[i] = p[i] - (s.lr * (m[i] / s.bc1)) / d;
  }
  for (int i = 0; i < n; ++i) b.master[at + i] = p[i];
  if (b.out != nullptr && b.out_dtype != kNone)
    for (int i = 0; i < n; ++i) store_out(b.out, b.out_dtype, at + i, p[i]);
}

void run_tiles(const Buffers& b, const Segment* segments, const std::vector<int64_t>& first_tile, int64_t begin,
               int64_t end) {
  int64_t k = std::upper_bound(first_tile.begin(), first_tile.end(), begin) - first_tile.begin() - 1;
  for (int64_t t = begin; t < end; ++t) {
    while (t >= first_tile[k + 1]) ++k;
    const Segment& s = segments[k];
    int64_t offset = (t - first_tile[k]) * kBlock;
    update_tile(b, s, offset, static_cast<int>(std::min<int64_t>(kBlock, s.n - offset)));
  }
}

}  // namespace

CM_EXPORT int chunkmem_low_bit_adam_abi() { return 1; }

CM_EXPORT int chunkmem_low_bit_adam_cpu_ok() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

CM_EXPORT int chunkmem_low_bit_buckets() { return static_cast<int>(kBuckets); }

// Updates every segment; returns 0, or -1 where a quantized segment is not made of whole blocks.
CM_EXPORT int chunkmem_low_bit_adam(const Buffers* buffers, const Segment* segments, int64_t count, int nthreads) {
  std::vector<int64_t> first_tile(count + 1, 0);
  for (int64_t k = 0; k < count; ++k) {
    if ((segments[k].flags & kQuantized) && segments[k].n % kBlock) return -1;
    first_tile[k + 1] = first_tile[k] + (segments[k].n + kBlock - 1) / kBlock;
  }
  const int64_t tiles = first_tile[count];
  int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, tiles / 64)));
  if (threads == 1) {
    run_tiles(*buffers, segments, first_tile, 0, tiles);
    return 0;
  }
  std::vector<std::thread> pool;
  for (int w = 1; w < threads; ++w)
    pool.emplace_back(run_tiles, std::cref(*buffers), segments, std::cref(first_tile), tiles * w / threads,
                      tiles * (w + 1) / threads);
  run_tiles(*buffers, segments, first_tile, 0, tiles / threads);
  for (auto& t : pool) t.join();
  return 0;
}
