// Fused chunk Adam on CUDA: one launch per chunk slice reads the low-precision
// gradient, updates the fp32 master/exp_avg/exp_avg_sq and writes the new
// low-precision parameter (see ds_patrickstar/adam_math.py).
//
// Vectorized path: 4 elements per thread and iteration (16-byte fp32 loads,
// 8-byte bf16/fp16 loads). Slices of a chunk start at arbitrary element
// offsets, so up to 3 leading elements are peeled off when that aligns all
// four buffers; the peeled head and the tail are done by the first threads of
// the same launch. If the buffers cannot all be aligned, a scalar grid-stride
// loop runs instead.
//
// Plain CUDA (no torch headers), so it compiles with nvcc alone; the checks,
// device guard, stream and dtype mapping live in adam_cuda_binding.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ds_adam_cuda.h"
#include "ds_adam_math.h"

namespace ds_patrickstar {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;
constexpr int64_t kMaxBlocks = 8192;

template <typename T>
struct Lp;
template <>
struct Lp<float> {
  __device__ __forceinline__ static float load(const float* p) { return *p; }
  __device__ __forceinline__ static void store(float* p, float f) { *p = f; }
  using Vec = float4;
};
template <>
struct Lp<__nv_bfloat16> {
  __device__ __forceinline__ static float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  __device__ __forceinline__ static void store(__nv_bfloat16* p, float f) { *p = __float2bfloat16_rn(f); }
  using Vec = uint2;  // 4 x 16 bit
};
template <>
struct Lp<__half> {
  __device__ __forceinline__ static float load(const __half* p) { return __half2float(*p); }
  __device__ __forceinline__ static void store(__half* p, float f) { *p = __float2half_rn(f); }
  using Vec = uint2;
};

template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&out)[kVec]) {
  typename Lp<T>::Vec raw = *reinterpret_cast<const typename Lp<T>::Vec*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec; ++k) out[k] = Lp<T>::load(e + k);
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&in)[kVec]) {
  typename Lp<T>::Vec raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec; ++k) Lp<T>::store(e + k, in[k]);
  *reinterpret_cast<typename Lp<T>::Vec*>(p) = raw;
}

template <typename T>
__device__ __forceinline__ void adam_one(T* __restrict__ lp, float* __restrict__ p, float* __restrict__ m,
                                         float* __restrict__ v, int64_t i, const AdamCoeffs& c) {
  float pi = p[i], mi = m[i], vi = v[i];
  adam_math<float>(Lp<T>::load(lp + i), pi, mi, vi, c);
  p[i] = pi;
  m[i] = mi;
  v[i] = vi;
  Lp<T>::store(lp + i, pi);
}

// head: elements [0, head) done scalar; body: nvec vectors of kVec from head;
// tail: [head + kVec*nvec, n) done scalar. vectorized == false: all scalar.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(T* __restrict__ lp, float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
                int64_t n, int64_t head, int64_t nvec, bool vectorized, const AdamCoeffs c) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (!vectorized) {
    for (int64_t i = tid; i < n; i += stride) adam_one<T>(lp, p, m, v, i, c);
    return;
  }
  for (int64_t j = tid; j < nvec; j += stride) {
    const int64_t i = head + j * kVec;
    float g[kVec], pv[kVec], mv[kVec], vv[kVec];
    load4<T>(lp + i, g);
    *reinterpret_cast<float4*>(pv) = *reinterpret_cast<const float4*>(p + i);
    *reinterpret_cast<float4*>(mv) = *reinterpret_cast<const float4*>(m + i);
    *reinterpret_cast<float4*>(vv) = *reinterpret_cast<const float4*>(v + i);
#pragma unroll
    for (int k = 0; k < kVec; ++k) adam_math<float>(g[k], pv[k], mv[k], vv[k], c);
    *reinterpret_cast<float4*>(p + i) = *reinterpret_cast<const float4*>(pv);
    *reinterpret_cast<float4*>(m + i) = *reinterpret_cast<const float4*>(mv);
    *reinterpret_cast<float4*>(v + i) = *reinterpret_cast<const float4*>(vv);
    store4<T>(lp + i, pv);
  }
  const int64_t tail_begin = head + nvec * kVec;
  const int64_t leftovers = head + (n - tail_begin);  // <= 2 * (kVec - 1)
  if (tid < leftovers) adam_one<T>(lp, p, m, v, tid < head ? tid : tail_begin + (tid - head), c);
}

inline bool aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

inline int64_t num_blocks(int64_t work) {
  return std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, kMaxBlocks));
}

template <typename T>
void launch_adam(T* lp, float* p, float* m, float* v, int64_t n, const AdamCoeffs& c, cudaStream_t stream) {
  // Elements to peel so that master is 16-byte aligned (all fp32 pointers share
  // that offset when slices sit at the same element offset in their chunks).
  const int64_t misalign = static_cast<int64_t>((reinterpret_cast<uintptr_t>(p) / sizeof(float)) % kVec);
  const int64_t head = std::min<int64_t>(n, (kVec - misalign) % kVec);
  const bool vectorized = aligned(p, sizeof(float)) && aligned(p + head, 16) && aligned(m + head, 16) &&
                          aligned(v + head, 16) && aligned(lp + head, kVec * sizeof(T));
  const int64_t nvec = vectorized ? (n - head) / kVec : 0;
  const int64_t work = vectorized ? std::max<int64_t>(nvec, 2 * kVec) : n;
  adam_kernel<T><<<num_blocks(work), kThreads, 0, stream>>>(lp, p, m, v, n, head, nvec, vectorized, c);
}

}  // namespace

cudaError_t launch_adam_cuda(LpType lp_type, void* param_lp, float* master, float* exp_avg, float* exp_avg_sq,
                             int64_t n, const AdamCoeffs& coeffs, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (lp_type) {
    case LpType::kFloat32:
      launch_adam<float>(static_cast<float*>(param_lp), master, exp_avg, exp_avg_sq, n, coeffs, stream);
      break;
    case LpType::kBFloat16:
      launch_adam<__nv_bfloat16>(static_cast<__nv_bfloat16*>(param_lp), master, exp_avg, exp_avg_sq, n, coeffs,
                                 stream);
      break;
    case LpType::kFloat16:
      launch_adam<__half>(static_cast<__half*>(param_lp), master, exp_avg, exp_avg_sq, n, coeffs, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace ds_patrickstar
