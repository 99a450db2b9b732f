"""Workloads for `kernels benchmark` (the Hub's benchmark runner and card section).

Each verify_* returns what a plain torch user would compute, so the runner's "Speedup" column
is this package against torch: masked_fill for the bitmask, and for the sampler the sort-based
filter of torch_reference.py. Sampled tokens cannot equal torch's draws (another RNG), so a
sampler verify returns our tokens where they lie in the reference's kept set and -2 where
they do not: it matches self.out exactly when every token is a legal draw. Greedy must be the
argmax itself.

  kernels benchmark .        # from the repository root, after `make build`
`bench.py` beside this file is the fuller side-by-side comparison with XGrammar and FlashInfer.
"""

import sys
from pathlib import Path

import torch

from kernels.benchmark import Benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the runner loads this file by path
from torch_reference import kept_probs, unpack_bitmask  # noqa: E402

VOCAB = 128000  # Llama 3's vocabulary, XGrammar's benchmark size
SAMPLER_VOCAB = 128256


def _device(requested: str) -> str:
    # The runner derives the device from torch's build: on a CUDA torch without a GPU it asks
    # for "cuda", which would fail; measure on the CPU there instead.
    return requested if requested != "cuda" or torch.cuda.is_available() else "cpu"


def _random_bitmask(batch: int, vocab: int, device: str) -> torch.Tensor:
    """Each bit a coin flip: about half the tokens masked, at random."""
    words = (vocab + 31) // 32
    return torch.randint(-(2**31), 2**31, (batch, words), dtype=torch.int64, device=device).to(torch.int32)


class TokenBitmaskBenchmark(Benchmark):
    seed = 0

    def _setup(self, batch: int, dtype: torch.dtype) -> None:
        device = _device(self.device)
        self.logits = torch.randn(batch, VOCAB, device=device).to(dtype)
        self.bitmask = _random_bitmask(batch, VOCAB, device)
        # In place on a copy: masking again with the same bitmask gives the same result.
        self.out = self.logits.clone()

    def _reference(self) -> torch.Tensor:
        return self.logits.masked_fill(~unpack_bitmask(self.bitmask, VOCAB), float("-inf"))

    def setup_inplace_b64_fp32(self):
        self._setup(64, torch.float32)

    def benchmark_inplace_b64_fp32(self):
        self.kernel.apply_token_bitmask_inplace(self.out, self.bitmask)

    def verify_inplace_b64_fp32(self):
        return self._reference()

    def setup_inplace_b64_bf16(self):
        self._setup(64, torch.bfloat16)

    def benchmark_inplace_b64_bf16(self):
        self.kernel.apply_token_bitmask_inplace(self.out, self.bitmask)

    def verify_inplace_b64_bf16(self):
        return self._reference()

    def setup_packed_b64_fp32(self):
        self._setup(64, torch.float32)

    def benchmark_packed_b64_fp32(self):
        self.kernel.apply_packed_bitmask(self.logits, self.bitmask, out=self.out)

    def verify_packed_b64_fp32(self):
        return self._reference()


class SampleBenchmark(Benchmark):
    seed = 0

    def _setup(self, batch: int, dtype: torch.dtype, bitmask: bool = False, **params) -> None:
        device = _device(self.device)
        self.logits = torch.randn(batch, SAMPLER_VOCAB, device=device).to(dtype)
        self.bitmask = _random_bitmask(batch, SAMPLER_VOCAB, device) if bitmask else None
        self.params = {"temperature": 1.0, **params}
        self.out = torch.empty(batch, dtype=torch.int64, device=device)
        self.offset = 0

    def _sample(self) -> None:
        # A new offset each call, as a decoding loop advances it.
        self.offset += 1
        self.kernel.sample(self.logits, **self.params, seed=1234, offset=self.offset,
                           bitmask=self.bitmask, out=self.out)

    def _legal_tokens(self) -> torch.Tensor:
        kept = kept_probs(self.logits, **self.params, bitmask=self.bitmask) > 0
        ids = self.out.clamp(0, self.logits.shape[1] - 1).unsqueeze(1)
        legal = kept.gather(1, ids).squeeze(1) & (self.out >= 0)
        return torch.where(legal, self.out, -2)

    def setup_greedy_b64_fp32(self):
        self._setup(64, torch.float32, temperature=0.0)

    def benchmark_greedy_b64_fp32(self):
        self._sample()

    def verify_greedy_b64_fp32(self):
        return self.logits.argmax(-1)

    def setup_top_k_top_p_b64_fp32(self):
        self._setup(64, torch.float32, top_k=50, top_p=0.9)

    def benchmark_top_k_top_p_b64_fp32(self):
        self._sample()

    def verify_top_k_top_p_b64_fp32(self):
        return self._legal_tokens()

    def setup_all_three_bitmask_b64_bf16(self):
        self._setup(64, torch.bfloat16, bitmask=True, top_k=50, top_p=0.9, min_p=0.1)

    def benchmark_all_three_bitmask_b64_bf16(self):
        self._sample()

    def verify_all_three_bitmask_b64_bf16(self):
        return self._legal_tokens()

    def setup_top_p_b1_fp32(self):
        self._setup(1, torch.float32, top_p=0.9)

    def benchmark_top_p_b1_fp32(self):
        self._sample()

    def verify_top_p_b1_fp32(self):
        return self._legal_tokens()
