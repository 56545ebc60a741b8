// Input checks at the C++ boundary of the Adam kernels (host code only).
#pragma once

#include <ATen/ATen.h>

namespace ds_patrickstar {

inline void check_flat(const at::Tensor& t, const char* name, c10::DeviceType device) {
  TORCH_CHECK(t.device().type() == device, "ds_patrickstar adam: ", name, " must be on ",
              c10::DeviceTypeName(device), ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "ds_patrickstar adam: ", name, " must be contiguous");
}

inline void check_adam_inputs(const at::Tensor& param_lp, const at::Tensor& master, const at::Tensor& exp_avg,
                              const at::Tensor& exp_avg_sq, c10::DeviceType device) {
  check_flat(param_lp, "param_lp", device);
  check_flat(master, "master", device);
  check_flat(exp_avg, "exp_avg", device);
  check_flat(exp_avg_sq, "exp_avg_sq", device);
  const auto lp = param_lp.scalar_type();
  TORCH_CHECK(lp == at::kFloat || lp == at::kBFloat16 || lp == at::kHalf,
              "ds_patrickstar adam: param_lp must be float32, bfloat16 or float16, got ", lp);
  TORCH_CHECK(master.scalar_type() == at::kFloat, "ds_patrickstar adam: master must be float32, got ",
              master.scalar_type());
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat, "ds_patrickstar adam: exp_avg must be float32, got ",
              exp_avg.scalar_type());
  TORCH_CHECK(exp_avg_sq.scalar_type() == at::kFloat, "ds_patrickstar adam: exp_avg_sq must be float32, got ",
              exp_avg_sq.scalar_type());
  const auto n = param_lp.numel();
  TORCH_CHECK(master.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n,
              "ds_patrickstar adam: numel mismatch: param_lp ", n, ", master ", master.numel(), ", exp_avg ",
              exp_avg.numel(), ", exp_avg_sq ", exp_avg_sq.numel());
  TORCH_CHECK(param_lp.device() == master.device() && master.device() == exp_avg.device() &&
                  exp_avg.device() == exp_avg_sq.device(),
              "ds_patrickstar adam: all tensors must be on the same device");
  TORCH_CHECK(!param_lp.is_same(master), "ds_patrickstar adam: param_lp and master must be distinct buffers");
}

}  // namespace ds_patrickstar
