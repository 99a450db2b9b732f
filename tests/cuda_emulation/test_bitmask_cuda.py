"""The CUDA bitmask kernel against the CPU implementation, bit for bit: emulated on CPU tensors
(every layout, on GPUs of 1, 8 and 132 SMs), on a GPU where there is one, and what only a GPU
can show (device indices, CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_cuda
from cuda_emulation.cases import DTYPES, SMALL_CASES, SMS, assert_launched
from cuda_emulation.emulation import FLAVOR
from reference import bitmask_reference, random_bitmask


BITMASK_VOCABS = [1, 33, 1027] if SMALL_CASES else [1, 31, 33, 1000, 1027, 128257]
# (pad, offset): contiguous rows; rows of a padded buffer at an odd column; at an aligned one.
LAYOUTS = [(0, 0), (13, 3), (8, 8)]
ROWS = 5
# Repeated indices make two threads write the same fill value to the same logits: a race
# CUDA tolerates (equal values) and ThreadSanitizer rightly reports, so not under it.
INDICES = [4, 0, 2] if FLAVOR == "tsan" else [4, 0, 2, 2]


@pytest.mark.emulation
@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", BITMASK_VOCABS)
def test_bitmask_agrees_with_cpu(emulation, lp_cpu, sms, dtype, vocab):
    """In place (all rows, indices in any order and repeated, a vocab_size short of the width)
    and out of place, in every layout: the whole buffer, guard bands and padding included,
    equals the CPU's bit for bit."""
    g = torch.Generator().manual_seed(vocab + sms)
    for pad, offset in LAYOUTS:
        def view(buffer):
            stride = vocab + pad
            return buffer[8 : 8 + ROWS * stride].view(ROWS, stride)[:, offset : offset + vocab]

        def buffer():  # 8 spare elements at each end: guard bands the op must not touch
            return (torch.randn(ROWS * (vocab + pad) + 16, generator=g) * 5).to(dtype)

        for pattern in ["mixed", "words", "zeros", "ones"]:
            bitmask = random_bitmask(ROWS + 2, vocab, g, pattern)
            source = view(buffer())
            calls = {
                "in place": lambda lp, b: lp.apply_token_bitmask_inplace(view(b), bitmask),
                "indices": lambda lp, b: lp.apply_token_bitmask_inplace(view(b), bitmask, indices=INDICES),
                "vocab_size": lambda lp, b: lp.apply_token_bitmask_inplace(view(b), bitmask, vocab_size=max(vocab - 5, 1)),
                "out of place": lambda lp, b: lp.apply_packed_bitmask(source, bitmask, -7.5, out=view(b)),
            }
            for name, call in calls.items():
                ours = buffer()
                cpu = ours.clone()
                before = emulation.launches()
                with emulation.gpu(sms) as lp:
                    call(lp, ours)
                call(lp_cpu, cpu)
                assert_launched(emulation, before)
                assert same_bits(ours, cpu), (pad, offset, pattern, name)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def test_cuda_many_rows(cuda_target):
    g = torch.Generator().manual_seed(11)
    rows, vocab = 70000, 40  # past XGrammar's 65535-row grid limit
    logits = torch.randn(rows, vocab, generator=g)
    bitmask = random_bitmask(rows, vocab, g, "mixed")
    got = logits.clone().to(cuda_target.device)  # .to("cpu") alone would be logits itself
    cuda_target.lp.apply_token_bitmask_inplace(got, bitmask.to(cuda_target.device))
    assert torch.equal(got.cpu(), bitmask_reference(logits, bitmask))


@requires_cuda
def test_cuda_device_indices(lp):
    """Device indices are never read on the host: the kernel skips those out of range. (The
    emulation cannot show this: its indices are host tensors, which the binding checks.)"""
    g = torch.Generator().manual_seed(11)
    rows, vocab = 70000, 40
    logits = torch.randn(rows, vocab, generator=g)
    bitmask = random_bitmask(rows, vocab, g, "mixed")
    idx = torch.tensor([69999, 5, -3, 70000, 5], device="cuda")  # out-of-range device indices are skipped
    got = logits.cuda()
    lp.apply_token_bitmask_inplace(got, bitmask.cuda(), indices=idx)
    assert torch.equal(got.cpu(), bitmask_reference(logits, bitmask, indices=[69999, 5]))


@requires_cuda
def test_cuda_graph_capture(lp):
    logits = torch.randn(8, 1000, device="cuda")
    bitmask = torch.randint(-(2**31), 2**31 - 1, (8, 32), dtype=torch.int32, device="cuda")
    idx = torch.tensor([1, 3, 5], device="cuda")
    work = logits.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lp.apply_token_bitmask_inplace(work, bitmask, indices=idx)
    work.copy_(logits)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(work.cpu(), bitmask_reference(logits.cpu(), bitmask.cpu(), indices=[1, 3, 5]))
