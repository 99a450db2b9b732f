// The CUDA side of sample_sharded (sharded.h): one stage of one shard, a block per row
// (grid-stride), and the outputs, a thread per row (the kept ids: a thread per rank's listed
// id). A stage reads the shard's logits once (a top-N over kTopChunk tokens: once more per
// kTopChunk; the kept set is collected in the draw's pass, its ids sorted in shared memory up to
// kBinCapacity); every decision is sharded.h's, made
// by the same host/device functions as the CPU's, so both return the same bits. Sums are
// integers (shared 32-bit atomics, key_bins.cuh's add_to_bin) and picks maxima: the order in
// which threads add them does not matter.
#include "cuda_utils.cuh"
#include "logprobs_cuda.cuh"
#include "sharded.h"

namespace logits_processor {
namespace {

struct ShardShared {
  SharedState sampler;  // the building blocks' state; wide.masses holds a select stage's sums
  ShardRow row;         // the row's state after absorb_stage, for every thread
  uint32_t token_key;
};

// f(j, value) for this thread's columns of the shard: four consecutive ones at a time, so that
// a thread's noise words come from one Philox call per group of four global ids, mostly.
// Called by the whole block (no barrier).
template <Dtype D, typename F>
__device__ void for_each_shard_token(const ShardStep& a, const RowPenaltyView& penalty, const void* logits,
                                     const int32_t* bitmask, F&& f) {
  for (int64_t base = 4 * static_cast<int64_t>(threadIdx.x); base < a.params.vocab; base += 4 * kThreads) {
    const int64_t end = base + 4 < a.params.vocab ? base + 4 : a.params.vocab;
    for (int64_t j = base; j < end; ++j) f(j, shard_value<D>(a, penalty, logits, bitmask, j));
  }
}

// The row's view for one stage: its parameters, logits, bitmask and penalties.
template <Dtype D>
struct ShardRowView {
  const ShardStep& a;
  RowParams r;
  const void* logits;
  const int32_t* bitmask;
  RowPenaltyView penalty;

  template <typename F>
  __device__ void each(F&& f) const {
    for_each_shard_token<D>(a, penalty, logits, bitmask, f);
  }

  // A candidate's score, -inf for the others.
  __device__ float score_of(float v, const ShardScores& sc) const {
    return v > kNegInf ? score(v, sc.temperature, sc.x_origin) : kNegInf;
  }

  // Column j's candidate value (shard_value), for a pass that visits columns on its own.
  __device__ float value_at(int64_t j) const { return shard_value<D>(a, penalty, logits, bitmask, j); }

  // Column j's raw score (the raw log-probabilities; a second read of the logit, from cache).
  __device__ float raw_at(int64_t j) const { return raw_score(load_logit<D>(logits, j)); }
};

// scan: the candidate count and the greedy pack (raw log-probabilities: the raw maximum's pack).
template <Dtype D>
__device__ void scan_shard(const ShardRowView<D>& row, int64_t* sums, int64_t* picks, ShardShared& sh) {
  const bool raw = row.a.plan.raw_logprobs;
  uint64_t count = 0, best = kNoToken, raw_best = kNoToken;
  row.each([&](int64_t j, float v) {
    const int64_t id = row.a.vocab_offset + j;
    if (raw) {
      const float x = row.raw_at(j);
      const uint64_t pack = x > kNegInf ? pack_argmax(score_key(x), id) : kNoToken;
      raw_best = pack > raw_best ? pack : raw_best;
    }
    if (!(v > kNegInf)) return;
    ++count;
    const uint64_t pack = pack_argmax(score_key(v), id);
    best = pack > best ? pack : best;
  });
  count = block_sum(count, sh.sampler);
  best = block_max(best, sh.sampler);
  if (threadIdx.x == 0) sums[0] = static_cast<int64_t>(count), picks[0] = static_cast<int64_t>(best);
  if (!raw) return;
  raw_best = block_max(raw_best, sh.sampler);
  if (threadIdx.x == 0) picks[1] = static_cast<int64_t>(raw_best);
}

// A select stage's sums, gathered in shared memory (zeroed first, barrier, added, barrier).
template <Dtype D>
__device__ void select_shard(const ShardRowView<D>& row, const ShardRow& s, int64_t* sums, ShardShared& sh) {
  const ShardPlan& plan = row.a.plan;
  const int stage = row.a.stage;
  const int64_t width = shard_sums_width(plan, stage);
  unsigned long long* bins = sh.sampler.wide.masses;
  for (int64_t w = threadIdx.x; w < width; w += kThreads) bins[w] = 0;
  __syncthreads();
  if (s.greedy != kNoToken && !s.greedy_row) {  // (the same for the whole block)
    const ShardScores sc = stage_scores(row.r, s, false);
    const uint32_t p_lower = top_p_lower(s, sc, plan);
    row.each([&](int64_t, float v) {
      add_stage_sums(s, plan, stage, sc, p_lower, row.score_of(v, sc),
                      [&](int64_t w, uint64_t amount) { add_to_bin(&bins[w], amount); });
    });
  }
  __syncthreads();
  // (The next row zeroes the bins only after absorb_stage's barrier, which every thread
  // reaches once it has copied its words here.)
  for (int64_t w = threadIdx.x; w < width; w += kThreads) sums[w] = static_cast<int64_t>(bins[w]);
}

// The block's n largest packs of pack_of(j, v) (kNoToken: not offered), largest first, into
// out[0, n) (kNoToken past the last: the caller's defaults), kTopChunk a pass (merge_top).
// `list` already holds this thread's offers of the first pass where `offered` (made in the
// caller's own pass over the shard).
template <Dtype D, typename PackOf>
__device__ void top_packs(const ShardRowView<D>& row, int64_t n, PackOf&& pack_of, TopList& list, bool offered,
                          int64_t* out, ShardShared& sh) {
  int chunk = static_cast<int>(n < kTopChunk ? n : kTopChunk);
  if (chunk <= 0) return;
  uint64_t bound = ~uint64_t{0};  // (above every pack: scores are finite, so no key is all ones)
  for (int64_t done = 0;;) {
    if (!offered) {
      list.clear();
      row.each([&](int64_t j, float v) {
        const uint64_t pack = pack_of(j, v);
        if (pack != kNoToken && pack < bound) list.offer(pack, chunk);
      });
    }
    offered = false;
    const int found = merge_top(list, chunk, sh.sampler);
    if (threadIdx.x < found) out[done + threadIdx.x] = static_cast<int64_t>(sh.sampler.top[threadIdx.x]);
    done += found;
    if (found < chunk || done == n) break;
    bound = sh.sampler.top[chunk - 1];
    __syncthreads();  // every thread has read sh.top before the next chunk writes it
    chunk = static_cast<int>(n - done < kTopChunk ? n - done : kTopChunk);
  }
  // (A later merge_top writes sh.top only past its block_max's barrier, which every thread
  // reaches after reading it here.)
}

// The kept set's part of the draw (return_kept), collected in the draw's pass (`set`: its bits,
// this thread's count and, up to kBinCapacity, the block's packs in sh.wide.kept): the block's
// size and, where the set has at most K tokens here, its K largest packs, sorted in shared
// memory (a set past kBinCapacity: kTopChunk packs a pass over the shard, as the top-N).
template <Dtype D>
__device__ void draw_kept(const ShardRowView<D>& row, const ShardDrawRow& d, const KeptSet& set, int64_t* size,
                          int64_t* packs, TopList& list, ShardShared& sh) {
  const ShardStep& a = row.a;
  const uint64_t count = block_sum(set.size, sh.sampler);  // (its barriers complete the collection)
  if (threadIdx.x == 0) *size = static_cast<int64_t>(count);
  if (count > static_cast<uint64_t>(a.plan.kept_k)) return;  // (no ids are listed; the same for the block)
  if (count <= kBinCapacity) {
    sort_kept(count, sh.sampler);
    for (int64_t c = threadIdx.x; c < static_cast<int64_t>(count); c += kThreads)
      packs[c] = static_cast<int64_t>(sh.sampler.wide.kept[c]);
    return;  // (the next row writes sh.wide only past its own barriers)
  }
  top_packs(row, a.plan.kept_k, [&](int64_t j, float v) {
    const float x = row.score_of(v, d.sc);
    return in_kept_set(d, v, x, a.vocab_offset + j) ? pack_argmax(score_key(x), a.vocab_offset + j) : kNoToken;
  }, list, false, packs, sh);
}

// The draw: the block's best perturbed pack and its score key; with log-probabilities the
// distribution's fine masses and its top-N packs, largest first; with return_kept the kept
// set's (draw_kept).
template <Dtype D>
__device__ void draw_shard(const ShardRowView<D>& row, const ShardRow& s, int64_t* sums, int64_t* picks,
                           int32_t* kept, ShardShared& sh) {
  const ShardPlan& plan = row.a.plan;
  const int64_t n = plan.num_logprobs, k = plan.kept_k;
  for (int64_t c = threadIdx.x; c < draw_picks_width(n, k); c += kThreads) picks[c] = static_cast<int64_t>(kNoToken);
  for (int64_t c = threadIdx.x; c < draw_sums_width(n, k); c += kThreads) sums[c] = 0;
  for (int64_t w = threadIdx.x; k > 0 && w < row.a.kept_width; w += kThreads) kept[w] = 0;
  if (threadIdx.x == 0) sh.sampler.entry_count = 0;
  __syncthreads();  // the defaults (the kept set's zeros) before any result
  if (s.greedy == kNoToken) return;  // (the same for the whole block)
  const ShardDrawRow d = shard_draw_row(row.r, s, plan);
  const int64_t offset = row.a.vocab_offset;
  ShardDrawPart part{kNoToken, kNoKey, {0, 0}};
  NoiseWords noise;
  TopList list;
  const int chunk = static_cast<int>(n < kTopChunk ? (n > 0 ? n : 0) : kTopChunk);
  if (chunk > 0) list.clear();
  KeptSet set{kept, nullptr, 0, false};  // (return_kept: its bits, size and packs in this pass)
  // The log-probabilities' score of column j (draw score x).
  const auto logprob_of = [&](int64_t j, float x) { return logprob_score(d, x, d.raw ? row.raw_at(j) : kNegInf); };
  row.each([&](int64_t j, float v) {
    const float x = row.score_of(v, d.sc);
    const float l = logprob_of(j, x);
    if (!(l > kNegInf) && !draw_keeps(d, x)) return;
    const int64_t id = offset + j;
    offer_draw(row.r, d, v, x, l, id, [&] { return noise(row.r, id); }, n >= 0, part);
    if (chunk > 0 && l > kNegInf) list.offer(pack_argmax(score_key(l), id), chunk);
    if (k > 0 && in_kept_set(d, v, x, id)) set.add(id, score_key(x), sh.sampler);
  });
  const uint64_t best = block_max(part.best, sh.sampler);
  if (threadIdx.x == 0) picks[0] = static_cast<int64_t>(best);
  if (n >= 0) {
    const uint64_t best_key = block_max(part.best == best ? part.best_key : kNoKey, sh.sampler);
    const uint64_t high = block_sum(part.z.high, sh.sampler), low = block_sum(part.z.low, sh.sampler);
    if (threadIdx.x == 0) picks[1] = static_cast<int64_t>(best_key), sums[0] = static_cast<int64_t>(high),
                          sums[1] = static_cast<int64_t>(low);
    top_packs(row, n, [&](int64_t j, float v) {
      const float l = logprob_of(j, row.score_of(v, d.sc));
      return l > kNegInf ? pack_argmax(score_key(l), offset + j) : kNoToken;
    }, list, true, picks + 2, sh);
  }
  if (k > 0) draw_kept(row, d, set, sums + kept_sums_word(n), picks + kept_picks_word(n), list, sh);
}

// rank: how many of the shard's scores (raw log-probabilities: raw scores) rank against the
// drawn token's (rank_counts).
template <Dtype D>
__device__ void rank_shard(const ShardRowView<D>& row, const ShardRow& s, uint32_t token_key, int64_t* sums,
                           ShardShared& sh) {
  uint64_t counted = 0;
  if (s.greedy != kNoToken) {  // (the same for the whole block)
    const bool raw = row.a.plan.raw_logprobs, ties_max = row.a.plan.rank_ties_max;
    const ShardScores sc = shard_scores(row.r, s.greedy, s.greedy_row != 0);
    const float token_score = key_score(token_key);
    row.each([&](int64_t j, float v) {
      counted += rank_counts(raw ? row.raw_at(j) : row.score_of(v, sc), token_score, ties_max);
    });
    counted = block_sum(counted, sh.sampler);
  }
  if (threadIdx.x == 0) sums[0] = s.greedy == kNoToken || token_key == 0xffffffffu ? 0 : static_cast<int64_t>(counted);
}

// (__grid_constant__: the stage functions take the step by reference.)
template <Dtype D>
__global__ void __launch_bounds__(kThreads) sample_shard_kernel(const __grid_constant__ ShardStep a) {
  __shared__ ShardShared sh;
  const SamplingParams& p = a.params;
  const int64_t sums_width = shard_sums_width(a.plan, a.stage);
  const int64_t picks_width = shard_picks_width(a.plan, a.stage);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const ShardRowView<D> view{a, row_params(p, row), logits_row(p, row), row_bitmask(p, row),
                               block_row_penalty_view(p, row, sh.sampler)};
    int64_t* sums = a.sums + row * sums_width;
    int64_t* picks = a.picks + row * picks_width;
    if (a.stage == 0) {
      scan_shard(view, sums, picks, sh);
      continue;
    }
    if (threadIdx.x == 0) {
      uint32_t token_key = 0;
      sh.row = absorb_stage(a, view.r, row, &token_key);
      sh.token_key = token_key;
      store_shard_row(a.state + row * kShardStateWords, sh.row);
    }
    __syncthreads();
    const ShardRow s = sh.row;
    const uint32_t token_key = sh.token_key;
    __syncthreads();  // read by all before the next row's thread 0 writes them
    if (a.stage < draw_stage(a.plan)) select_shard(view, s, sums, sh);
    else if (a.stage == draw_stage(a.plan))
      draw_shard(view, s, sums, picks, a.plan.kept_k > 0 ? a.kept_words + row * a.kept_width : nullptr, sh);
    else rank_shard(view, s, token_key, sums, sh);
  }
}

__global__ void __launch_bounds__(kThreads) finish_shard_kernel(const ShardOutputs out, const int64_t* state) {
  for (int64_t row = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; row < out.rows;
       row += static_cast<int64_t>(gridDim.x) * kThreads)
    finish_shard_row(out, state, row);
}

// The kept ids (sharded.h's place_kept_id): a thread per (row, rank, listed pack).
__global__ void __launch_bounds__(kThreads) finish_kept_kernel(const ShardOutputs out) {
  const int64_t per_row = out.ranks * out.kept_k;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; e < out.rows * per_row;
       e += static_cast<int64_t>(gridDim.x) * kThreads)
    place_kept_id(out, e / per_row, e % per_row / out.kept_k, e % out.kept_k);
}

}  // namespace

void sample_shard_cuda(const ShardStep& step, cudaStream_t stream) {
  const int64_t rows = step.params.rows;
  if (rows == 0) return;
  const int64_t limit = resident_block_limit(4);
  const auto grid = static_cast<unsigned int>(rows < limit ? rows : limit);
  dispatch_dtype(step.params.dtype, [&]<Dtype D>() {
    launch_kernel("sample_sharded", sample_shard_kernel<D>, grid, kThreads, stream, step);
  });
}

void finish_shard_cuda(const ShardOutputs& out, const int64_t* state, cudaStream_t stream) {
  if (out.rows == 0) return;
  launch_kernel("sample_sharded (finish)", finish_shard_kernel, grid_size(out.rows, kThreads, 8), kThreads, stream,
                out, state);
  if (out.kept_k > 0)
    launch_kernel("sample_sharded (kept ids)", finish_kept_kernel,
                  grid_size(out.rows * out.ranks * out.kept_k, kThreads, 8), kThreads, stream, out);
}

}  // namespace logits_processor
