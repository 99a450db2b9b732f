// The ids past the support on the CPU (logprob_ids.h): rows in parallel, one pass over the
// listed ids to mark those below N, one over [0, N) to write the unmarked ones.
#include <vector>

#include "logprob_ids.h"

namespace logits_processor {

void fill_ids_past_support_cpu(const LogprobIds& p, const ParallelFor& parallel_for) {
  if (p.n == 0) return;
  parallel_for(0, p.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> listed;
    for (int64_t row = begin; row < end; ++row) {
      int64_t count = 0;
      while (count < p.n && !is_past_support(p, row, count)) ++count;
      if (count == p.n) continue;
      const TokenIds columns = p.ids.from(row * (1 + p.n) + 1);
      listed.assign(static_cast<size_t>(p.n), 0);
      for (int64_t j = 0; j < count; ++j)
        if (columns.get(j) < p.n) listed[static_cast<size_t>(columns.get(j))] = 1;
      int64_t next = count;
      for (int64_t v = 0; v < p.n && next < p.n; ++v)
        if (!listed[static_cast<size_t>(v)]) columns.set(next++, v);
    }
  });
}

}  // namespace logits_processor
