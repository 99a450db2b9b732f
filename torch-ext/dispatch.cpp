// The CUDA entries of torch's C shim (the current stream) are declared only under USE_CUDA;
// they are needed here alone.
#if defined(CUDA_KERNEL) && !defined(LP_CUDA_EMULATION) && !defined(USE_CUDA)
#define USE_CUDA
#endif

#include "dispatch.h"

#include <torch/csrc/stable/ops.h>

HIDDEN_NAMESPACE_BEGIN(binding)

namespace lp = logits_processor;

void run_parallel_for(int64_t begin, int64_t end, int64_t grain,
                      const std::function<void(int64_t, int64_t)>& body) {
  torch::stable::parallel_for(begin, end, grain, body);
}

#if defined(CUDA_KERNEL) && !defined(LP_CUDA_EMULATION)
CudaLaunchContext::CudaLaunchContext(const Tensor& t) : guard_(t.get_device_index()) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream));
  stream_ = static_cast<cudaStream_t>(stream);
}
#endif

namespace {

lp::Dtype kernel_dtype(ScalarType dtype) {
  if (dtype == ScalarType::Half) return lp::Dtype::Float16;
  if (dtype == ScalarType::BFloat16) return lp::Dtype::BFloat16;
  return lp::Dtype::Float32;
}

}  // namespace

lp::LogitsView logits_view(const Tensor& logits, const RowView& lv) {
  return {logits.data_ptr(), kernel_dtype(logits.scalar_type()), lv.rows, lv.width, lv.row_stride};
}

lp::FloatArray float_array(const std::optional<Tensor>& t) {
  if (!t.has_value()) return {nullptr, lp::ParamDtype::Float32};
  const ScalarType dtype = t->scalar_type();
  return {t->const_data_ptr(), dtype == ScalarType::Double     ? lp::ParamDtype::Float64
                               : dtype == ScalarType::Half     ? lp::ParamDtype::Float16
                               : dtype == ScalarType::BFloat16 ? lp::ParamDtype::BFloat16
                                                               : lp::ParamDtype::Float32};
}

lp::IntArray int_array(const std::optional<Tensor>& t) {
  return {t.has_value() ? t->const_data_ptr() : nullptr, t.has_value() && t->scalar_type() == ScalarType::Int};
}

HIDDEN_NAMESPACE_END(binding)
