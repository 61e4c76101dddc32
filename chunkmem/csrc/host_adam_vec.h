// The vector body of the host Adam update, written once over an instruction set.
//
// host_adam.cpp includes this file once per instruction set it compiles the update for, each time
// inside a namespace of its own, under a `#pragma GCC target` for that set, after defining there
//
//   struct V {                 // the instruction set
//     using F = ...;           // kLanes floats
//     using Mask = ...;        // a lane mask
//     static constexpr int kLanes;
//     set1, loadu, storeu, mul, add, sub, div, sqrt, fmadd, select(mask, a, b), mask(bool)
//     load_grad2<GD>(g, i, g0, g1)      2*kLanes gradient elements from i as floats
//     store_out2<OD, NT>(o, i, p0, p1)  2*kLanes 16-bit copies from i (NT: streaming, aligned)
//   };
//
// Every operation rounds as IEEE 754 prescribes whatever the width, so both instruction sets give
// the same bits (tests/test_host_adam_kernel.py compares them). One iteration of the loops handles
// 2*kLanes elements: two vectors, so that the 16-bit copy of an iteration is one aligned vector store.
// The helpers of the loops are CM_INLINE (always inlined): one left out of line costs the loop half its
// speed (its vectors pass through memory).

constexpr int64_t kStep = 2 * V::kLanes;
// The 16-bit copy of one iteration, in bytes: what a streaming store of it must be aligned to.
constexpr int64_t kOutBytes = kStep * 2;

template <bool FMA>
CM_INLINE V::F vmadd(V::F a, V::F b, V::F c) {
  if constexpr (FMA) return V::fmadd(a, b, c);
  else return V::add(V::mul(a, b), c);
}

// The scalars broadcast to the lanes. The gradient multiplier and the decoupled decay are 1 where the
// update has none: x * 1 == x exactly (a signalling NaN comes out quiet, which the first subtraction
// would do anyway), so the vector loop multiplies unconditionally instead of testing two flags per
// vector; with fewer instructions in flight per element the core runs further ahead on the loads.
struct Lanes {
  V::F mult, decay, wd, w, beta2, omb2, bc2s, eps, nss;
  V::Mask small;  // set where |w| < 0.5: the lerp's first branch
  bool decoupled, l2;
  // sqrt(v) / 1 == sqrt(v) exactly: with bias correction off, or once 1 - beta2^step rounds to 1 (after
  // some 17,000 steps with beta2 = 0.999), skip that division (a third of the divider's work)
  bool div_bc2;

  explicit Lanes(const Args& a)
      : mult(V::set1(a.flags & kApplyMult ? a.mult : 1.0f)),
        decay(V::set1(a.flags & kDecoupled ? a.decay : 1.0f)), wd(V::set1(a.wd)),
        w(V::set1(a.small ? a.w : a.w - 1.0f)), beta2(V::set1(a.beta2)), omb2(V::set1(a.omb2)),
        bc2s(V::set1(a.bc2s)), eps(V::set1(a.eps)), nss(V::set1(a.nss)), small(V::mask(a.small)),
        decoupled(a.flags & kDecoupled), l2(a.flags & kL2), div_bc2(a.bc2s != 1.0f) {}
};

// One vector: p, m, v in registers become the decayed master and the new moments (g: fp32 gradient).
template <bool FMA>
CM_INLINE void moments(const Lanes& c, V::F g, V::F& p, V::F& m, V::F& v) {
  g = V::mul(g, c.mult);
  p = V::mul(p, c.decay);
  if (c.l2) g = vmadd<FMA>(p, c.wd, g);
  m = vmadd<FMA>(c.w, V::sub(g, m), V::select(c.small, m, g));
  v = vmadd<FMA>(V::mul(c.omb2, g), g, V::mul(v, c.beta2));
}

// One vector: the updated master from the decayed one, exp_avg and sqrt(exp_avg_sq).
CM_INLINE V::F finish(const Lanes& c, V::F p, V::F m, V::F sqrt_v) {
  V::F d = c.div_bc2 ? V::div(sqrt_v, c.bc2s) : sqrt_v;
  d = V::add(d, c.eps);
  return V::add(p, V::div(V::mul(c.nss, m), d));
}

// The first element at or after i from which the 16-bit copy is kOutBytes-aligned (streaming stores).
inline int64_t aligned_from(const void* out, int64_t i, int64_t end) {
  while (i < end && (reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(out) + i) % kOutBytes) != 0) ++i;
  return i;
}

// Asks for the cache lines kPrefetchAhead elements ahead of the iteration at i in the streams read.
// Prefetches past the end of a buffer are harmless: they never fault.
template <int GD>
CM_INLINE void prefetch_ahead(const float* p, const void* g, const float* m, const float* v, int64_t i) {
  const int64_t j = i + kPrefetchAhead;
  for (int64_t k = 0; k < kStep; k += 16) {  // 16 fp32 elements a line
    _mm_prefetch(reinterpret_cast<const char*>(p + j + k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + j + k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v + j + k), _MM_HINT_T0);
    if constexpr (GD == kF32)
      _mm_prefetch(reinterpret_cast<const char*>(static_cast<const float*>(g) + j + k), _MM_HINT_T0);
  }
  if constexpr (GD != kF32)  // 32 16-bit elements a line: one line for every iteration of 32
    _mm_prefetch(reinterpret_cast<const char*>(static_cast<const uint16_t*>(g) + j), _MM_HINT_T0);
}

// Two vectors of a buffer: what one iteration reads or writes of it.
struct Pair {
  V::F lo, hi;
};

CM_INLINE Pair load2(const float* x, int64_t i) { return {V::loadu(x + i), V::loadu(x + i + V::kLanes)}; }

CM_INLINE void store2(float* x, int64_t i, Pair a) {
  V::storeu(x + i, a.lo);
  V::storeu(x + i + V::kLanes, a.hi);
}

// The iteration at i up to the square root: reads its gradient and buffers, leaves the decayed master
// and the new moments in pm, mm, vm.
template <int GD, bool FMA>
CM_INLINE void iteration_moments(const Lanes& c, const float* p, const void* g, const float* m, const float* v,
                                 int64_t i, Pair& pm, Pair& mm, Pair& vm) {
  prefetch_ahead<GD>(p, g, m, v, i);
  V::F g0, g1;
  V::template load_grad2<GD>(g, i, g0, g1);
  pm = load2(p, i);
  mm = load2(m, i);
  vm = load2(v, i);
  moments<FMA>(c, g0, pm.lo, mm.lo, vm.lo);
  moments<FMA>(c, g1, pm.hi, mm.hi, vm.hi);
}

// One pass, everything in registers; the instruction set's square root.
template <int GD, int OD, bool FMA, bool NT>
void adam_range_vec(float* __restrict p, const void* __restrict g, float* __restrict m, float* __restrict v,
                    void* __restrict out, int64_t begin, int64_t end, const Args& a) {
  const Lanes c(a);
  int64_t i = begin;
  if constexpr (NT) {
    for (const int64_t head = aligned_from(out, i, end); i < head; ++i) adam_scalar<GD, OD, FMA>(p, g, m, v, out, i, a);
  }
  for (; i + kStep <= end; i += kStep) {
    Pair pm, mm, vm;
    iteration_moments<GD, FMA>(c, p, g, m, v, i, pm, mm, vm);
    pm = {finish(c, pm.lo, mm.lo, V::sqrt(vm.lo)), finish(c, pm.hi, mm.hi, V::sqrt(vm.hi))};
    store2(p, i, pm);
    store2(m, i, mm);
    store2(v, i, vm);
    V::template store_out2<OD, NT>(out, i, pm.lo, pm.hi);
  }
  for (; i < end; ++i) adam_scalar<GD, OD, FMA>(p, g, m, v, out, i, a);
  if constexpr (NT) _mm_sfence();
}

// Tiles of kTile elements (a multiple of kStep), small enough for the L1 cache: the moments of a tile,
// then a.vsqrt over its exp_avg_sq into a buffer, then its masters. The same memory traffic as the one
// pass (the tile is re-read from cache), for a square root that rounds like the library torch's own
// sqrt calls.
template <int GD, int OD, bool FMA, bool NT>
void adam_range_tiled(float* __restrict p, const void* __restrict g, float* __restrict m, float* __restrict v,
                      void* __restrict out, int64_t begin, int64_t end, const Args& a) {
  static_assert(kTile % kStep == 0, "a tile is a whole number of iterations");
  const Lanes c(a);
  alignas(64) float sqrt_v[kTile];
  // with streaming stores, a first (short) tile up to where the 16-bit copy is aligned, so that every
  // later tile's vector stores are
  int64_t stop = NT ? aligned_from(out, begin, end) : begin;
  if (stop == begin) stop = std::min(end, begin + kTile);
  for (int64_t t = begin; t < end; t = stop, stop = std::min(end, t + kTile)) {
    int64_t i = t;
    for (; i + kStep <= stop; i += kStep) {
      Pair pm, mm, vm;
      iteration_moments<GD, FMA>(c, p, g, m, v, i, pm, mm, vm);
      if (c.decoupled) store2(p, i, pm);
      store2(m, i, mm);
      store2(v, i, vm);
    }
    for (; i < stop; ++i) moments1<GD, FMA>(p, g, m, v, i, a);
    a.vsqrt(stop - t, v + t, sqrt_v, a.vsqrt_mode);
    for (i = t; i + kStep <= stop; i += kStep) {
      const Pair pm = load2(p, i), mm = load2(m, i), sqrt_vm = load2(sqrt_v, i - t);
      const Pair updated = {finish(c, pm.lo, mm.lo, sqrt_vm.lo), finish(c, pm.hi, mm.hi, sqrt_vm.hi)};
      store2(p, i, updated);
      V::template store_out2<OD, NT>(out, i, updated.lo, updated.hi);
    }
    for (; i < stop; ++i) finish1<OD>(p, m, out, i, sqrt_v[i - t], a);
  }
  if constexpr (NT) _mm_sfence();
}

template <int GD, int OD, bool FMA, bool TILED>
RangeFn pick_nt(bool nt) {
  if constexpr (OD == kF16 || OD == kBF16) {
    if (nt) return TILED ? &adam_range_tiled<GD, OD, FMA, true> : &adam_range_vec<GD, OD, FMA, true>;
  }
  return TILED ? &adam_range_tiled<GD, OD, FMA, false> : &adam_range_vec<GD, OD, FMA, false>;
}

template <int GD, bool FMA, bool TILED>
RangeFn pick_out(int od, bool nt) {
  switch (od) {
    case kF16: return pick_nt<GD, kF16, FMA, TILED>(nt);
    case kBF16: return pick_nt<GD, kBF16, FMA, TILED>(nt);
    case kNone: return pick_nt<GD, kNone, FMA, TILED>(nt);
    default: return nullptr;
  }
}

template <bool FMA, bool TILED>
RangeFn pick_grad(int gd, int od, bool nt) {
  switch (gd) {
    case kF32: return pick_out<kF32, FMA, TILED>(od, nt);
    case kF16: return pick_out<kF16, FMA, TILED>(od, nt);
    case kBF16: return pick_out<kBF16, FMA, TILED>(od, nt);
    default: return nullptr;
  }
}

// The range function for a combination of dtypes and variants; nullptr for one it has none for.
inline RangeFn pick(int gd, int od, bool nt, bool fma, bool tiled) {
  if (fma) return tiled ? pick_grad<true, true>(gd, od, nt) : pick_grad<true, false>(gd, od, nt);
  return tiled ? pick_grad<false, true>(gd, od, nt) : pick_grad<false, false>(gd, od, nt);
}
