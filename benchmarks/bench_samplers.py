"""Truncation samplers beyond top-k, top-p and min-p (epsilon_cutoff, eta_cutoff, top_n_sigma, mirostat v2's
mirostat_mu, typical_p and XTC), llama.cpp's dynamic temperature, and min-p with and without temperature_last
beside plain `sample`, and the torch chain a user writes instead: transformers' warpers (for top-n-sigma, mirostat, XTC and dynatemp, which transformers lacks, their
definitions in torch), softmax, torch.multinomial (`make bench`); and mirostat along `verify_draft`'s
path beside the same call without it.

V = 128256, B in {1, 32}, bfloat16 logits (randn * 3), temperature 0.8, on the GPU where there
is one, else the CPU. Each time is the median of interleaved calls (the machine is shared:
ratios, measured side by side, are the figures to read). The kept sets are checked equal to the
warpers' in float64 (their finite scores against `filtered_logits`') on the way.

  python benchmarks/bench_samplers.py [--quick] [--json PATH]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from timing import bench_arguments, local_package, median_times, write_report
from transformers.generation.logits_process import (EpsilonLogitsWarper, EtaLogitsWarper, LogitsProcessorList,
                                                    MinPLogitsWarper, TemperatureLogitsWarper, TypicalLogitsWarper)

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128256
TEMPERATURE = 0.8



class TopNSigma:
    """Top-n-sigma as a user writes it in torch (llama.cpp's definition on the scores, the kept set
    being the same at any temperature): -inf below max - n * std."""

    def __init__(self, n: float):
        self.n = n

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        top, sigma = scores.amax(-1, keepdim=True), scores.std(-1, unbiased=False, keepdim=True)
        return scores.masked_fill(scores < top - self.n * sigma, float("-inf"))


class MirostatV2:
    """mirostat v2's truncation as a user writes it in torch (llama.cpp's llama_sampler_mirostat_v2):
    -inf where the surprise -log2 p exceeds mu, the top kept."""

    def __init__(self, mu: float):
        self.mu = mu

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        keep = (scores.log_softmax(-1) * (-1 / math.log(2)) <= self.mu) | (scores == scores.amax(-1, keepdim=True))
        return scores.masked_fill(~keep, float("-inf"))


class ExcludeTopChoices:
    """XTC with its coin fallen as a user writes it in torch (llama.cpp's llama_sampler_xtc): where
    two or more tokens have p >= threshold, -inf above the least likely of them."""

    def __init__(self, threshold: float):
        self.threshold = threshold

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        p = scores.softmax(-1)
        top = p >= self.threshold
        lowest = torch.where(top, scores, torch.inf).amin(-1, keepdim=True)
        return scores.masked_fill((top.sum(-1, keepdim=True) >= 2) & (scores > lowest), float("-inf"))


class DynamicTemperature:
    """llama.cpp's dynamic temperature as a user writes it in torch, after the temperature warper
    (so on x / T): the entropy of softmax(x) over ln V, then x / T'."""

    def __init__(self, temperature: float, dynatemp_range: float, exponent: float = 1.0):
        self.temperature, self.range, self.exponent = temperature, dynatemp_range, exponent

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        x = scores * self.temperature
        logp = x.log_softmax(-1)
        entropy = -(logp.exp() * logp).nansum(-1, keepdim=True)
        low, high = max(0.0, self.temperature - self.range), self.temperature + self.range
        dynamic = low + (high - low) * (entropy / math.log(x.shape[-1])) ** self.exponent
        return x / dynamic


# Each sampler: its keywords here, and the warpers applied after the temperature (with temperature_last,
# before it, on the logits).
SAMPLERS = {
    "min_p": (dict(min_p=0.05), [MinPLogitsWarper(0.05)]),
    "min_p temperature_last": (dict(min_p=0.05, temperature_last=True), [MinPLogitsWarper(0.05)]),
    "epsilon_cutoff": (dict(epsilon_cutoff=3e-4), [EpsilonLogitsWarper(3e-4)]),
    "eta_cutoff": (dict(eta_cutoff=2e-3), [EtaLogitsWarper(2e-3)]),
    "top_n_sigma": (dict(top_n_sigma=1.5), [TopNSigma(1.5)]),
    "mirostat_mu": (dict(mirostat_mu=10.0), [MirostatV2(10.0)]),
    "typical_p": (dict(typical_p=0.9), [TypicalLogitsWarper(0.9)]),
    "xtc": (dict(xtc_probability=1.0, xtc_threshold=0.001), [ExcludeTopChoices(0.001)]),
    "dynatemp_range": (dict(dynatemp_range=0.5), [DynamicTemperature(TEMPERATURE, 0.5)]),
}


def main() -> int:
    args = bench_arguments(__doc__)
    lp, device, repeats = local_package(ROOT)
    print(f"bench_samplers: V={VOCAB}, bfloat16, temperature {TEMPERATURE}, {device}", flush=True)
    print("| B | sampler | sample | with the sampler | torch chain | sampler / sample | torch / sampler |")
    print("|---|---|---|---|---|---|---|")
    report = []
    for batch in [32] if args.quick else [1, 32]:
        g = torch.Generator().manual_seed(batch)
        logits = (torch.randn(batch, VOCAB, generator=g) * 3).to(torch.bfloat16).to(device)
        out = torch.empty(batch, dtype=torch.int64, device=device)
        for name, (kwargs, warpers) in SAMPLERS.items():
            last = kwargs.get("temperature_last", False)
            temperature = [TemperatureLogitsWarper(TEMPERATURE)]
            chain = LogitsProcessorList([*warpers, *temperature] if last else [*temperature, *warpers])

            def theirs():
                return torch.multinomial(chain(None, logits.float()).softmax(-1), 1)

            # (the warpers on the kernels' float32 scores x / T, in float64: transformers' float32
            # typical warper sums 128k probabilities in float32, whose rounding moves its cut)
            kept = torch.isfinite(LogitsProcessorList(warpers)(None, (logits.float() / (1.0 if last else TEMPERATURE)).double()))
            ours = lp.filtered_logits(logits, temperature=TEMPERATURE, **kwargs) > float("-inf")
            same = bool(torch.equal(kept, ours))
            calls = {"sample": lambda: lp.sample(logits, temperature=TEMPERATURE, seed=1, out=out),
                     "sampler": lambda: lp.sample(logits, temperature=TEMPERATURE, seed=1, out=out, **kwargs),
                     "torch": theirs}
            t = median_times(calls, device, repeats)
            report.append({"batch": batch, "sampler": name, "device": device, "seconds": t, "same_kept_set": same,
                           "kept_per_row": float(ours.sum(-1).float().mean())})
            print(f"| {batch} | {name} | {t['sample'] * 1e6:.0f} us | {t['sampler'] * 1e6:.0f} us | "
                  f"{t['torch'] * 1e6:.0f} us | {t['sampler'] / t['sample']:.2f} | "
                  f"{t['torch'] / t['sampler']:.1f}x{'' if same else ' (kept sets differ!)'} |", flush=True)
    report += verify_with_mirostat(lp, device, repeats, [32] if args.quick else [1, 32])
    return write_report(args.json, report)


def verify_with_mirostat(lp, device, repeats, batches) -> list:
    """mirostat along the path of `verify_draft` (S = 4 drafts, each position's argmax: point
    masses) beside the same call without it; mu reset to 10 bits before each call (the op advances
    it). The positions walked differ with the kept sets: their mean is printed beside."""
    print("\n| B | verify_draft | with mirostat_mu | mirostat / plain | positions walked (plain, mirostat) |")
    print("|---|---|---|---|---|")
    report = []
    for batch in batches:
        g = torch.Generator().manual_seed(100 + batch)
        target = (torch.randn(batch, 5, VOCAB, generator=g) * 3).to(torch.bfloat16).to(device)
        drafts = target[:, :-1].float().argmax(-1)
        out = (torch.empty(batch, 5, dtype=torch.int64, device=device), torch.empty(batch, dtype=torch.int64, device=device))
        mu = torch.full((batch,), 10.0, device=device)

        def verify(mirostat: bool):
            kwargs = dict(mirostat_mu=mu.fill_(10.0), mirostat_tau=5.0, mirostat_eta=0.1) if mirostat else {}
            return lp.verify_draft(target, drafts, temperature=TEMPERATURE, seed=1, out=out, **kwargs)

        walked = [float(verify(m).num_accepted.float().mean()) + 1 for m in (False, True)]
        t = median_times({"plain": lambda: verify(False), "mirostat": lambda: verify(True)}, device, repeats)
        report.append({"batch": batch, "sampler": "verify_draft mirostat_mu", "device": device, "seconds": t,
                       "positions_walked": walked})
        print(f"| {batch} | {t['plain'] * 1e6:.0f} us | {t['mirostat'] * 1e6:.0f} us | "
              f"{t['mirostat'] / t['plain']:.2f} | {walked[0]:.2f}, {walked[1]:.2f} |", flush=True)
    return report


if __name__ == "__main__":
    sys.exit(main())
