// CUDA dynamic_temperature: one block per row or position (grid-stride), two passes over its candidates
// through the row sampler's reads (RowSampler::for_each_candidate at temperature 1: vector loads,
// the staged bitmask, the penalties as `sample` reads them), each pass's sums reduced over the
// block in integers, so the result is the CPU's bit for bit.
#include "block_primitives.cuh"
#include "cuda_utils.cuh"
#include "dynamic_temperature.h"
#include "row_sampler.cuh"

namespace logits_processor {
namespace {

__global__ void __launch_bounds__(kThreads)
    dynamic_temperature_kernel(const __grid_constant__ DynamicTemperatureParams p) {
  __shared__ SharedState sh;
  const SamplingParams& s = p.sampling;
  for (int64_t flat = blockIdx.x; flat < s.rows * p.positions; flat += gridDim.x) {  // (row, position j)
    const int64_t row = flat / p.positions, j = flat % p.positions;
    const float t = s.temperature.get_or(row, s.temperature_value);
    const float range = p.range.get_or(row, p.range_value);
    EntropySums sums{0, {0, 0}, {0, 0}};
    if (range > 0.0f && t > 0.0f) {  // (the same for the whole block: the barriers below too)
      RowParams unit = row_params(s, row);
      unit.temperature = 1.0f;  // for_each_candidate's scores are then unit_score(x)
      const RowPenaltyView penalty = block_row_penalty_view(s, row, sh, dynatemp_path(p, row, j));
      const RowSampler sampler{s, unit, dynatemp_logits(p, row, j), dynatemp_bitmask(p, row, j), penalty, 0.0f, kNoKey,
                               sh.staged_words};
      uint64_t top = kNoKey;
      sampler.for_each_candidate([&](int64_t, float x) { top = max(top, static_cast<uint64_t>(score_key(x))); });
      const float s_max = row_max_score(static_cast<uint32_t>(block_max(top, sh)));
      sampler.for_each_candidate([&](int64_t, float x) { add_entropy_terms(sums, x, s_max); });
      sums = {block_sum(sums.count, sh), {block_sum(sums.z.high, sh), block_sum(sums.z.low, sh)},
              {block_sum(sums.terms.high, sh), block_sum(sums.terms.low, sh)}};
    }
    if (threadIdx.x == 0) p.out[flat] = dynamic_temperature_of(t, range, row_dynatemp_exponent(p, row), sums);
  }
}

}  // namespace

void dynamic_temperature_cuda(const DynamicTemperatureParams& params, cudaStream_t stream) {
  const int64_t rows = params.sampling.rows * params.positions;
  if (rows == 0) return;
  const int64_t limit = resident_block_limit(8);
  launch_kernel("dynamic_temperature", dynamic_temperature_kernel,
                static_cast<unsigned int>(rows < limit ? rows : limit), kThreads, stream, params);
}

}  // namespace logits_processor
