// constrain_bitmask_ (the request constraints cleared from a packed bitmask), sequence_bias
// (transformers' sequence_bias as sparse logit biases) and dry_bias (llama.cpp's DRY, likewise):
// logits_processor/constraints.h, checked here before anything is written.

#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "../logits_processor/constraints.h"
#include "checks.h"
#include "dispatch.h"
#include "torch_binding.h"

HIDDEN_NAMESPACE_BEGIN(binding)

namespace lp = logits_processor;

namespace {

// The tensors the kernel reads, held for the call (contiguous copies of strided inputs).
struct ConstraintTensors {
  std::optional<Tensor> lists[6];
  std::optional<Tensor> ints[3];
};

bool is_int_ids(ScalarType t) { return t == ScalarType::Long || t == ScalarType::Int; }

// What an op's inputs are checked against: the device of `on` (named as `on_name`, e.g. "the
// bitmask's"), and the tensors it writes, whose memory they must not share.
struct Target {
  const Tensor& on;
  const char* on_name;
  const Tensor* written[2];
  const char* written_names[2];
};

void check_input_placement(const Tensor& t, const Target& target, const char* name) {
  CHECK_ARG(t.device() == target.on.device(), name, " must be on ", target.on_name, " device (",
            device_name(target.on.device()), "), got ", device_name(t.device()));
  for (int k = 0; k < 2; ++k)
    CHECK_ARG(target.written[k] == nullptr || !shares_storage(t, *target.written[k]), name,
              " must not share memory with ", target.written_names[k]);
}

// An integer tensor (int64 or int32, read as it is) placed as `target` needs, contiguous; its
// host values in [lo, hi].
Tensor checked_ints(const Tensor& t, const Target& target, const char* name, int64_t lo, int64_t hi,
                    const char* range) {
  CHECK_ARG(is_int_ids(t.scalar_type()), name, " must be int64 or int32, got ", t.scalar_type());
  check_input_placement(t, target, name);
  Tensor c = torch::stable::contiguous(t);
  if (host_readable(c) && c.numel() > 0) {
    const lp::IntArray values = int_array(c);
    int64_t low = values.get(0), high = low;
    for (int64_t i = 1; i < c.numel(); ++i) {
      low = std::min(low, values.get(i));
      high = std::max(high, values.get(i));
    }
    CHECK_ARG(low >= lo && high <= hi, name, " must lie in ", range, ", got values in [", low, ", ", high, "]");
  }
  return c;
}

// Host sequences (runs of `length` entries: a row's token_ids, a bad word) padded only at the
// end: a -1 followed by an id would silently shorten the sequence.
void check_padded_at_the_end(const Tensor& t, int64_t length, const char* name) {
  if (!host_readable(t) || length == 0) return;
  const lp::IntArray values = int_array(t);
  for (int64_t first = 0; first < t.numel(); first += length)
    for (int64_t i = first + 1; i < first + length; ++i)
      CHECK_ARG(!(values.get(i - 1) < 0 && values.get(i) >= 0), name,
                " must be -1 padded at the end of each sequence, got an id after a -1");
}

// A list per row: [B, width] (or [width] for every row; nested: [B, N, M] or [N, M]), ids in
// [0, vocab) or -1 for padding. sequences: its runs of the last dimension's length are
// sequences, padded at the end (token_ids, bad_words); else a set, padded anywhere.
lp::RowLists row_lists(const std::optional<Tensor>& given, std::optional<Tensor>& held, const Target& target,
                       int64_t rows, int64_t vocab, const char* name, bool nested = false, bool sequences = false) {
  if (!given.has_value()) return {{nullptr, false}, 0, 0};
  const Tensor& t = *given;
  const int64_t shared_dim = nested ? 2 : 1;
  CHECK_ARG(t.dim() == shared_dim || (t.dim() == shared_dim + 1 && t.size(0) == rows), name, " must be ",
            nested ? "[N, M] (the same words for every row) or [" : "[L] (the same list for every row) or [",
            rows, nested ? ", N, M]" : ", L]", " (one per row, -1 padded), got shape ", shape_name(t.sizes()));
  held = checked_ints(t, target, name, -1, vocab - 1, "[0, vocab_size) or be -1 (padding)");
  if (sequences) check_padded_at_the_end(*held, t.size(-1), name);
  const bool per_row = t.dim() == shared_dim + 1;
  const int64_t width = per_row ? (rows > 0 ? held->numel() / rows : 0) : held->numel();
  return {int_array(*held), width, per_row ? width : 0};
}

// A per-row integer: `value`, or a [B] tensor of them (None: `value` for every row); host values
// in [lo, 2^31).
lp::RowInt row_int(const std::optional<Tensor>& given, int64_t value, std::optional<Tensor>& held,
                   const Target& target, int64_t rows, const char* name, int64_t lo = 0) {
  CHECK_ARG(value >= lo && value < (int64_t{1} << 31), name, " must lie in [", lo, ", 2^31), got ", value);
  if (!given.has_value()) return {{nullptr, false}, value};
  CHECK_ARG(given->dim() == 1 && given->size(0) == rows, name, " must be a number or a 1-D tensor of length ",
            rows, " (one per row), got shape ", shape_name(given->sizes()));
  held = checked_ints(*given, target, name, lo, (int64_t{1} << 31) - 1, lo == 0 ? "[0, 2^31)" : "[-1, 2^31)");
  return {int_array(*held), 0};
}

// A per-row float: `value`, or a [B] floating tensor of them read as float32 (None: `value` for
// every row); host values finite and at least `lo`.
lp::RowFloat row_float(const std::optional<Tensor>& given, double value, std::optional<Tensor>& held,
                       const Target& target, int64_t rows, const char* name, float lo) {
  if (!given.has_value()) {  // (finite as the kernel's float: 1e39 is not)
    CHECK_ARG(std::isfinite(ieee_float(value)) && value >= lo, name, " must be finite and at least ", lo, ", got ",
              value);
    return {nullptr, ieee_float(value)};
  }
  CHECK_ARG(given->dim() == 1 && given->size(0) == rows, name, " must be a number or a 1-D tensor of length ",
            rows, " (one per row), got shape ", shape_name(given->sizes()));
  CHECK_ARG(is_floating(given->scalar_type()), name, " must be a floating-point tensor, got ",
            given->scalar_type());
  check_input_placement(*given, target, name);
  held = torch::stable::contiguous(torch::stable::to(*given, ScalarType::Float));
  if (host_readable(*held)) {
    const float* v = held->const_data_ptr<float>();
    for (int64_t i = 0; i < held->numel(); ++i)
      CHECK_ARG(std::isfinite(v[i]) && v[i] >= lo, name, " must be finite and at least ", lo, ", got ", v[i]);
  }
  return {held->const_data_ptr<float>(), 0.0f};
}

}  // namespace

void constrain_bitmask_(const Tensor& bitmask, int64_t vocab_size, const std::optional<Tensor>& token_ids,
                        const std::optional<Tensor>& prompt_lengths, int64_t prompt_lengths_value,
                        const std::optional<Tensor>& min_tokens, int64_t min_tokens_value,
                        const std::optional<Tensor>& stop_token_ids, const std::optional<Tensor>& allowed_token_ids,
                        const std::optional<Tensor>& suppress_tokens, const std::optional<Tensor>& bad_words,
                        const std::optional<Tensor>& no_repeat_ngram_size, int64_t no_repeat_ngram_size_value) {
  CHECK_ARG(bitmask.scalar_type() == ScalarType::Int, "bitmask must be int32, got ", bitmask.scalar_type());
  CHECK_ARG(bitmask.dim() == 2, "bitmask must be 2-D [batch, ceil(vocab_size / 32)], got ", bitmask.dim(), "-D");
  check_device_supported(bitmask, "bitmask");
  CHECK_ARG(vocab_size > 0 && vocab_size < (int64_t{1} << 31), "vocab_size must lie in [1, 2^31), got ",
            vocab_size);
  const RowView bv = row_view(bitmask, "bitmask");
  CHECK_ARG(bv.width == (vocab_size + 31) / 32, "bitmask must have ceil(vocab_size / 32) = ", (vocab_size + 31) / 32,
            " words per row for vocab_size = ", vocab_size, ", got ", bv.width);
  CHECK_ARG(!has_internal_overlap(bitmask) && (bv.rows <= 1 || bv.row_stride >= bv.width),
            "bitmask must not have overlapping rows (e.g. an expanded tensor)");
  const bool needs_sequence = bad_words.has_value() || no_repeat_ngram_size.has_value() ||
                              no_repeat_ngram_size_value > 0 || min_tokens.has_value() || min_tokens_value > 0;
  CHECK_ARG(token_ids.has_value() || !needs_sequence,
            "token_ids must be given with min_tokens, bad_words or no_repeat_ngram_size (they read the sequence)");
  CHECK_ARG(stop_token_ids.has_value() || !(min_tokens.has_value() || min_tokens_value > 0),
            "stop_token_ids must be given with min_tokens (the tokens it excludes)");

  ConstraintTensors held;
  const Target target{bitmask, "the bitmask's", {&bitmask, nullptr}, {"bitmask", nullptr}};
  lp::ConstraintParams p{};
  p.bitmask = bitmask.mutable_data_ptr<int32_t>();
  p.bitmask_row_stride = bv.row_stride;
  p.rows = bv.rows;
  p.words = bv.width;
  p.vocab = vocab_size;
  p.token_ids = row_lists(token_ids, held.lists[0], target, p.rows, vocab_size, "token_ids", false, true);
  p.stop_token_ids = row_lists(stop_token_ids, held.lists[1], target, p.rows, vocab_size, "stop_token_ids");
  p.allowed_token_ids = row_lists(allowed_token_ids, held.lists[2], target, p.rows, vocab_size, "allowed_token_ids");
  p.suppress_tokens = row_lists(suppress_tokens, held.lists[3], target, p.rows, vocab_size, "suppress_tokens");
  p.bad_words = {row_lists(bad_words, held.lists[4], target, p.rows, vocab_size, "bad_words", true, true),
                 bad_words.has_value() ? bad_words->size(-1) : 0};
  p.prompt_lengths = row_int(prompt_lengths, prompt_lengths_value, held.ints[0], target, p.rows, "prompt_lengths");
  p.min_tokens = row_int(min_tokens, min_tokens_value, held.ints[1], target, p.rows, "min_tokens");
  p.no_repeat_ngram_size = row_int(no_repeat_ngram_size, no_repeat_ngram_size_value, held.ints[2], target, p.rows,
                                   "no_repeat_ngram_size");
  RUN_KERNEL(constrain_bitmask, bitmask, p);
}

namespace {

// One of a bias op's outputs: dtype, [rows, count] on token_ids' device, contiguous in its last
// dimension (a column slice of a wider bias buffer is fine), rows not overlapping.
RowView checked_bias_output(const Tensor& t, const Tensor& token_ids, const char* name, ScalarType dtype,
                            int64_t rows, int64_t count, const char* entries) {
  CHECK_ARG(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  CHECK_ARG(t.device() == token_ids.device(), name, " must be on token_ids' device (", device_name(token_ids.device()),
            "), got ", device_name(t.device()));
  CHECK_ARG(t.dim() == 2 && t.size(0) == rows && t.size(1) == count, name, " must have shape [", rows, ", ", count,
            "] (", entries, "), got ", shape_name(t.sizes()));
  const RowView v = row_view(t, name);
  CHECK_ARG(!has_internal_overlap(t) && (v.rows <= 1 || v.row_stride >= v.width), name,
            " must not have overlapping rows (e.g. an expanded tensor)");
  return v;
}

// A bias op's outputs (out_ids int64, out_values float32), `count` entries a row, in `p`.
template <typename Params>
void set_bias_outputs(Params& p, const Tensor& out_ids, const Tensor& out_values, const Tensor& token_ids,
                      int64_t count, const char* entries) {
  const RowView iv = checked_bias_output(out_ids, token_ids, "out_ids", ScalarType::Long, p.rows, count, entries);
  const RowView vv = checked_bias_output(out_values, token_ids, "out_values", ScalarType::Float, p.rows, count,
                                         entries);
  CHECK_ARG(!shares_storage(out_ids, out_values), "out_ids must not share memory with out_values");
  p.out_ids = out_ids.mutable_data_ptr<int64_t>();
  p.out_ids_row_stride = iv.row_stride;
  p.out_values = out_values.mutable_data_ptr<float>();
  p.out_values_row_stride = vv.row_stride;
}

// A bias op's vocab_size and token_ids ([B, L], on a supported device).
void check_vocab_and_token_ids(int64_t vocab_size, const Tensor& token_ids) {
  CHECK_ARG(vocab_size > 0 && vocab_size < (int64_t{1} << 31), "vocab_size must lie in [1, 2^31), got ",
            vocab_size);
  CHECK_ARG(token_ids.dim() == 2, "token_ids must be 2-D [B, L] (each row's sequence, -1 padded), got shape ",
            shape_name(token_ids.sizes()));
  check_device_supported(token_ids, "token_ids");
}

// Words of ids ([N, M] for every row or [rows, N, M]), at least one id each.
void check_words_shape(const Tensor& t, int64_t rows, const char* name) {
  CHECK_ARG(t.dim() == 2 || t.dim() == 3, name, " must be [N, M] (the same for every row) or [", rows,
            ", N, M] (one set per row), got shape ", shape_name(t.sizes()));
  CHECK_ARG(t.size(-1) > 0 || t.size(-2) == 0, name, " must hold at least one id each (M >= 1), got shape ",
            shape_name(t.sizes()));
}

}  // namespace

void sequence_bias(const Tensor& token_ids, const Tensor& sequences, const Tensor& biases, int64_t vocab_size,
                   const Tensor& out_ids, const Tensor& out_values) {
  check_vocab_and_token_ids(vocab_size, token_ids);
  const int64_t rows = token_ids.size(0);
  check_words_shape(sequences, rows, "sequences");
  const int64_t count = sequences.size(-2);
  lp::SequenceBiasParams p{};
  p.rows = rows;
  p.vocab = vocab_size;
  set_bias_outputs(p, out_ids, out_values, token_ids, count, "one entry per sequence");

  const Target target{token_ids, "token_ids'", {&out_ids, &out_values}, {"out_ids", "out_values"}};
  std::optional<Tensor> held_tokens, held_sequences;
  p.token_ids = row_lists(token_ids, held_tokens, target, rows, vocab_size, "token_ids", false, true);
  p.sequences = {row_lists(sequences, held_sequences, target, rows, vocab_size, "sequences", true, true),
                 sequences.size(-1)};

  CHECK_ARG(is_floating(biases.scalar_type()), "biases must be a floating-point tensor, got ", biases.scalar_type());
  CHECK_ARG((biases.dim() == 1 && biases.size(0) == count) ||
                (biases.dim() == 2 && biases.size(0) == rows && biases.size(1) == count),
            "biases must be [", count, "] (the same for every row) or [", rows, ", ", count,
            "] (one per sequence), got shape ", shape_name(biases.sizes()));
  check_input_placement(biases, target, "biases");
  const Tensor values = torch::stable::contiguous(torch::stable::to(biases, ScalarType::Float));
  if (host_readable(values)) {
    const float* v = values.const_data_ptr<float>();
    for (int64_t i = 0; i < values.numel(); ++i) CHECK_ARG(!std::isnan(v[i]), "biases must not be NaN");
  }
  p.biases = values.const_data_ptr<float>();
  p.biases_row_stride = biases.dim() == 2 ? count : 0;
  RUN_KERNEL(sequence_bias, token_ids, p);
}

void dry_bias(const Tensor& token_ids, const std::optional<Tensor>& sequence_breakers, int64_t vocab_size,
              const std::optional<Tensor>& multiplier, double multiplier_value, const std::optional<Tensor>& base,
              double base_value, const std::optional<Tensor>& allowed_length, int64_t allowed_length_value,
              const std::optional<Tensor>& penalty_last_n, int64_t penalty_last_n_value, const Tensor& out_ids,
              const Tensor& out_values) {
  check_vocab_and_token_ids(vocab_size, token_ids);
  const int64_t rows = token_ids.size(0), length = token_ids.size(1);
  CHECK_ARG(length < (int64_t{1} << 31), "token_ids must have fewer than 2^31 columns, got ", length);
  if (sequence_breakers.has_value()) check_words_shape(*sequence_breakers, rows, "sequence_breakers");
  lp::DryParams p{};
  p.rows = rows;
  p.vocab = vocab_size;
  set_bias_outputs(p, out_ids, out_values, token_ids, length, "one entry per token of token_ids");

  const Target target{token_ids, "token_ids'", {&out_ids, &out_values}, {"out_ids", "out_values"}};
  std::optional<Tensor> held_tokens, held_breakers, held[4];
  p.token_ids = row_lists(token_ids, held_tokens, target, rows, vocab_size, "token_ids", false, true);
  p.breakers = {row_lists(sequence_breakers, held_breakers, target, rows, vocab_size, "sequence_breakers", true,
                          true),
                sequence_breakers.has_value() ? sequence_breakers->size(-1) : 0};
  p.multiplier = row_float(multiplier, multiplier_value, held[0], target, rows, "multiplier", 0.0f);
  p.base = row_float(base, base_value, held[1], target, rows, "base", 1.0f);
  p.allowed_length = row_int(allowed_length, allowed_length_value, held[2], target, rows, "allowed_length");
  p.penalty_last_n = row_int(penalty_last_n, penalty_last_n_value, held[3], target, rows, "penalty_last_n", -1);
  RUN_KERNEL(dry_bias, token_ids, p);
}

HIDDEN_NAMESPACE_END(binding)
