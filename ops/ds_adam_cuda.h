// Interface between the CUDA kernels (adam_cuda.cu, plain CUDA, no torch
// headers) and their torch binding (adam_cuda_binding.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ds_adam_math.h"

namespace ds_patrickstar {

enum class LpType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// One fused Adam step over n elements on `stream`; returns the launch error.
cudaError_t launch_adam_cuda(LpType lp_type, void* param_lp, float* master, float* exp_avg, float* exp_avg_sq,
                             int64_t n, const AdamCoeffs& coeffs, cudaStream_t stream);

}  // namespace ds_patrickstar
