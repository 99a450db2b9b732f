"""Independent references: plain torch, written for clarity, not speed."""

from __future__ import annotations

import math

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab]: True where the token is allowed (bit v % 32 of word v // 32)."""
    bitmask = bitmask.reshape(-1, bitmask.shape[-1]).to(torch.int64) & 0xFFFFFFFF
    v = torch.arange(vocab, device=bitmask.device)
    return ((bitmask[:, v // 32] >> (v % 32)) & 1).bool()


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, ceil(V / 32)] from a bool [rows, V] allowed matrix."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :vocab] = allowed.to(torch.int64)
    packed = (padded.view(rows, words, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def bitmask_reference(logits, bitmask, *, vocab_size=None, indices=None, fill_value=float("-inf")):
    """A masked copy of logits, XGrammar's semantics."""
    out = logits.clone()
    out2 = out.view(1, -1) if out.dim() == 1 else out
    bitmask2 = bitmask.view(1, -1) if bitmask.dim() == 1 else bitmask
    vocab = vocab_size if vocab_size is not None else min(out2.shape[1], 32 * bitmask2.shape[1])
    rows = range(out2.shape[0]) if indices is None else [int(i) for i in indices]
    allowed = unpack_bitmask(bitmask2, vocab)
    for r in rows:
        out2[r, :vocab] = torch.where(allowed[r], out2[r, :vocab], torch.tensor(fill_value, dtype=out.dtype))
    return out


def random_bitmask(rows: int, vocab: int, generator: torch.Generator, pattern: str = "mixed") -> torch.Tensor:
    """Random bitmask words: 'mixed' (each bit a coin flip), 'zeros', 'ones' or 'words' (each word all 0, all 1 or mixed)."""
    words = (vocab + 31) // 32
    if pattern == "zeros":
        return torch.zeros(rows, words, dtype=torch.int32)
    if pattern == "ones":
        return torch.full((rows, words), -1, dtype=torch.int32)
    mixed = torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int64, generator=generator).to(torch.int32)
    if pattern == "mixed":
        return mixed
    choice = torch.randint(0, 3, (rows, words), generator=generator)
    return torch.where(choice == 0, 0, torch.where(choice == 1, -1, mixed)).to(torch.int32)


def _row_value(value, row):
    return value[row].item() if isinstance(value, torch.Tensor) else value


def _logits_and_allowed(logits, bitmask):
    """The logits as float32 on the CPU, and which tokens the bitmask allows (all past its width)."""
    x = logits.detach().cpu().float()
    rows, vocab = x.shape
    allowed = torch.ones(rows, vocab, dtype=torch.bool)
    if bitmask is not None:
        covered = min(vocab, 32 * bitmask.shape[1])
        allowed[:, :covered] = unpack_bitmask(bitmask.cpu()[:rows], covered)
    return x, allowed


def entropy(p: torch.Tensor) -> float:
    """The entropy in nats of a row's float64 probabilities."""
    return float(-(p[p > 0] * p[p > 0].log()).sum())


def truncation_floor(p: torch.Tensor, epsilon: float, eta: float) -> float:
    """The floor epsilon_cutoff and eta_cutoff put on p (a row's float64 probabilities):
    max(epsilon, min(eta, sqrt(eta) e^-H)), H the entropy in nats (0 for neither)."""
    floor = min(epsilon, 1.0) if epsilon > 0 else 0.0
    if eta > 0:
        floor = max(floor, min(eta, math.sqrt(eta) * math.exp(-entropy(p))))
    return floor


SIGMA_CAP = 32768.0  # logits: how far below the top a candidate counts in top_n_sigma's deviation


def sigma_threshold(x: torch.Tensor, candidates: torch.Tensor, n: float) -> float:
    """top_n_sigma's threshold on a row's float32 logits x (+inf as the largest float) from
    llama.cpp's definition, in float64: x_max - n sigma, sigma the population standard
    deviation of the candidates' logits, each counted at most SIGMA_CAP below the top
    (-inf for n <= 0: no threshold)."""
    if not n > 0:
        return -math.inf
    xs = x[candidates].double().clamp(max=torch.finfo(torch.float32).max)
    top = xs.max()
    return float(top - n * (top - xs).clamp(max=SIGMA_CAP).std(unbiased=False))


def assert_clear_rows_equal(got: torch.Tensor, ref: torch.Tensor, *nudged: torch.Tensor, fraction: float = 0.8):
    """`got` (float64 [B, V]) is the reference distribution `ref` on the rows whose kept set every
    `nudged` reference (a parameter moved a little) shares, within 2e-6 (relative); at least
    `fraction` of the rows are that clear. Returns the clear rows."""
    clear = torch.ones(len(ref), dtype=torch.bool)
    for other in nudged:
        clear &= ((ref > 0) == (other > 0)).all(-1)
    assert clear.float().mean() >= fraction, clear.float().mean()
    assert torch.equal(got[clear] > 0, ref[clear] > 0)
    assert torch.allclose(got[clear], ref[clear].to(got.dtype), rtol=2e-6, atol=0)
    return clear


def keep_typical(q: torch.Tensor, typical_p) -> torch.Tensor:
    """float64 [V]: locally typical sampling as transformers' TypicalLogitsWarper applies it to the
    distribution q the other filters left (the entropy H of q, each token's distance
    |-ln q - H|, sorted ascending; the first position whose cumulative mass reaches typical_p
    gives the distance kept, every token at or within it kept), renormalised; typical_p >= 1
    leaves q as it is."""
    if typical_p >= 1.0:
        return q
    kept = q > 0
    logq = torch.where(kept, q.log(), torch.zeros_like(q))
    entropy = -(q * logq).sum()
    distance = torch.where(kept, (-logq - entropy).abs(), torch.full_like(q, math.inf))
    order = torch.argsort(distance, stable=True)
    cumulative = torch.cumsum(q[order], 0)
    last = min(int((cumulative < typical_p).sum()), int(kept.sum()) - 1)
    band = torch.where(kept & (distance <= distance[order[last]]), q, torch.zeros_like(q))
    return band / band.sum()


def exclude_top_choices(q: torch.Tensor, xtc_probability, xtc_threshold) -> torch.Tensor:
    """float64 [V]: XTC as llama.cpp's llama_sampler_xtc (src/llama-sampling.cpp) applies it to
    the distribution q the other filters left, where its coin falls (xtc_probability 1; 0 is
    off, and the reference draws no coin): threshold above 0.5 or fewer than two tokens with
    q >= threshold leave q as it is; else every such token above the least likely of them is
    dropped (all tied at that one kept, where llama.cpp keeps one by its sort order), and the
    rest renormalised."""
    if xtc_probability not in (0.0, 1.0):
        raise ValueError("the reference takes xtc_probability 0 or 1 (no coin)")
    if xtc_probability == 0.0 or xtc_threshold > 0.5:
        return q
    top = (q >= xtc_threshold) & (q > 0)
    if int(top.sum()) < 2:
        return q
    kept = torch.where(q > q[top].min(), torch.zeros_like(q), q)
    return kept / kept.sum()


def sampling_reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, bitmask=None, slack=0.0,
                       epsilon_cutoff=0.0, eta_cutoff=0.0, top_n_sigma=-1.0, typical_p=1.0, xtc_probability=0.0,
                       xtc_threshold=0.1):
    """float64 [B, V]: the probability of drawing each token under the intersection semantics
    (epsilon_cutoff, eta_cutoff: p >= truncation_floor over the whole row, the top always kept;
    top_n_sigma: x >= sigma_threshold), then typical_p (keep_typical) and XTC
    (exclude_top_choices) over what they keep.

    Sort-based and in float64, independent of the kernels' algorithm. Scores are x / T in
    float32, +inf and overflow clamped to the finite range (the op's definition, so ties
    match), probabilities in float64. `slack` widens
    the top-p, min-p, epsilon and top-n-sigma filters by that relative amount, for a kept set that tolerates
    rounding at the cutoff. Rows with no allowed finite logit are all zero.
    """
    x, allowed = _logits_and_allowed(logits, bitmask)
    rows, vocab = x.shape
    out = torch.zeros(rows, vocab, dtype=torch.float64)
    for b in range(rows):
        temp = float(_row_value(temperature, b))
        cand = allowed[b] & (x[b] > float("-inf"))  # NaN fails the compare
        if not cand.any():
            continue
        if not temp > 0:
            best = torch.where(cand, x[b], torch.tensor(float("-inf"))).argmax()
            out[b, best] = 1.0
            continue
        # +inf counts as the largest finite logit; a quotient that overflows is clamped.
        big = torch.finfo(torch.float32).max
        s = torch.clamp(torch.clamp(x[b], max=big) / torch.tensor(temp, dtype=torch.float32), -big, big)
        s = torch.where(cand, s, torch.tensor(float("-inf")))
        s64 = s.double()
        p = torch.softmax(s64, dim=0)
        keep = cand.clone()
        k = int(_row_value(top_k, b))
        n = int(cand.sum())
        if 0 < k < n:
            kth = s.topk(k).values[-1]
            keep &= s >= kth
        mp = float(_row_value(min_p, b))
        if mp > 0:
            keep &= p >= min(mp, 1.0) * p.max() * (1 - slack)
        floor = truncation_floor(p, float(_row_value(epsilon_cutoff, b)), float(_row_value(eta_cutoff, b)))
        if floor > 0:
            keep &= (p >= floor * (1 - slack)) | (s == s.max())
        n_sigma = float(_row_value(top_n_sigma, b))
        keep &= x[b].clamp(max=big).double() >= sigma_threshold(x[b], cand, n_sigma * (1 + slack))
        tp = float(_row_value(top_p, b))
        if tp < 1:
            order = torch.argsort(s64, descending=True, stable=True)
            cum = torch.cumsum(p[order], 0)
            target = min(tp * (1 + slack), 1.0)
            last = int(torch.searchsorted(cum, torch.tensor([target], dtype=torch.float64)).clamp(max=n - 1))
            keep &= s >= s[order[last]]
        probs = torch.where(keep, p, torch.zeros_like(p))
        typical = keep_typical(probs / probs.sum(), float(_row_value(typical_p, b)))
        out[b] = exclude_top_choices(typical, float(_row_value(xtc_probability, b)), float(_row_value(xtc_threshold, b)))
    return out


def vllm_sampling_reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, bitmask=None, epsilon_cutoff=0.0,
                            eta_cutoff=0.0, top_n_sigma=-1.0, typical_p=1.0, xtc_probability=0.0, xtc_threshold=0.1):
    """float64 [B, V]: the probability of drawing each token as vLLM's sampler chains the
    filters (filter_apply_order="top_k_first"), written as vLLM writes it in torch, in float64.

    vllm/v1/worker/gpu/sample/sampler.py: temperature, then min-p on the scaled logits
    (min_p.py: x < max x + log(min_p) -> -inf), then apply_top_k_top_p_pytorch
    (vllm/v1/sample/ops/topk_topp_sampler.py: sort ascending, drop below the k-th largest, then
    softmax of what is left, drop while the ascending cumulative sum <= 1 - top_p, the top token
    kept), then softmax. Scores as `sampling_reference`'s; rows with nothing allowed all zero.
    epsilon_cutoff, eta_cutoff and top_n_sigma (not vLLM's) are applied as min-p is, before
    top-k: p >= truncation_floor over the whole row, the top kept; x >= sigma_threshold. typical_p
    and XTC (not vLLM's) last, as keep_typical and exclude_top_choices.
    """
    x, allowed = _logits_and_allowed(logits, bitmask)
    rows, vocab = x.shape
    big = torch.finfo(torch.float32).max
    out = torch.zeros(rows, vocab, dtype=torch.float64)
    for b in range(rows):
        cand = allowed[b] & (x[b] > float("-inf"))
        if not cand.any():
            continue
        temp = float(_row_value(temperature, b))
        s = torch.clamp(torch.clamp(x[b], max=big) / torch.tensor(temp, dtype=torch.float32), -big, big)
        scores = torch.where(cand, s.double(), torch.tensor(float("-inf"), dtype=torch.float64))
        mp = float(_row_value(min_p, b))
        if mp > 0:
            scores = scores.masked_fill(scores < scores.max() + math.log(min(mp, 1.0)), float("-inf"))
        full = torch.where(cand, s.double(), torch.tensor(float("-inf"), dtype=torch.float64)).softmax(-1)
        floor = truncation_floor(full, float(_row_value(epsilon_cutoff, b)), float(_row_value(eta_cutoff, b)))
        if floor > 0:
            scores = scores.masked_fill((full < floor) & (scores < scores.max()), float("-inf"))
        below_sigma = x[b].clamp(max=big).double() < sigma_threshold(x[b], cand, float(_row_value(top_n_sigma, b)))
        scores = scores.masked_fill(below_sigma, float("-inf"))
        k = int(_row_value(top_k, b))
        tp = float(_row_value(top_p, b))
        logits_sort, logits_idx = scores.sort(descending=False)
        if 0 < k < vocab:
            logits_sort = logits_sort.masked_fill(logits_sort < logits_sort[vocab - k], float("-inf"))
        if tp < 1:
            probs_sum = torch.cumsum(logits_sort.softmax(dim=-1), dim=-1)
            top_p_mask = probs_sum <= 1 - tp
            top_p_mask[-1] = False
            logits_sort = logits_sort.masked_fill(top_p_mask, float("-inf"))
        q = torch.empty_like(scores).scatter_(0, logits_idx, logits_sort).softmax(dim=-1)
        out[b] = exclude_top_choices(keep_typical(q, float(_row_value(typical_p, b))),
                                     float(_row_value(xtc_probability, b)), float(_row_value(xtc_threshold, b)))
    return out


def _per_row(value, rows: int) -> torch.Tensor:
    """float32 [rows, 1]: a number or a per-row tensor as a column."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().to(torch.float32).reshape(rows, 1)
    return torch.full((rows, 1), value, dtype=torch.float32)


def penalties_reference(logits, prompt_mask, output_counts, repetition_penalty=1.0, frequency_penalty=0.0,
                        presence_penalty=0.0, logit_bias_ids=None, logit_bias_values=None, rows=None,
                        penalty_order="vllm"):
    """The penalised logits, from the formula in float32 torch, rounded once to the logits' dtype;
    tokens neither seen (prompt or output) nor biased keep their bits.

    "vllm", as vLLM writes it: the logit biases first (each added in list order), then
    vllm/model_executor/layers/utils.py's apply_penalties: seen tokens x / r if x > 0 else
    x * r, then ``logits -= f * counts`` and ``logits -= p * (counts > 0)``, two roundings.
    "bias_last": the repetition step, then output tokens x - (f * count + p), then the biases."""
    batch, vocab = logits.shape
    state = torch.arange(batch) if rows is None else torch.as_tensor(rows).cpu()
    x = logits.detach().cpu().float().clone()
    in_prompt = unpack_bitmask(prompt_mask.cpu(), vocab)[state]
    count = output_counts.cpu()[state]
    r, f, p = (_per_row(v, batch) for v in (repetition_penalty, frequency_penalty, presence_penalty))
    seen = in_prompt | (count > 0)
    touched = seen.clone()

    def add_biases(x):
        if logit_bias_ids is not None:
            ids, values = logit_bias_ids.cpu(), logit_bias_values.cpu().float()
            for b in range(batch):
                for j in range(ids.shape[1]):
                    token = int(ids[b, j])
                    if 0 <= token < vocab:
                        x[b, token] = x[b, token] + values[b, j]
                        touched[b, token] = True
        return x

    if penalty_order == "vllm":
        x = add_biases(x)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - f * count.float()
        x = x - p * (count > 0)
    else:
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = torch.where(count > 0, x - (f * count.float() + p), x)
        x = add_biases(x)
    out = logits.detach().cpu().clone()
    out[touched] = x[touched].to(logits.dtype)
    return out


def penalty_state_reference(prompt_token_ids, output_token_ids, vocab):
    """(prompt_mask, output_counts) from -1 padded id rows: presence bits and bincounts."""
    present = torch.zeros(prompt_token_ids.shape[0], vocab, dtype=torch.bool)
    counts = torch.zeros(output_token_ids.shape[0], vocab, dtype=torch.int32)
    for r, ids in enumerate(prompt_token_ids.cpu()):
        present[r, ids[ids >= 0]] = True
    for r, ids in enumerate(output_token_ids.cpu()):
        counts[r] = torch.bincount(ids[ids >= 0], minlength=vocab).to(torch.int32)
    return pack_bitmask(present), counts


def support_scores(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, bitmask=None, mode="processed", slack=0.0,
                   filter_apply_order="joint", epsilon_cutoff=0.0, eta_cutoff=0.0, top_n_sigma=-1.0):
    """float32 [B, V]: the scores of the distribution `sample_with_logprobs` reports, -inf outside its support.

    "raw": the logits (NaN as -inf, +inf as the largest float), no temperature, filter or
    bitmask. "processed": the float32 scores x / T over `sampling_reference`'s kept set
    (`vllm_sampling_reference`'s for "top_k_first", without slack; greedy rows: the allowed
    logits at T = 1, no filter).
    """
    x = logits.detach().cpu().float()
    rows = x.shape[0]
    big = torch.finfo(torch.float32).max
    if mode == "raw":
        return torch.where(x > float("-inf"), x.clamp(max=big), torch.tensor(float("-inf")))
    temps = torch.tensor([float(_row_value(temperature, b)) for b in range(rows)])
    greedy = ~(temps > 0)  # (NaN too)
    temps = torch.where(greedy, 1.0, temps)

    def unless_greedy(value, off):
        value = torch.tensor([float(_row_value(value, b)) for b in range(rows)])
        return torch.where(greedy, off, value)

    filters = (logits, temps, unless_greedy(top_k, 0).long(), unless_greedy(top_p, 1.0), unless_greedy(min_p, 0.0))
    truncation = dict(epsilon_cutoff=unless_greedy(epsilon_cutoff, 0.0), eta_cutoff=unless_greedy(eta_cutoff, 0.0),
                      top_n_sigma=unless_greedy(top_n_sigma, -1.0))
    if filter_apply_order == "top_k_first":
        kept = vllm_sampling_reference(*filters, bitmask=bitmask, **truncation) > 0
    else:
        kept = sampling_reference(*filters, bitmask=bitmask, slack=slack, **truncation) > 0
    s = torch.clamp(x.clamp(max=big) / temps[:, None], -big, big)
    return torch.where(kept, s, torch.tensor(float("-inf")))


def logprobs_reference(logits, **kwargs):
    """float64 [B, V]: log_softmax of `support_scores` in float64."""
    return torch.log_softmax(support_scores(logits, **kwargs).double(), dim=-1)


def chi_square_p_value(counts, expected):
    """Upper tail of Pearson's chi-square (Wilson-Hilferty approximation), over cells expected > 0."""
    cells = expected > 0
    assert counts[~cells].sum() == 0, "a token outside the kept set was drawn"
    stat = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    df = int(cells.sum()) - 1
    if df <= 0:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def constraints_reference(bitmask: torch.Tensor, vocab: int, token_ids=None, prompt_lengths=0, min_tokens=0,
                          stop_token_ids=None, allowed_token_ids=None, suppress_tokens=None, bad_words=None,
                          no_repeat_ngram_size=0) -> torch.Tensor:
    """constrain_bitmask_'s result as bool [rows, vocab] (True: allowed; unpack_bitmask's form),
    row by row in Python lists, from its definition (the engines' loops: vLLM's allowed ids, min
    tokens and bad words, transformers' n-grams)."""
    rows = bitmask.shape[0]
    allowed = unpack_bitmask(bitmask, vocab).tolist()

    def per_row(value, b):
        return int(value[b]) if isinstance(value, torch.Tensor) else value

    def count(value, b):  # (device counts clamp to [-2^31, 2^31])
        return min(max(per_row(value, b), -(2**31)), 2**31)

    def row_list(t, b, nested=False):
        if t is None:
            return []
        shared = t.dim() == (2 if nested else 1)
        return (t if shared else t[b]).tolist()

    for b in range(rows):
        sequence = []
        for t in row_list(token_ids, b):
            if not 0 <= t < vocab:
                break
            sequence.append(t)
        excluded = set()
        listed = [a for a in row_list(allowed_token_ids, b) if 0 <= a < vocab]
        if listed:
            excluded |= set(range(vocab)) - set(listed)
        excluded |= {s for s in row_list(suppress_tokens, b) if 0 <= s < vocab}
        if len(sequence) - count(prompt_lengths, b) < count(min_tokens, b):
            excluded |= {s for s in row_list(stop_token_ids, b) if 0 <= s < vocab}
        for word in row_list(bad_words, b, nested=True):
            word = word[:next((i for i, t in enumerate(word) if not 0 <= t < vocab), len(word))]
            if word and len(word) - 1 <= len(sequence) and sequence[len(sequence) - len(word) + 1:] == word[:-1]:
                excluded.add(word[-1])
        n = per_row(no_repeat_ngram_size, b)
        if n > 0 and len(sequence) >= n:
            prefix = sequence[len(sequence) - n + 1:]
            excluded |= {sequence[i + n - 1] for i in range(len(sequence) - n + 1) if sequence[i:i + n - 1] == prefix}
        for v in excluded:
            allowed[b][v] = False
    return torch.tensor(allowed, dtype=torch.bool).reshape(rows, vocab)


def sequence_bias_reference(token_ids: torch.Tensor, sequences: torch.Tensor, biases: torch.Tensor,
                            vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sequence_bias' entries (ids int64, values float32 [B, N]) from its definition, in Python
    lists: per row, each completed sequence's last id and bias, those ending in one id summed in
    float32, in list order from 0, into the first such entry; (-1, 0) elsewhere."""
    rows, count = token_ids.shape[0], sequences.shape[-2]
    ids = [[-1] * count for _ in range(rows)]
    values = [[0.0] * count for _ in range(rows)]
    for b in range(rows):
        sequence = []
        for t in token_ids[b].tolist():
            if not 0 <= t < vocab:
                break
            sequence.append(t)
        words = (sequences if sequences.dim() == 2 else sequences[b]).tolist()
        row_biases = (biases if biases.dim() == 1 else biases[b]).to(torch.float32)
        first = {}  # last id -> the entry that holds its sum
        for n, word in enumerate(words):
            word = word[:next((i for i, t in enumerate(word) if not 0 <= t < vocab), len(word))]
            if not word or len(word) - 1 > len(sequence) or sequence[len(sequence) - len(word) + 1:] != word[:-1]:
                continue
            n0 = first.setdefault(word[-1], n)
            ids[b][n0] = word[-1]
            values[b][n0] = float(torch.tensor(values[b][n0], dtype=torch.float32) + row_biases[n])
    return torch.tensor(ids, dtype=torch.int64).reshape(rows, count), \
        torch.tensor(values, dtype=torch.float32).reshape(rows, count)


def dry_bias_reference(token_ids: torch.Tensor, vocab: int, multiplier=0.0, base=1.75, allowed_length=2,
                       penalty_last_n=-1, sequence_breakers=None) -> tuple[torch.Tensor, torch.Tensor]:
    """dry_bias' entries (ids int64, values float32 [B, L]) written from llama.cpp's
    llama_sampler_dry_apply, step by step, in Python lists and float64: the window, the restart
    limit from the latest breaker (searched from the end), each earlier position's repeat of
    the window's end by direct comparison (where llama.cpp runs the Z-algorithm), the largest
    repeat per following token, and its penalty, multiplier * base ** (repeat - allowed), the
    exponent capped at int(88.7228391 / ln base) as llama.cpp caps it; the penalty at the token's
    first candidate position, negated."""
    rows, length = token_ids.shape

    def per_row(value, b):
        return value[b].item() if isinstance(value, torch.Tensor) else value

    ids = [[-1] * length for _ in range(rows)]
    values = [[0.0] * length for _ in range(rows)]
    for b in range(rows):
        h = []
        for t in token_ids[b].tolist():
            if not 0 <= t < vocab:
                break
            h.append(t)
        mult = float(torch.tensor(per_row(multiplier, b), dtype=torch.float32))
        base_b = float(torch.tensor(per_row(base, b), dtype=torch.float32))
        allowed, last_n = int(per_row(allowed_length, b)), int(per_row(penalty_last_n, b))
        breakers = [] if sequence_breakers is None else \
            (sequence_breakers if sequence_breakers.dim() == 2 else sequence_breakers[b]).tolist()
        breakers = [w[:next((i for i, t in enumerate(w) if not 0 <= t < vocab), len(w))] for w in breakers]
        breakers = [w for w in breakers if w]
        n = len(h)
        if mult == 0 or base_b < 1 or last_n == 0:
            continue
        w = n if last_n < 0 else min(n, last_n)
        if w <= allowed:
            continue

        def rat(i):  # llama.cpp's ring_buffer::rat: the token i from the end
            return h[n - 1 - i]

        rep_limit = w
        for i in range(w):
            longest = max((len(br) - 1 for br in breakers if br[0] == rat(i) and len(br) - 1 <= i
                           and all(br[1 + o] == rat(i - o - 1) for o in range(len(br) - 1))), default=-1)
            if longest >= 0:
                rep_limit = i - longest
                break
        if rep_limit < allowed:
            continue
        longest_repeat, first_position = {}, {}
        for k in range(1, w):  # the repeat ending k tokens before the end
            m = 0
            while m + k < w and rat(m) == rat(m + k):
                m += 1
            m = min(m, rep_limit)
            if m >= allowed:
                token, position = rat(k - 1), n - k
                longest_repeat[token] = max(longest_repeat.get(token, 0), m)
                first_position[token] = min(first_position.get(token, position), position)
        max_exponent = int(88.7228391 / math.log(base_b)) if base_b > 1.000001 else 0
        single = {br[0] for br in breakers if len(br) == 1}
        for token, m in longest_repeat.items():
            if token in single:
                continue
            e = m - allowed
            if max_exponent > 0 and e > max_exponent:
                e = max_exponent
            ids[b][first_position[token]] = token
            values[b][first_position[token]] = -float(torch.tensor(mult * base_b ** e, dtype=torch.float32))
    return torch.tensor(ids, dtype=torch.int64).reshape(rows, length), \
        torch.tensor(values, dtype=torch.float32).reshape(rows, length)
