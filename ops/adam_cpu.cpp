// Fused chunk Adam on CPU: one pass over a flat slice reads the low-precision
// gradient, updates the fp32 master/exp_avg/exp_avg_sq and writes the new
// low-precision parameter (see ds_patrickstar/adam_math.py), in place or from
// one set of buffers into another (adam_step_from).
//
// The SIMD width is fixed at compile time by what the build machine supports
// (ds_patrickstar/kernels.py passes -mavx512f... or -mavx2 -mfma -mf16c after
// detecting the CPU); without either, a portable scalar path is compiled.
// Threads: OpenMP over 64K-element blocks handed out dynamically (a thread
// descheduled on a busy machine does not hold up the others),
// at::get_num_threads() of them.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "ds_adam_checks.h"
#include "ds_adam_math.h"

namespace ds_patrickstar {
namespace {

// ---------------------------------------------------------------- scalar conversions
inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16_bits(float f) {  // round to nearest even, as c10::BFloat16
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct LpFloat {
  using storage = float;
  static inline float load(const storage* p) { return *p; }
  static inline void store(storage* p, float f) { *p = f; }
};
struct LpBF16 {
  using storage = uint16_t;
  static inline float load(const storage* p) { return bf16_bits_to_float(*p); }
  static inline void store(storage* p, float f) { *p = float_to_bf16_bits(f); }
};
struct LpHalf {
  using storage = c10::Half;
  static inline float load(const storage* p) { return static_cast<float>(*p); }
  static inline void store(storage* p, float f) { *p = c10::Half(f); }
};

// ---------------------------------------------------------------- SIMD vectors
#if defined(__AVX512F__)
#define DSPS_SIMD_NAME "avx512"
#define DSPS_HAVE_SIMD 1
constexpr int kVec = 16;
struct VecF {
  __m512 v;
  VecF() = default;
  explicit VecF(float f) : v(_mm512_set1_ps(f)) {}
  VecF(__m512 x) : v(x) {}
  static VecF load(const float* p) { return _mm512_loadu_ps(p); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void stream(float* p) const { _mm512_stream_ps(p, v); }  // p aligned to the vector
};
inline VecF operator+(VecF a, VecF b) { return _mm512_add_ps(a.v, b.v); }
inline VecF operator-(VecF a, VecF b) { return _mm512_sub_ps(a.v, b.v); }
inline VecF operator*(VecF a, VecF b) { return _mm512_mul_ps(a.v, b.v); }
inline VecF operator/(VecF a, VecF b) { return _mm512_div_ps(a.v, b.v); }
inline VecF dsps_fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }
inline VecF dsps_sqrt(VecF a) { return _mm512_sqrt_ps(a.v); }

inline VecF vload(const LpFloat::storage* p) { return _mm512_loadu_ps(p); }
inline void vstore(LpFloat::storage* p, VecF x) { _mm512_storeu_ps(p, x.v); }
inline VecF vload(const LpBF16::storage* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void vstore(LpBF16::storage* p, VecF x) {
  // Round to nearest even (bit-exact with c10::BFloat16 / torch's copy_), NaN -> 0x7FC0.
  __m512i u = _mm512_castps_si512(x.v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  u = _mm512_srli_epi32(u, 16);
  __mmask16 nan = _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q);
  u = _mm512_mask_mov_epi32(u, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(u));
}
inline VecF vload(const LpHalf::storage* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore(LpHalf::storage* p, VecF x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DSPS_SIMD_NAME "avx2"
#define DSPS_HAVE_SIMD 1
constexpr int kVec = 8;
struct VecF {
  __m256 v;
  VecF() = default;
  explicit VecF(float f) : v(_mm256_set1_ps(f)) {}
  VecF(__m256 x) : v(x) {}
  static VecF load(const float* p) { return _mm256_loadu_ps(p); }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void stream(float* p) const { _mm256_stream_ps(p, v); }  // p aligned to the vector
};
inline VecF operator+(VecF a, VecF b) { return _mm256_add_ps(a.v, b.v); }
inline VecF operator-(VecF a, VecF b) { return _mm256_sub_ps(a.v, b.v); }
inline VecF operator*(VecF a, VecF b) { return _mm256_mul_ps(a.v, b.v); }
inline VecF operator/(VecF a, VecF b) { return _mm256_div_ps(a.v, b.v); }
inline VecF dsps_fma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
inline VecF dsps_sqrt(VecF a) { return _mm256_sqrt_ps(a.v); }

inline VecF vload(const LpFloat::storage* p) { return _mm256_loadu_ps(p); }
inline void vstore(LpFloat::storage* p, VecF x) { _mm256_storeu_ps(p, x.v); }
inline VecF vload(const LpBF16::storage* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void vstore(LpBF16::storage* p, VecF x) {
  __m256i u = _mm256_castps_si256(x.v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  u = _mm256_srli_epi32(u, 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q));
  u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7FC0), nan);
  // 32 -> 16 bit: values are < 2^16 so unsigned saturation is exact; fix the lane order.
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline VecF vload(const LpHalf::storage* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vstore(LpHalf::storage* p, VecF x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
#define DSPS_SIMD_NAME "scalar"
constexpr int kVec = 1;
#endif

// Elements per OpenMP work item: big enough to amortize scheduling, small
// enough to balance 2..64 threads on a few-MB slice. Multiple of 2*kVec.
constexpr int64_t kBlock = 1 << 16;
// Below this many elements one thread does it all (thread wake-up costs more).
constexpr int64_t kMinParallel = 1 << 15;

// A slice's sources (the gradient in the low-precision slot, master, exp_avg, exp_avg_sq) and destinations
// (the new low-precision parameter and states): the same buffers for the step in place, others for an update
// into spare buffers (see [Note: host updates in backward] in ds_patrickstar/optim/early_updates.py). Each
// element is read before it is written, so the two may be the same.
template <typename Lp>
struct Slices {
  const typename Lp::storage* g;
  const float* ps;
  const float* ms;
  const float* vs;
  typename Lp::storage* lp;
  float* p;
  float* m;
  float* v;
};

template <typename Lp>
inline void adam_range_scalar(const Slices<Lp>& s, int64_t begin, int64_t end, const AdamCoeffs& c) {
  for (int64_t i = begin; i < end; ++i) {
    float pi = s.ps[i], mi = s.ms[i], vi = s.vs[i];
    adam_math<float>(Lp::load(s.g + i), pi, mi, vi, c);
    s.p[i] = pi;
    s.m[i] = mi;
    s.v[i] = vi;
    Lp::store(s.lp + i, pi);
  }
}

#if defined(DSPS_HAVE_SIMD)
template <bool kStream>
inline void put(float* p, VecF x) {
  if constexpr (kStream) {
    x.stream(p);
  } else {
    x.store(p);
  }
}

// The vectors of [i, end) (two per iteration, to overlap the two divide/sqrt chains); returns where they stop.
template <typename Lp, bool kStream>
inline int64_t adam_vectors(const Slices<Lp>& s, int64_t i, int64_t end, const AdamCoeffsT<VecF>& cv) {
  for (; i + 2 * kVec <= end; i += 2 * kVec) {
    VecF g0 = vload(s.g + i), g1 = vload(s.g + i + kVec);
    VecF p0 = VecF::load(s.ps + i), p1 = VecF::load(s.ps + i + kVec);
    VecF m0 = VecF::load(s.ms + i), m1 = VecF::load(s.ms + i + kVec);
    VecF v0 = VecF::load(s.vs + i), v1 = VecF::load(s.vs + i + kVec);
    adam_math<VecF>(g0, p0, m0, v0, cv);
    adam_math<VecF>(g1, p1, m1, v1, cv);
    put<kStream>(s.p + i, p0);
    put<kStream>(s.p + i + kVec, p1);
    put<kStream>(s.m + i, m0);
    put<kStream>(s.m + i + kVec, m1);
    put<kStream>(s.v + i, v0);
    put<kStream>(s.v + i + kVec, v1);
    vstore(s.lp + i, p0);
    vstore(s.lp + i + kVec, p1);
  }
  return i;
}

// Into other buffers the fp32 states are written with streaming stores: the destination's cache lines are then
// not read before they are written (a third of the traffic of writing them), and the update into spare buffers
// runs near the bandwidth of the one in place. They need the destination aligned to a vector, so they are used
// where master, exp_avg and exp_avg_sq lie alike against that alignment, after the elements before the first
// aligned one (the scalar path: the same fused math, bit for bit).
constexpr uintptr_t kVecBytes = kVec * sizeof(float);

template <typename Lp>
inline bool streams(const Slices<Lp>& s) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(s.p), m = reinterpret_cast<uintptr_t>(s.m),
                  v = reinterpret_cast<uintptr_t>(s.v);
  const bool other = s.p != s.ps && s.m != s.ms && s.v != s.vs;
  return other && (p - m) % kVecBytes == 0 && (p - v) % kVecBytes == 0 && p % sizeof(float) == 0;
}

inline int64_t to_aligned(const float* p) {
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(p) % kVecBytes;
  return misaligned ? static_cast<int64_t>((kVecBytes - misaligned) / sizeof(float)) : 0;
}
#endif

template <typename Lp>
inline void adam_range(const Slices<Lp>& s, int64_t begin, int64_t end, const AdamCoeffs& c) {
#if defined(DSPS_HAVE_SIMD)
  const AdamCoeffsT<VecF> cv = AdamCoeffsT<VecF>::broadcast(c);
  int64_t i = begin;
  if (streams(s)) {
    const int64_t first = std::min(end, begin + to_aligned(s.p + begin));
    adam_range_scalar<Lp>(s, begin, first, c);
    i = adam_vectors<Lp, true>(s, first, end, cv);
    _mm_sfence();  // the streamed stores are visible before this thread's part is done
  } else {
    i = adam_vectors<Lp, false>(s, begin, end, cv);
  }
  adam_range_scalar<Lp>(s, i, end, c);
#else
  adam_range_scalar<Lp>(s, begin, end, c);
#endif
}

template <typename Lp>
void adam_cpu_impl(const Slices<Lp> s, int64_t n, const AdamCoeffs c_in) {
  const AdamCoeffs c = c_in;  // local copy: provably not aliased by the stores
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  const int nthreads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), nblocks));
  if (n < kMinParallel || nthreads <= 1) {
    adam_range<Lp>(s, 0, n, c);
    return;
  }
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t begin = b * kBlock;
    const int64_t end = std::min(n, begin + kBlock);
    adam_range<Lp>(s, begin, end, c);
  }
}

template <typename Lp, typename T>
Slices<Lp> slices(const at::Tensor& grad, const at::Tensor& master_src, const at::Tensor& exp_avg_src,
                  const at::Tensor& exp_avg_sq_src, at::Tensor& param_lp, at::Tensor& master, at::Tensor& exp_avg,
                  at::Tensor& exp_avg_sq) {
  return {reinterpret_cast<const typename Lp::storage*>(grad.data_ptr<T>()), master_src.data_ptr<float>(),
          exp_avg_src.data_ptr<float>(), exp_avg_sq_src.data_ptr<float>(),
          reinterpret_cast<typename Lp::storage*>(param_lp.data_ptr<T>()), master.data_ptr<float>(),
          exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>()};
}

// The update from the sources into the destinations (the same tensors: in place).
void adam_step_from(at::Tensor grad, at::Tensor master_src, at::Tensor exp_avg_src, at::Tensor exp_avg_sq_src,
                    at::Tensor param_lp, at::Tensor master, at::Tensor exp_avg, at::Tensor exp_avg_sq, double lr,
                    double beta1, double beta2, double eps, double weight_decay, bool adamw, double bias_correction1,
                    double bias_correction2_sqrt, double grad_scale) {
  check_adam_inputs(param_lp, master, exp_avg, exp_avg_sq, c10::DeviceType::CPU);
  check_adam_inputs(grad, master_src, exp_avg_src, exp_avg_sq_src, c10::DeviceType::CPU);
  TORCH_CHECK(grad.scalar_type() == param_lp.scalar_type() && grad.numel() == param_lp.numel(),
              "ds_patrickstar adam: the gradient and the parameter slot differ in dtype or size");
  const int64_t n = param_lp.numel();
  if (n == 0) return;
  const AdamCoeffs c = make_adam_coeffs(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction1,
                                        bias_correction2_sqrt, grad_scale);
  const at::Tensor &g = grad, &ps = master_src, &ms = exp_avg_src, &vs = exp_avg_sq_src;
  at::Tensor &lp = param_lp, &p = master, &m = exp_avg, &v = exp_avg_sq;
  switch (param_lp.scalar_type()) {
    case at::kFloat:
      adam_cpu_impl<LpFloat>(slices<LpFloat, float>(g, ps, ms, vs, lp, p, m, v), n, c);
      break;
    case at::kBFloat16:
      adam_cpu_impl<LpBF16>(slices<LpBF16, at::BFloat16>(g, ps, ms, vs, lp, p, m, v), n, c);
      break;
    case at::kHalf:
      adam_cpu_impl<LpHalf>(slices<LpHalf, at::Half>(g, ps, ms, vs, lp, p, m, v), n, c);
      break;
    default:
      TORCH_CHECK(false, "unreachable");
  }
}

void adam_step(at::Tensor param_lp, at::Tensor master, at::Tensor exp_avg, at::Tensor exp_avg_sq, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool adamw, double bias_correction1,
               double bias_correction2_sqrt, double grad_scale) {
  adam_step_from(param_lp, master, exp_avg, exp_avg_sq, param_lp, master, exp_avg, exp_avg_sq, lr, beta1, beta2,
                 eps, weight_decay, adamw, bias_correction1, bias_correction2_sqrt, grad_scale);
}

std::string simd_name() { return DSPS_SIMD_NAME; }

}  // namespace
}  // namespace ds_patrickstar

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_patrickstar fused chunk Adam (CPU)";
  // No Python object is touched inside: the host worker's update runs beside the thread that drives the
  // accelerator (see [Note: overlapped host Adam] in memory/host_work.py).
  m.def("adam_step", &ds_patrickstar::adam_step, "Fused Adam/AdamW step on a flat chunk slice (in place)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("adam_step_from", &ds_patrickstar::adam_step_from,
        "Fused Adam/AdamW step from (gradient, master, exp_avg, exp_avg_sq) into (parameter, master, exp_avg, "
        "exp_avg_sq): other buffers, or the same ones",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("simd", &ds_patrickstar::simd_name, "SIMD path compiled in: avx512, avx2 or scalar");
}
