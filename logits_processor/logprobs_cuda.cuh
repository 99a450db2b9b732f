// The CUDA log-probabilities (sampling.h's "Log-probabilities"): a row's work (row_logprobs) for
// logprobs_kernel, a block per row, which serves sample_with_logprobs (the draw: RowSampler::sample) and token_logprobs (the given
// tokens), then takes one pass over the kept set for ln Z, the rank and the top-N (kept_pass,
// also verify_draft's), and with return_kept the draw's kept set (KeptSet: collected in that
// pass, sorted in shared memory); and filtered_probs / filtered_logits (row_filtered: every
// token's value, no draw). Never split over blocks, and a kernel of its own: its registers
// would lower sample_kernel's occupancy. The kernel is sampling_cuda.cu's, beside the sampler's.
#pragma once

#include "block_primitives.cuh"
#include "row_sampler.cuh"
#include "sampling.h"

namespace logits_processor {
namespace {

// A thread's best packed (key, index) pairs, best first, at most n <= kTopChunk of them (n
// the same for each offer since the last clear). `worst` is v[n - 1] once the list is full,
// else kNoToken (below every candidate): a register, so that a candidate the list rejects, as
// most do, costs no load from v, which lives in local memory.
struct TopList {
  uint64_t v[kTopChunk];
  int size;
  uint64_t worst;

  __device__ void clear() { size = 0, worst = kNoToken; }

  __device__ void offer(uint64_t packed, int n) {
    if (packed <= worst) return;
    int j = size < n ? size++ : n - 1;
    for (; j > 0 && v[j - 1] < packed; --j) v[j] = v[j - 1];
    v[j] = packed;
    if (size == n) worst = v[n - 1];
  }
};

// What one pass over a row's kept set gives a thread: its part of the fine masses and of the
// rank's count (rank_counts against s_token).
struct KeptPass {
  FineMass z;
  uint64_t ranked;
};

// The pass, by the whole block (`row` has been cut): also visit(i, key) for each kept
// candidate, and into *top (emptied first) this thread's best n (<= kTopChunk) packed (key,
// index) pairs below `bound` (n = 0: top unused).
template <typename Visit>
__device__ KeptPass kept_pass(const RowSampler& row, float s_token, bool ties_max, uint64_t bound, int n,
                              TopList* top, Visit&& visit) {
  KeptPass k{{0, 0}, 0};
  if (n > 0) top->clear();
  row.for_each_candidate([&](int64_t i, float s) {
    const uint32_t key = score_key(s);
    if (!row.kept(key)) return;
    const FineMass m = fine_mass(s, row.s_max);
    k.z.high += m.high;
    k.z.low += m.low;
    k.ranked += rank_counts(s, s_token, ties_max);
    visit(i, key);
    const uint64_t packed = pack_argmax(key, i);
    if (n > 0 && packed < bound) top->offer(packed, n);
  });
  return k;
}

__device__ KeptPass kept_pass(const RowSampler& row, float s_token) {
  return kept_pass(row, s_token, false, 0, 0, nullptr, [](int64_t, uint32_t) {});
}

// The "processed" log-probability of `token`, which row.sample drew (-inf for -1): under the
// draw's distribution, a greedy row's at temperature 1 unfiltered (become_logprob_row), as
// row_logprobs' column 0. One pass over the kept set, after pass 1 where the draw made no cut
// (such a row is unfiltered).
__device__ float drawn_logprob(RowSampler& row, int64_t token, SharedState& sh) {
  if (token < 0) return kNegInf;
  const bool uncut = row.single_pass();
  row.become_logprob_row(false);
  if (uncut && !row.keep_all(sh)) return kNegInf;
  const float s = row.kept_score(token);
  const KeptPass k = kept_pass(row, s);
  const double log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
  return s > kNegInf ? token_logprob(s, row.s_max, log_z) : kNegInf;
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

// sample_with_logprobs(..., return_kept=K): one row's kept outputs (LogprobsParams) and their
// collection during a pass over the kept set (the candidates at or above the draw's threshold;
// greedy: the token alone): each kept candidate's bit (atomicOr into words zeroed first), the
// thread's count of them, and their packed (key, index) pairs into sh.wide.kept while they fit
// (kBinCapacity: sh.entry_count hands out the slots; a thread that finds them taken stops
// asking, so a large set costs at most kBinCapacity + kThreads shared atomics).
struct KeptSet {
  int32_t* words;
  int64_t* ids;
  uint64_t size;
  bool full;

  __device__ void add(int64_t i, uint32_t key, SharedState& sh) {
    atomicOr(reinterpret_cast<unsigned int*>(words) + (i >> 5), 1u << (i & 31));
    ++size;
    if (full) return;
    const unsigned int slot = atomicAdd(&sh.entry_count, 1u);
    if (slot < kBinCapacity) sh.wide.kept[slot] = pack_argmax(key, i);
    else full = true;
  }
};

// The kept outputs zeroed (ids -1) and the trivial sets written (nothing allowed: empty;
// greedy: the token); true when the set is to be collected (then sh.entry_count is 0 and the
// zeros are ordered before any bit). Called by the whole block.
__device__ bool begin_kept(const LogprobsParams& out, int64_t row, int64_t token, bool greedy, KeptSet& set,
                           SharedState& sh) {
  set = {out.kept_bitmask + row * out.kept_words, out.kept_ids + row * out.kept_k, 0, false};
  for (int64_t w = threadIdx.x; w < out.kept_words; w += kThreads) set.words[w] = 0;
  for (int64_t c = threadIdx.x; c < out.kept_k; c += kThreads) set.ids[c] = -1;
  if (threadIdx.x == 0) sh.entry_count = 0;
  __syncthreads();  // the zeros before any bit
  if (token >= 0 && !greedy) return true;
  if (threadIdx.x == 0 && token >= 0) set.words[token >> 5] = static_cast<int32_t>(1u << (token & 31)), set.ids[0] = token;
  if (threadIdx.x == 0) out.kept_size[row] = token < 0 ? 0 : 1;
  return false;
}

// sh.wide.kept[0, size) (a collected set, size <= kBinCapacity) sorted in place, largest first
// (kNoToken after it, up to a power of two). Called by the whole block.
__device__ void sort_kept(uint64_t size, SharedState& sh) {
  int m = 1;
  while (static_cast<uint64_t>(m) < size) m <<= 1;
  for (int e = static_cast<int>(size) + threadIdx.x; e < m; e += kThreads) sh.wide.kept[e] = kNoToken;
  __syncthreads();
  block_sort_descending(sh.wide.kept, m);
}

// After the collecting pass: the set's size, and when it has at most K members their ids
// (top-N order; a larger set is in the bitmask only). A set that fit in sh.wide.kept is sorted
// there (no pass over the row); a larger one (K > kBinCapacity) takes kTopChunk ids a pass
// over the row, as the top-N do, the first chunk already in `list` when `ready`. Called by the
// whole block.
__device__ void finish_kept(const LogprobsParams& out, int64_t row, KeptSet& set, const RowSampler& sampler,
                            TopList& list, bool ready, SharedState& sh) {
  const uint64_t size = block_sum(set.size, sh);  // (its barriers complete the collection)
  if (threadIdx.x == 0) out.kept_size[row] = static_cast<int64_t>(size);
  const int64_t k = out.kept_k;
  if (size > static_cast<uint64_t>(k)) return;  // (size is the block's: every thread returns)
  if (size <= kBinCapacity) {
    sort_kept(size, sh);
    for (int64_t c = threadIdx.x; c < k && c < static_cast<int64_t>(size); c += kThreads)
      set.ids[c] = unpack_index(sh.wide.kept[c]);
    __syncthreads();  // sh.wide is read before the next row writes it
    return;
  }
  uint64_t bound = ~uint64_t{0};
  for (int64_t done = 0; done < k;) {
    const int n = static_cast<int>(k - done < kTopChunk ? k - done : kTopChunk);
    if (!ready) {
      list.clear();
      sampler.for_each_candidate([&](int64_t i, float s) {
        const uint32_t key = score_key(s);
        if (key < sampler.threshold || key > sampler.ceiling) return;
        const uint64_t packed = pack_argmax(key, i);
        if (packed < bound) list.offer(packed, n);
      });
    }
    ready = false;
    const int found = merge_top(list, n, sh);
    if (threadIdx.x < found) set.ids[done + threadIdx.x] = unpack_index(sh.top[threadIdx.x]);
    done += found;
    if (found < n) break;
    bound = sh.top[n - 1];
    __syncthreads();  // every thread has read sh.top before the next chunk writes it
  }
}

// filtered_probs / filtered_logits for one row, by the whole block (sampling.h, "The filtered
// distribution"): a greedy row's argmax, or the draw's cut and, for probabilities, one pass for
// Z (kept_pass); then one pass writing every token.
__device__ void row_filtered(const SamplingParams& p, RowSampler& sampler, int64_t row, SharedState& sh) {
  const LogprobsParams& out = p.logprobs;
  float* values = out.filtered + row * p.vocab;
  const bool as_logits = out.filtered_as_logits;
  if (sampler.r.greedy) {
    const int64_t token = sampler.sample(sh);  // the argmax; -1 if nothing is allowed
    sampler.for_each_logit(0, p.vocab, [&](int64_t i, float x) {
      values[i] = greedy_filtered_value(as_logits, i, token, x);
    });
    return;
  }
  if (!sampler.cut(sh)) {
    for (int64_t i = threadIdx.x; i < p.vocab; i += kThreads) values[i] = as_logits ? kNegInf : 0.0f;
    return;
  }
  double scale = 1.0;
  if (!as_logits) {
    const KeptPass k = kept_pass(sampler, kNegInf);
    scale = filtered_scale(normaliser_units({block_sum(k.z.high, sh), block_sum(k.z.low, sh)}));
  }
  sampler.for_each_logit(0, p.vocab, [&](int64_t i, float x) {
    const float s = sampler.draw_score(x);
    values[i] = filtered_value(as_logits, s, sampler.threshold, sampler.ceiling, sampler.s_max, scale);
  });
}

// sample_with_logprobs / token_logprobs for one row, by the whole block: the draw, then one
// pass for ln Z, the rank and the first kTopChunk of the top-N (N > kTopChunk: one more pass
// per kTopChunk tokens). Greedy, unfiltered and raw rows first find their distribution's s_max
// and threshold (`cut`). With return_kept, a processed row's kept set is collected in that
// same pass (its distribution's support is the draw's kept set); a raw row's takes a pass of
// its own, before.
__device__ void row_logprobs(const SamplingParams& p, RowSampler& sampler, int64_t row, SharedState& sh) {
  const LogprobsParams& out = p.logprobs;
  if (out.filtered) return row_filtered(p, sampler, row, sh);
  if (out.given_tokens) {
    RowSampler& d = sampler;
    d.become_logprob_row(out.raw);
    float value = kNegInf;
    if (d.cut(sh)) {
      const float s = d.kept_score(out.given_tokens[row]);
      const KeptPass k = kept_pass(d, s);
      const double log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
      if (s > kNegInf) value = token_logprob(s, d.s_max, log_z);
    }
    if (threadIdx.x == 0) out.logprobs[row] = value;
    return;
  }
  const int64_t columns = 1 + out.num_logprobs;
  float* logprobs = out.logprobs + row * columns;
  const TokenIds ids = out.token_ids.from(row * columns);
  const int64_t token = sampler.sample(sh);
  TopList list;  // one list for the top-N and the kept ids' own passes, in turn
  KeptSet set;
  bool collecting = out.kept_bitmask && begin_kept(out, row, token, sampler.r.greedy, set, sh);
  const auto collect = [&](int64_t i, uint32_t key) {
    if (collecting) set.add(i, key, sh);
  };
  if (collecting && out.raw) {
    const int n = static_cast<int>(out.kept_k < kTopChunk ? out.kept_k : kTopChunk);
    list.clear();
    sampler.for_each_candidate([&](int64_t i, float s) {
      const uint32_t key = score_key(s);
      if (sampler.kept(key)) collect(i, key), list.offer(pack_argmax(key, i), n);
    });
    finish_kept(out, row, set, sampler, list, true, sh);
    collecting = false;
  }
  if (threadIdx.x == 0) p.out.set(row, token), out.ranks[row] = kNoRank;
  for (int64_t c = threadIdx.x; c < columns; c += kThreads) logprobs[c] = kNegInf, ids.set(c, -1);
  if (token < 0) return;
  // (sample cut the row unless one pass decided it: greedy or unfiltered. A row collecting
  // its kept set has a candidate, its token: its cut cannot fail.)
  const bool uncut = out.raw || sampler.single_pass();
  RowSampler& d = sampler;  // (the draw's row no longer needed)
  d.become_logprob_row(out.raw);
  if (uncut && !d.cut(sh)) return;
  if (collecting) {  // (an unfiltered row's cut gathers nothing: sh.entry_count is still 0)
    if (threadIdx.x == 0) sh.entry_count = 0;
    __syncthreads();
  }
  const float s_token = d.kept_score(token);
  uint64_t bound = ~uint64_t{0};
  int n = static_cast<int>(out.num_logprobs < kTopChunk ? out.num_logprobs : kTopChunk);
  const KeptPass k = kept_pass(d, s_token, out.rank_ties_max, bound, n, &list, collect);
  const bool kept = collecting;
  collecting = false;  // (the top-N's further passes collect nothing)
  const double log_z = log_normaliser({block_sum(k.z.high, sh), block_sum(k.z.low, sh)});
  const uint64_t ranked = block_sum(k.ranked, sh);  // (its barriers order the padding first)
  if (threadIdx.x == 0) {
    logprobs[0] = token_logprob(s_token, d.s_max, log_z);
    ids.set(0, token);
    out.ranks[row] = token_rank(ranked, out.rank_ties_max);
  }
  for (int64_t done = 0; n > 0;) {
    const int found = merge_top(list, n, sh);
    if (threadIdx.x < found) {
      const int64_t index = unpack_index(sh.top[threadIdx.x]);
      logprobs[1 + done + threadIdx.x] = token_logprob(d.kept_score(index), d.s_max, log_z);
      ids.set(1 + done + threadIdx.x, index);
    }
    done += found;
    if (found < n || done == out.num_logprobs) break;
    bound = sh.top[n - 1];
    __syncthreads();  // every thread has read sh.top before the next chunk writes it
    n = static_cast<int>(out.num_logprobs - done < kTopChunk ? out.num_logprobs - done : kTopChunk);
    kept_pass(d, s_token, out.rank_ties_max, bound, n, &list, collect);
  }
  if (kept) finish_kept(out, row, set, d, list, false, sh);
}

}  // namespace
}  // namespace logits_processor
