// The sampler's kernels for float16 logits (sampling_kernels.cuh).
#include "sampling_kernels.cuh"

namespace logits_processor {
template void sample_cuda_kernels<Dtype::Float16>(const SamplingParams&, int64_t, unsigned long long*, int64_t*,
                                                cudaStream_t);
template void verify_cuda_kernel<Dtype::Float16>(const VerifyParams&, unsigned int, cudaStream_t);
}  // namespace logits_processor
