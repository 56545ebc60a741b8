// Torch binding of the CUDA Adam kernels (adam_cuda.cu): input checks, device
// guard, current stream, dtype mapping. Compiled by the host compiler.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "ds_adam_checks.h"
#include "ds_adam_cuda.h"

namespace ds_patrickstar {
namespace {

LpType lp_type_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return LpType::kFloat32;
    case at::kBFloat16:
      return LpType::kBFloat16;
    case at::kHalf:
      return LpType::kFloat16;
    default:
      TORCH_CHECK(false, "ds_patrickstar: unsupported dtype ", t.scalar_type());
  }
}

void adam_step_cuda(at::Tensor param_lp, at::Tensor master, at::Tensor exp_avg, at::Tensor exp_avg_sq, double lr,
                    double beta1, double beta2, double eps, double weight_decay, bool adamw,
                    double bias_correction1, double bias_correction2_sqrt, double grad_scale) {
  check_adam_inputs(param_lp, master, exp_avg, exp_avg_sq, c10::DeviceType::CUDA);
  const int64_t n = param_lp.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(param_lp.device());
  const AdamCoeffs c = make_adam_coeffs(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction1,
                                        bias_correction2_sqrt, grad_scale);
  C10_CUDA_CHECK(launch_adam_cuda(lp_type_of(param_lp), param_lp.data_ptr(), master.data_ptr<float>(),
                                  exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), n, c,
                                  c10::cuda::getCurrentCUDAStream(param_lp.device().index()).stream()));
}

}  // namespace
}  // namespace ds_patrickstar

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ds_patrickstar fused chunk Adam (CUDA)";
  m.def("adam_step", &ds_patrickstar::adam_step_cuda, "Fused Adam/AdamW step on a flat chunk slice (in place)");
}
