// CUDA sampler: one 256-thread block per row (grid-stride over rows), one launch for the
// whole chain, no sort and no float atomics. Each step is a pass over the row:
//   1. max score and candidate count (or, greedy, the argmax: done);
//   2. top-k: a radix select, 8 bits a pass, of the k-th largest score key;
//   3. top-p: the integer masses' total, then a radix select on masses above the cutoff;
//   4. the Gumbel-max draw over the kept set.
// The integer histograms make every decision independent of thread timing, and the
// arithmetic is sampling.h's, so the CPU sampler returns the same tokens.
//
// Small batches (fewer rows than SMs) split each row over several blocks where one pass is
// the whole job (greedy, or no filter: a Gumbel-max over every candidate): each block takes
// a chunk, and the last block to finish a row, counted with an atomic after a fence,
// combines the chunks' winners. No block ever waits for another. Rows with filters are
// sampled whole by their chunk-0 block.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include "cuda_utils.cuh"
#include "sampling.h"

namespace logits_processor {
namespace {

constexpr int kThreads = 256;  // also the radix: thread t owns bin 255 - t when scanning
constexpr int kRadixBits = 8;
constexpr int64_t kMinSplitTokens = 8192;  // a chunk smaller than this is not worth a block
constexpr int64_t kMaxSplits = 64;

struct MaxOp {
  __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a > b ? a : b; }
};

using BlockReduce = cub::BlockReduce<uint64_t, kThreads>;
using BlockScan = cub::BlockScan<uint64_t, kThreads>;

struct SharedState {
  union {
    BlockReduce::TempStorage reduce;
    BlockScan::TempStorage scan;
  } cub;
  unsigned long long histogram[kThreads];
  uint64_t broadcast;
  uint32_t digit;
  uint64_t above;
};

// Block-wide reductions whose result every thread gets.
__device__ uint64_t block_max(uint64_t v, SharedState& sh) {
  v = BlockReduce(sh.cub.reduce).Reduce(v, MaxOp());
  if (threadIdx.x == 0) sh.broadcast = v;
  __syncthreads();
  v = sh.broadcast;
  __syncthreads();
  return v;
}

__device__ uint64_t block_sum(uint64_t v, SharedState& sh) {
  v = BlockReduce(sh.cub.reduce).Sum(v);
  if (threadIdx.x == 0) sh.broadcast = v;
  __syncthreads();
  v = sh.broadcast;
  __syncthreads();
  return v;
}

template <Dtype D>
struct Row {
  const SamplingParams& p;
  RowParams r;
  const void* logits;
  const int32_t* bitmask;
  float s_max;

  // f(i, s) for each candidate token of this thread's share of the row.
  template <typename F>
  __device__ void for_each_candidate(F&& f) const {
    for (int64_t i = threadIdx.x; i < p.vocab; i += kThreads) {
      const float x = candidate_logit<D>(p, logits, bitmask, i);
      if (x > kNegInf) f(i, score(x, r.temperature));
    }
  }

  // Whether one pass decides the row: greedy, or no filter that could drop a candidate.
  __device__ bool single_pass() const {
    return r.greedy || ((r.top_k <= 0 || r.top_k >= p.vocab) && r.top_p >= 1.0f && r.min_p <= 0.0f);
  }

  // That pass over tokens [begin, end): the packed winner, kNoToken if none.
  __device__ uint64_t single_pass_winner(int64_t begin, int64_t end, SharedState& sh) const {
    return r.greedy ? greedy_argmax(sh, begin, end) : gumbel_argmax(kNoKey, sh, begin, end);
  }

  __device__ uint64_t greedy_argmax(SharedState& sh, int64_t begin, int64_t end) const {
    uint64_t best = kNoToken;
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const float x = candidate_logit<D>(p, logits, bitmask, i);
      if (x > kNegInf) best = max(best, pack_argmax(score_key(x), i));
    }
    return block_max(best, sh);
  }

  // Over tokens [begin, end), begin a multiple of 4: each thread takes 4 consecutive
  // tokens at a time, which one Philox call covers.
  __device__ uint64_t gumbel_argmax(uint32_t threshold, SharedState& sh, int64_t begin,
                                    int64_t end) const {
    uint64_t best = kNoToken;
    for (int64_t group = begin / 4 + threadIdx.x; 4 * group < end; group += kThreads) {
      Philox4 bits;
      bool drawn = false;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t i = 4 * group + j;
        if (i >= end) break;
        const float x = candidate_logit<D>(p, logits, bitmask, i);
        if (!(x > kNegInf)) continue;
        const float s = score(x, r.temperature);
        if (score_key(s) < threshold) continue;
        if (!drawn) bits = noise_bits(r, group), drawn = true;
        best = max(best, pack_argmax(score_key(perturbed_score(s, token_gumbel(r, i, bits.v[j]))), i));
      }
    }
    return block_max(best, sh);
  }

  // The largest key t with stat(candidates with key >= t) >= target, where stat counts them
  // (kMass false) or sums their masses, among the candidates with key >= lower. The caller
  // guarantees that those reach the target.
  template <bool kMass>
  __device__ uint32_t radix_select(uint32_t lower, uint64_t target, SharedState& sh) const {
    uint32_t prefix = 0;
    uint64_t above = 0;  // stat of the candidates above the bins still in play
    for (int shift = 32 - kRadixBits; shift >= 0; shift -= kRadixBits) {
      const uint32_t decided = shift + kRadixBits == 32 ? 0u : ~0u << (shift + kRadixBits);
      sh.histogram[threadIdx.x] = 0;
      __syncthreads();
      for_each_candidate([&](int64_t, float s) {
        const uint32_t key = score_key(s);
        if (key >= lower && (key & decided) == prefix)
          atomicAdd(&sh.histogram[(key >> shift) & (kThreads - 1)],
                    kMass ? static_cast<unsigned long long>(token_mass(s, s_max)) : 1ull);
      });
      __syncthreads();
      const uint32_t bin = kThreads - 1 - threadIdx.x;  // the scan runs from the top bin down
      const uint64_t mine = sh.histogram[bin];
      // Defaults in case no bin qualifies (the caller's guarantee failed): a wrong
      // threshold then, never a stale digit. The scan's own barrier orders these writes.
      if (threadIdx.x == 0) sh.digit = 0, sh.above = above;
      uint64_t inclusive;
      BlockScan(sh.cub.scan).InclusiveSum(mine, inclusive);
      if (above + inclusive - mine < target && above + inclusive >= target) {
        sh.digit = bin;
        sh.above = above + inclusive - mine;
      }
      __syncthreads();
      prefix |= (sh.digit & (kThreads - 1)) << shift;
      above = sh.above;
      __syncthreads();
    }
    return prefix;
  }

  __device__ int64_t sample(SharedState& sh) {
    if (r.greedy) return unpack_or_none(greedy_argmax(sh, 0, p.vocab));
    uint64_t max_key = kNoKey, candidates = 0;
    for_each_candidate([&](int64_t, float s) {
      max_key = max(max_key, static_cast<uint64_t>(score_key(s)));
      ++candidates;
    });
    max_key = block_max(max_key, sh);
    candidates = block_sum(candidates, sh);
    if (candidates == 0) return -1;
    s_max = key_score(static_cast<uint32_t>(max_key));
    const uint32_t lower = min_p_key(s_max, r.min_p);
    uint32_t threshold = lower;
    if (r.top_k > 0 && static_cast<uint64_t>(r.top_k) < candidates) {
      uint64_t at_or_above = candidates;
      if (lower != kNoKey) {
        uint64_t mine = 0;
        for_each_candidate([&](int64_t, float s) { mine += score_key(s) >= lower; });
        at_or_above = block_sum(mine, sh);
      }
      // Fewer than k candidates at or above the min-p cutoff: top-k keeps all of them.
      if (at_or_above >= static_cast<uint64_t>(r.top_k))
        threshold = radix_select<false>(lower, static_cast<uint64_t>(r.top_k), sh);
    }
    if (r.top_p < 1.0f) {
      uint64_t total = 0, above_threshold = 0;
      for_each_candidate([&](int64_t, float s) {
        const uint64_t mass = token_mass(s, s_max);
        total += mass;
        above_threshold += score_key(s) >= threshold ? mass : 0;
      });
      const uint64_t target = top_p_target(r.top_p, block_sum(total, sh));
      if (block_sum(above_threshold, sh) >= target)
        threshold = radix_select<true>(threshold, target, sh);
    }
    return unpack_or_none(gumbel_argmax(threshold, sh, 0, p.vocab));
  }

  __device__ static int64_t unpack_or_none(uint64_t best) {
    return best == kNoToken ? -1 : unpack_index(best);
  }
};

// Rows split over `splits` blocks each, chunks of `chunk` tokens (a multiple of 4).
// Chunk winners go to partials[row * splits + c]; arrivals[row] (zero before the launch)
// counts the finished chunks.
struct Split {
  int64_t splits;
  int64_t chunk;
  unsigned long long* partials;
  unsigned int* arrivals;
};

// Thread 0 of each chunk's block: publish the chunk's winner; the last chunk of the row to
// arrive writes the row's token.
__device__ void finish_chunk(const Split& split, int64_t row, int64_t chunk, uint64_t winner,
                             int64_t* out) {
  unsigned long long* partials = split.partials + row * split.splits;
  partials[chunk] = winner;
  __threadfence();  // the winner is visible before the arrival is counted
  if (atomicAdd(&split.arrivals[row], 1u) != split.splits - 1) return;
  __threadfence();  // the last to arrive sees every chunk's winner
  uint64_t best = kNoToken;
  for (int64_t c = 0; c < split.splits; ++c) {
    const uint64_t w = *reinterpret_cast<volatile unsigned long long*>(&partials[c]);
    best = w > best ? w : best;
  }
  out[row] = best == kNoToken ? -1 : unpack_index(best);
}

template <Dtype D>
__global__ void __launch_bounds__(kThreads) sample_kernel(SamplingParams p, Split split) {
  __shared__ SharedState sh;
  for (int64_t work = blockIdx.x; work < p.rows * split.splits; work += gridDim.x) {
    const int64_t row = work / split.splits;
    const int64_t chunk = work % split.splits;
    Row<D> sampler{p, row_params(p, row), row_logits(p, row), row_bitmask(p, row), 0.0f};
    if (split.splits == 1 || !sampler.single_pass()) {
      if (chunk != 0) continue;
      const int64_t token = sampler.sample(sh);
      if (threadIdx.x == 0) p.out[row] = token;
      continue;
    }
    const int64_t begin = chunk * split.chunk;
    const int64_t end = begin + split.chunk < p.vocab ? begin + split.chunk : p.vocab;
    const uint64_t winner = sampler.single_pass_winner(begin, end, sh);
    if (threadIdx.x == 0) finish_chunk(split, row, chunk, winner, p.out);
  }
}

}  // namespace

int64_t sample_cuda_splits(int64_t rows, int64_t vocab) {
  const int64_t sms = resident_block_limit(1);
  if (rows == 0 || rows >= sms) return 1;
  const int64_t wanted = (2 * sms + rows - 1) / rows;        // about two blocks per SM
  const int64_t most = (vocab + kMinSplitTokens - 1) / kMinSplitTokens;  // chunks worth a block
  const int64_t splits = wanted < most ? wanted : most;
  return splits < 1 ? 1 : (splits > kMaxSplits ? kMaxSplits : splits);
}

void sample_cuda(const SamplingParams& params, int64_t splits, unsigned long long* partials,
                 unsigned int* arrivals, cudaStream_t stream) {
  if (params.rows == 0) return;
  const int64_t chunk = ((params.vocab + splits - 1) / splits + 3) / 4 * 4;
  const Split split{splits, chunk > 0 ? chunk : 4, partials, arrivals};
  const int64_t work = params.rows * splits;
  const int64_t limit = resident_block_limit(8);
  const unsigned int blocks = static_cast<unsigned int>(work < limit ? work : limit);
  dispatch_dtype(params.dtype, [&]<Dtype D>() {
    launch_kernel("sample", sample_kernel<D>, blocks, kThreads, stream, params, split);
  });
}

}  // namespace logits_processor
