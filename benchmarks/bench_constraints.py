"""Request constraints (constrain_bitmask_ then `sample` reading the bitmask; sequence_bias or
dry_bias then `sample` reading its entries as fused logit biases) beside plain `sample`, and the
passes a user writes instead: transformers' logits processors (and vLLM's masked_fill for
allowed ids; for DRY, a Python loop over the rows as text-generation-webui's), then `sample`
(`make bench`).

V = 128256, B in {1, 32}, bfloat16 logits, on the GPU where there is one, else the CPU. Each
constraint on its own, then all at once; a step = reset the bitmask, constrain it, sample
(what an engine runs per decode step). Each time is the median of interleaved calls (the
machine is shared: ratios, measured side by side, are the figures to read). The kept sets
are checked equal on the way.

  python benchmarks/bench_constraints.py [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from timing import bench_arguments, local_package, median_times, write_report
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                                                    NoRepeatNGramLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    SuppressTokensLogitsProcessor)

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128256
HISTORY = 1024  # generated tokens per row
STOP = [128001, 128008, 128009]


def constraints(batch: int, g: torch.Generator, device: str) -> dict:
    """Each constraint's keywords for constrain_bitmask_ and the transformers processor (or
    vLLM's mask) a user applies instead."""
    history = torch.randint(0, 2000, (batch, HISTORY), generator=g).to(device)
    allowed = torch.randint(0, VOCAB, (batch, 64), generator=g).to(device)
    disallowed = torch.ones(batch, VOCAB, dtype=torch.bool, device=device)
    disallowed.scatter_(1, allowed, False)  # vLLM's allowed_token_ids_mask, kept per request
    suppress = torch.randint(0, VOCAB, (16,), generator=g)
    words = torch.randint(0, 2000, (32, 3), generator=g)
    words[:8, :2] = history[0, -2:].cpu()  # 8 words whose prefix row 0 ends with
    return {
        "allowed_token_ids": (dict(allowed_token_ids=allowed),
                              lambda ids, x: x.masked_fill(disallowed, float("-inf"))),
        "suppress_tokens": (dict(suppress_tokens=suppress.to(device)), SuppressTokensLogitsProcessor(suppress.tolist())),
        "min_tokens": (dict(token_ids=history, min_tokens=2 * HISTORY, stop_token_ids=torch.tensor(STOP, device=device)),
                       MinNewTokensLengthLogitsProcessor(0, 2 * HISTORY, STOP)),
        "bad_words": (dict(token_ids=history, bad_words=words.to(device)), NoBadWordsLogitsProcessor(words.tolist())),
        "no_repeat_ngram_size": (dict(token_ids=history, no_repeat_ngram_size=3), NoRepeatNGramLogitsProcessor(3)),
    }


def main() -> int:
    args = bench_arguments(__doc__)
    lp, device, repeats = local_package(ROOT)
    print(f"bench_constraints: V={VOCAB}, history {HISTORY}, bfloat16, {device}", flush=True)
    print("| B | constraint | sample | constrained step | torch + sample | step / sample | torch / step |")
    print("|---|---|---|---|---|---|---|")
    report = []
    for batch in [32] if args.quick else [1, 32]:
        g = torch.Generator().manual_seed(batch)
        logits = (torch.randn(batch, VOCAB, generator=g) * 3).to(torch.bfloat16).to(device)
        cases = constraints(batch, g, device)
        every = {k: v for kwargs, _ in cases.values() for k, v in kwargs.items()}
        processors = [p for _, p in cases.values()]

        def chain(ids, x):
            for processor in processors:
                x = processor(ids, x)
            return x

        cases["all"] = (every, chain)
        bitmask = lp.allocate_token_bitmask(batch, VOCAB, device=device)
        out = torch.empty(batch, dtype=torch.int64, device=device)
        history = every["token_ids"]
        for name, (kwargs, processor) in cases.items():
            def step():
                lp.reset_token_bitmask(bitmask)
                lp.constrain_bitmask_(bitmask, VOCAB, **kwargs)
                return lp.sample(logits, seed=1, bitmask=bitmask, out=out)

            def theirs():
                return lp.sample(processor(history, logits.float()), seed=1)

            step()
            processed = processor(history, logits.float())
            same = bool(torch.equal(unpack(bitmask), torch.isfinite(processed)))
            calls = {"sample": lambda: lp.sample(logits, seed=1, out=out), "step": step, "torch": theirs}
            t = median_times(calls, device, repeats)
            report.append({"batch": batch, "constraint": name, "device": device, "seconds": t, "same_kept_set": same})
            print(f"| {batch} | {name} | {t['sample'] * 1e6:.0f} us | {t['step'] * 1e6:.0f} us | "
                  f"{t['torch'] * 1e6:.0f} us | {t['step'] / t['sample']:.2f} | "
                  f"{t['torch'] / t['step']:.1f}x{'' if same else ' (kept sets differ!)'} |", flush=True)
        report.append(sequence_bias_row(lp, batch, logits, history, g, device, repeats))
        report.append(dry_bias_row(lp, batch, logits, history, g, device, repeats))
    return write_report(args.json, report)


def sequence_bias_row(lp, batch: int, logits: torch.Tensor, history: torch.Tensor, g: torch.Generator,
                      device: str, repeats: int) -> dict:
    """sequence_bias (32 sequences of 1 to 3 ids, 8 completing on row 0) then `sample` with the
    entries as fused logit biases (a zero penalty state beside them), against transformers'
    SequenceBiasLogitsProcessor then `sample`. `same`: the entries, applied by apply_penalties_
    to the float32 logits, give the processor's scores bit for bit."""
    words = torch.randint(0, 2000, (32, 3), generator=g)
    words[:8, :2] = history[0, -2:].cpu()
    words[24:, 1:] = -1  # one-id sequences
    biases = torch.randn(32, generator=g) * 2
    processor = SequenceBiasLogitsProcessor([[[t for t in w if t >= 0], float(b)]
                                             for w, b in zip(words.tolist(), biases)])
    words, biases = words.to(device), biases.to(device)
    state = (torch.zeros(batch, (VOCAB + 31) // 32, dtype=torch.int32, device=device),
             torch.zeros(batch, VOCAB, dtype=torch.int32, device=device))
    entries = (torch.empty(batch, 32, dtype=torch.int64, device=device), torch.empty(batch, 32, device=device))
    penalties = lp.Penalties(*state, logit_bias_ids=entries[0], logit_bias_values=entries[1])
    out = torch.empty(batch, dtype=torch.int64, device=device)

    def step():
        lp.sequence_bias(history, words, biases, VOCAB, out=entries)
        return lp.sample(logits, seed=1, penalties=penalties, out=out)

    step()
    scores = logits.float()
    same = bool(torch.equal(lp.apply_penalties_(scores.clone(), *state, logit_bias_ids=entries[0],
                                                logit_bias_values=entries[1]), processor(history, scores)))
    calls = {"sample": lambda: lp.sample(logits, seed=1, out=out), "step": step,
             "torch": lambda: lp.sample(processor(history, logits.float()), seed=1)}
    t = median_times(calls, device, repeats)
    print(f"| {batch} | sequence_bias | {t['sample'] * 1e6:.0f} us | {t['step'] * 1e6:.0f} us | "
          f"{t['torch'] * 1e6:.0f} us | {t['step'] / t['sample']:.2f} | "
          f"{t['torch'] / t['step']:.1f}x{'' if same else ' (biases differ!)'} |", flush=True)
    return {"batch": batch, "constraint": "sequence_bias", "device": device, "seconds": t, "same_kept_set": same}


def python_dry(history: torch.Tensor, scores: torch.Tensor, breakers: set, multiplier: float, base: float,
               allowed: int) -> torch.Tensor:
    """DRY as a Python processor computes it (text-generation-webui's DRYLogitsProcessor: for each
    earlier occurrence of the last token, the match extended backwards, the longest per following
    token; no length cap here, as llama.cpp): scores, penalised in place."""
    for row, ids in enumerate(history.tolist()):
        if ids[-1] in breakers:
            continue
        longest = {}
        for i in range(len(ids) - 1):
            if ids[i] != ids[-1] or ids[i + 1] in breakers:
                continue
            m = 1
            while i - m >= 0 and ids[i - m] == ids[-1 - m] and ids[-1 - m] not in breakers:
                m += 1
            longest[ids[i + 1]] = max(m, longest.get(ids[i + 1], 0))
        for token, m in longest.items():
            if m >= allowed:
                scores[row, token] -= multiplier * base ** (m - allowed)
    return scores


def dry_bias_row(lp, batch: int, logits: torch.Tensor, history: torch.Tensor, g: torch.Generator,
                 device: str, repeats: int) -> dict:
    """dry_bias (llama.cpp's defaults but the multiplier 0.8; four one-id breakers; each row's last
    24 tokens repeating an earlier stretch) then `sample` with the entries as fused logit biases,
    against python_dry then `sample`. `same`: the entries, applied by apply_penalties_ to the
    float32 logits, give python_dry's scores bit for bit."""
    history = history.clone()
    for row in range(batch):
        start = int(torch.randint(0, HISTORY - 64, (1,), generator=g))
        history[row, -24:] = history[row, start:start + 24]
    breakers = [13, 25, 1, 9]  # (llama.cpp's "\n", ":", '"', "*" as Llama 3 ids)
    kwargs = dict(multiplier=0.8, base=1.75, allowed_length=2,
                  sequence_breakers=torch.tensor(breakers, device=device)[:, None])
    state = (torch.zeros(batch, (VOCAB + 31) // 32, dtype=torch.int32, device=device),
             torch.zeros(batch, VOCAB, dtype=torch.int32, device=device))
    entries = (torch.empty(batch, HISTORY, dtype=torch.int64, device=device),
               torch.empty(batch, HISTORY, device=device))
    penalties = lp.Penalties(*state, logit_bias_ids=entries[0], logit_bias_values=entries[1])
    out = torch.empty(batch, dtype=torch.int64, device=device)

    def step():
        lp.dry_bias(history, VOCAB, **kwargs, out=entries)
        return lp.sample(logits, seed=1, penalties=penalties, out=out)

    multiplier = float(torch.tensor(0.8))  # the kernel's float32 0.8

    def theirs():
        return lp.sample(python_dry(history, logits.float(), set(breakers), multiplier, 1.75, 2), seed=1)

    step()
    scores = logits.float()
    same = bool(torch.equal(lp.apply_penalties_(scores.clone(), *state, logit_bias_ids=entries[0],
                                                logit_bias_values=entries[1]),
                            python_dry(history, scores.clone(), set(breakers), multiplier, 1.75, 2)))
    calls = {"sample": lambda: lp.sample(logits, seed=1, out=out), "step": step, "torch": theirs}
    t = median_times(calls, device, repeats)
    print(f"| {batch} | dry_bias | {t['sample'] * 1e6:.0f} us | {t['step'] * 1e6:.0f} us | "
          f"{t['torch'] * 1e6:.0f} us | {t['step'] / t['sample']:.2f} | "
          f"{t['torch'] / t['step']:.1f}x{'' if same else ' (biases differ!)'} |", flush=True)
    return {"batch": batch, "constraint": "dry_bias", "device": device, "seconds": t, "same_kept_set": same}


def unpack(bitmask: torch.Tensor) -> torch.Tensor:
    """bool [B, V]: the allowed tokens of a packed bitmask."""
    v = torch.arange(VOCAB, device=bitmask.device)
    return ((bitmask.to(torch.int64)[:, v // 32] >> (v % 32)) & 1).bool()


if __name__ == "__main__":
    sys.exit(main())
