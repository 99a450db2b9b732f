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
//
// sample_with_logprobs and token_logprobs run logprobs_kernel: a block per row, the same draw,
// then one pass over the kept set for ln Z, the rank and the top-N (row_logprobs).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include "cuda_utils.cuh"
#include "sampling.h"
#include "verify.h"

namespace logits_processor {
namespace {

constexpr int kThreads = 256;  // also the radix: thread t owns bin 255 - t when scanning
constexpr int kRadixBits = 8;
constexpr int64_t kMinSplitTokens = 8192;  // a chunk smaller than this is not worth a block
constexpr int64_t kMaxSplits = 64;
constexpr int kTopChunk = 20;  // top-N tokens found per pass over the row (the fast path: N <= 20)

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
  uint64_t top[kTopChunk];  // a chunk of the top-N log-probabilities' tokens, packed
  uint32_t bias_filter[kBiasFilterWords];  // the row's logit bias ids (penalties.h)
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

// Row `row`'s penalties, with the filter of its bias ids built in shared memory by the whole
// block (every thread calls this with the same row).
__device__ RowPenalty block_row_penalty(const SamplingParams& p, int64_t row, SharedState& sh) {
  RowPenalty q = row_penalty(p.penalties, row);
  if (!q.enabled || q.bias_width == 0) return q;  // (the same for the whole block)
  __syncthreads();  // every thread is done with the previous row's filter
  for (int w = threadIdx.x; w < kBiasFilterWords; w += kThreads) sh.bias_filter[w] = 0;
  __syncthreads();
  for (int64_t k = threadIdx.x; k < q.bias_width; k += kThreads) {
    const int64_t id = q.bias_ids[k];
    if (id >= 0) atomicOr(&sh.bias_filter[(id >> 5) & (kBiasFilterWords - 1)], 1u << (id & 31));
  }
  __syncthreads();
  q.bias_filter = sh.bias_filter;
  return q;
}

template <Dtype D>
struct Row {
  const SamplingParams& p;
  RowParams r;
  const void* logits;
  const int32_t* bitmask;
  RowPenalty penalty;
  float s_max;
  uint32_t threshold;  // the kept set's, once `cut` ran

  // f(i, s) for each candidate token of this thread's share of the row.
  template <typename F>
  __device__ void for_each_candidate(F&& f) const {
    for (int64_t i = threadIdx.x; i < p.vocab; i += kThreads) {
      const float x = candidate_logit<D>(p, logits, bitmask, penalty, i);
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
      const float x = candidate_logit<D>(p, logits, bitmask, penalty, i);
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
        const float x = candidate_logit<D>(p, logits, bitmask, penalty, i);
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
    if (!cut(sh)) return -1;
    return unpack_or_none(gumbel_argmax(threshold, sh, 0, p.vocab));
  }

  // s_max and the kept set's threshold key for this row's filters; false if the row has no
  // candidate.
  __device__ bool cut(SharedState& sh) {
    uint64_t max_key = kNoKey, candidates = 0;
    for_each_candidate([&](int64_t, float s) {
      max_key = max(max_key, static_cast<uint64_t>(score_key(s)));
      ++candidates;
    });
    max_key = block_max(max_key, sh);
    candidates = block_sum(candidates, sh);
    if (candidates == 0) return false;
    s_max = key_score(static_cast<uint32_t>(max_key));
    const uint32_t lower = min_p_key(s_max, r.min_p);
    threshold = lower;
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
    return true;
  }

  // Token i's score if it is in the kept set {key >= threshold}, else -inf (i may be any id).
  __device__ float kept_score(int64_t i) const {
    if (i < 0 || i >= p.vocab) return kNegInf;
    const float x = candidate_logit<D>(p, logits, bitmask, penalty, i);
    if (!(x > kNegInf)) return kNegInf;
    const float s = score(x, r.temperature);
    return score_key(s) >= threshold ? s : kNegInf;
  }

  // The row the log-probabilities are taken under (sampling.h): this one for a processed,
  // non-greedy row; the allowed logits at temperature 1 without filters for a greedy one; all
  // logits at temperature 1 for raw. (`cut` then finds its s_max and threshold.)
  __device__ Row logprob_row(bool raw) const {
    Row d = *this;
    if (!raw && !r.greedy) return d;
    d.r.greedy = false;
    d.r.temperature = 1.0f;
    d.r.top_k = 0;
    d.r.top_p = 1.0f;
    d.r.min_p = 0.0f;
    if (raw) d.bitmask = nullptr, d.penalty.enabled = false;
    return d;
  }

  __device__ static int64_t unpack_or_none(uint64_t best) {
    return best == kNoToken ? -1 : unpack_index(best);
  }
};

// A thread's best packed (key, index) pairs, best first, at most kTopChunk of them.
struct TopList {
  uint64_t v[kTopChunk];
  int size;

  __device__ void offer(uint64_t packed, int n) {
    if (size == n && packed <= v[n - 1]) return;
    int j = size < n ? size++ : n - 1;
    for (; j > 0 && v[j - 1] < packed; --j) v[j] = v[j - 1];
    v[j] = packed;
  }
};

// What one pass over a row's kept set gives a thread: its part of the fine masses and of the
// count of kept tokens scoring above s_token, and its best n (<= kTopChunk) packed (key,
// index) pairs below `bound`.
struct KeptPass {
  FineMass z;
  uint64_t above;
  TopList top;
};

template <Dtype D>
__device__ KeptPass kept_pass(const Row<D>& row, float s_token, uint64_t bound, int n) {
  KeptPass k{{0, 0}, 0, {{}, 0}};
  row.for_each_candidate([&](int64_t i, float s) {
    const uint32_t key = score_key(s);
    if (key < row.threshold) return;
    const FineMass m = fine_mass(s, row.s_max);
    k.z.high += m.high;
    k.z.low += m.low;
    k.above += s > s_token;
    const uint64_t packed = pack_argmax(key, i);
    if (n > 0 && packed < bound) k.top.offer(packed, n);
  });
  return k;
}

// The block's best n of the threads' lists into sh.top, best first; their count. n rounds of
// a block-wide maximum, each taking one thread's head.
__device__ int merge_top(const TopList& list, int n, SharedState& sh) {
  int head = 0;
  int found = 0;
  for (; found < n; ++found) {
    const uint64_t mine = head < list.size ? list.v[head] : kNoToken;
    const uint64_t best = block_max(mine, sh);
    if (best == kNoToken) break;  // (the same for every thread)
    if (mine == best) ++head;     // packed pairs are distinct: one thread's
    if (threadIdx.x == 0) sh.top[found] = best;
  }
  __syncthreads();  // sh.top is complete before anyone reads it
  return found;
}

// sample_with_logprobs / token_logprobs for one row, by the whole block: the draw, then one
// pass for ln Z, the rank and the first kTopChunk of the top-N (N > kTopChunk: one more pass
// per kTopChunk tokens). Greedy and raw rows first find their distribution's s_max (`cut`).
template <Dtype D>
__device__ void row_logprobs(const SamplingParams& p, Row<D>& sampler, int64_t row, SharedState& sh) {
  const LogprobsParams& out = p.logprobs;
  if (out.given_tokens) {
    Row<D> d = sampler.logprob_row(out.raw);
    float value = kNegInf;
    if (d.cut(sh)) {
      const float s = d.kept_score(out.given_tokens[row]);
      const KeptPass k = kept_pass(d, s, 0, 0);
      const double log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
      if (s > kNegInf) value = token_logprob(s, d.s_max, log_z);
    }
    if (threadIdx.x == 0) out.logprobs[row] = value;
    return;
  }
  const int64_t columns = 1 + out.num_logprobs;
  float* logprobs = out.logprobs + row * columns;
  int64_t* ids = out.token_ids + row * columns;
  const int64_t token = sampler.sample(sh);
  if (threadIdx.x == 0) p.out[row] = token, out.ranks[row] = kNoRank;
  for (int64_t c = threadIdx.x; c < columns; c += kThreads) logprobs[c] = kNegInf, ids[c] = -1;
  if (token < 0) return;
  Row<D> d = sampler.logprob_row(out.raw);
  if ((out.raw || sampler.r.greedy) && !d.cut(sh)) return;
  const float s_token = d.kept_score(token);
  uint64_t bound = ~uint64_t{0};
  int n = static_cast<int>(out.num_logprobs < kTopChunk ? out.num_logprobs : kTopChunk);
  const KeptPass k = kept_pass(d, s_token, bound, n);
  const double log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
  const uint64_t above = block_sum(k.above, sh);  // (its barriers order the padding first)
  if (threadIdx.x == 0) {
    logprobs[0] = token_logprob(s_token, d.s_max, log_z);
    ids[0] = token;
    out.ranks[row] = 1 + static_cast<int64_t>(above);
  }
  TopList list = k.top;
  for (int64_t done = 0; n > 0;) {
    const int found = merge_top(list, n, sh);
    if (threadIdx.x < found) {
      const int64_t index = unpack_index(sh.top[threadIdx.x]);
      logprobs[1 + done + threadIdx.x] = token_logprob(d.kept_score(index), d.s_max, log_z);
      ids[1 + done + threadIdx.x] = index;
    }
    done += found;
    if (found < n || done == out.num_logprobs) break;
    bound = sh.top[n - 1];
    __syncthreads();  // every thread has read sh.top before the next chunk writes it
    n = static_cast<int>(out.num_logprobs - done < kTopChunk ? out.num_logprobs - done : kTopChunk);
    list = kept_pass(d, s_token, bound, n).top;
  }
}

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
  // (sample_with_logprobs and token_logprobs have their own kernel, logprobs_kernel: its
  // registers would lower this one's occupancy.)
  __shared__ SharedState sh;
  for (int64_t work = blockIdx.x; work < p.rows * split.splits; work += gridDim.x) {
    const int64_t row = work / split.splits;
    const int64_t chunk = work % split.splits;
    Row<D> sampler{p, row_params(p, row), row_logits(p, row), row_bitmask(p, row),
                   block_row_penalty(p, row, sh), 0.0f, kNoKey};
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

// One block per row, grid-stride.
template <Dtype D>
__global__ void __launch_bounds__(kThreads) logprobs_kernel(SamplingParams p) {
  __shared__ SharedState sh;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    Row<D> sampler{p, row_params(p, row), row_logits(p, row), row_bitmask(p, row),
                   block_row_penalty(p, row, sh), 0.0f, kNoKey};
    row_logprobs(p, sampler, row, sh);
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
    if (params.logprobs.enabled)
      launch_kernel(params.logprobs.given_tokens ? "token_logprobs" : "sample_with_logprobs",
                    logprobs_kernel<D>, blocks, kThreads, stream, params);
    else
      launch_kernel("sample", sample_kernel<D>, blocks, kThreads, stream, params, split);
  });
}

namespace {

// --- verify_draft (verify.h) ---------------------------------------------------------------
// Here rather than in a file of its own: it walks each position with the sampler's Row.

// ResidualDraw over the row, the draft excluded; `row` has been cut, log_z is its
// distribution's.
template <Dtype D>
__device__ int64_t residual_draw(const VerifyParams& v, int64_t b, int64_t position, const Row<D>& row,
                                 double log_z, int64_t draft, SharedState& sh) {
  ResidualDraw draw;
  for (int64_t group = threadIdx.x; 4 * group < row.p.vocab; group += kThreads) {
    Philox4 bits;
    bool drawn = false;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t i = 4 * group + j;
      if (i >= row.p.vocab) break;
      const float s = row.kept_score(i);
      if (!(s > kNegInf) || i == draft) continue;
      if (!drawn) bits = noise_bits(row.r, group), drawn = true;
      draw.offer(i, token_logprob(s, row.s_max, log_z), token_gumbel(row.r, i, bits.v[j]),
                 draft_prob(v, b, position, i));
    }
  }
  draw.residual = block_max(draw.residual, sh);
  draw.target = block_max(draw.target, sh);
  return draw.token();
}

// The token a position emits (the draft itself when accepted; -1 if nothing is allowed).
template <Dtype D>
__device__ int64_t position_token(const VerifyParams& v, int64_t b, int64_t position, int64_t draft,
                                  SharedState& sh) {
  const SamplingParams target = position_target(v, position);
  Row<D> row{target, position_params(v, b, position), row_logits(target, b), row_bitmask(target, b),
             RowPenalty{}, 0.0f, kNoKey};  // (verify_draft has no penalties)
  if (!v.draft_probs || row.r.greedy || position == row_draft_count(v, b)) return row.sample(sh);
  if (!row.cut(sh)) return -1;
  const float s_draft = row.kept_score(draft);
  const KeptPass k = kept_pass(row, s_draft, 0, 0);
  const double log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
  const bool in_support = s_draft > kNegInf;
  const float logprob = in_support ? token_logprob(s_draft, row.s_max, log_z) : kNegInf;
  const float q = in_support ? draft_prob(v, b, position, draft) : 0.0f;
  if (draft_accepted(row.r, logprob, q)) return draft;
  return residual_draw(v, b, position, row, log_z, draft, sh);
}

// One block per row (grid-stride), walking its positions.
template <Dtype D>
__global__ void __launch_bounds__(kThreads) verify_kernel(VerifyParams v) {
  __shared__ SharedState sh;
  for (int64_t b = blockIdx.x; b < v.target.rows; b += gridDim.x) {
    int64_t* tokens = row_tokens(v, b);
    for (int64_t j = threadIdx.x; j < v.positions; j += kThreads) tokens[j] = -1;
    const int64_t drafts = row_draft_count(v, b);
    int64_t accepted = 0;
    for (; accepted <= drafts; ++accepted) {
      const int64_t draft = accepted < drafts ? draft_token(v, b, accepted) : -1;
      const int64_t emitted = position_token<D>(v, b, accepted, draft, sh);
      __syncthreads();  // the -1 padding is written before the token (other threads' columns)
      if (threadIdx.x == 0) tokens[accepted] = emitted;
      if (accepted == drafts || emitted < 0 || emitted != draft) break;
    }
    if (threadIdx.x == 0) v.num_accepted[b] = accepted;  // (the bonus position: all accepted)
  }
}

}  // namespace

void verify_cuda(const VerifyParams& params, cudaStream_t stream) {
  if (params.target.rows == 0) return;
  const int64_t limit = resident_block_limit(8);
  const unsigned int blocks = static_cast<unsigned int>(params.target.rows < limit ? params.target.rows : limit);
  dispatch_dtype(params.target.dtype, [&]<Dtype D>() {
    launch_kernel("verify_draft", verify_kernel<D>, blocks, kThreads, stream, params);
  });
}

}  // namespace logits_processor
