"""The CUDA emulation's own behaviour (runtime.cpp, traffic.cpp): a failed launch's error, a
device without kernels, and the traffic counter behind `make traffic`."""

from __future__ import annotations

import pytest
import torch

from cuda_emulation.cases import DTYPES, unaligned_rows
from cuda_emulation.emulation import COUNTS_TRAFFIC, LAUNCH_OUT_OF_RESOURCES
from reference import random_bitmask

pytestmark = pytest.mark.emulation


# --- launch checks -------------------------------------------------------------------------

def test_failed_launch_raises_naming_op_and_gpu(emulation):
    logits = torch.randn(4, 100)
    bitmask = torch.zeros(4, 4, dtype=torch.int32)
    for op, call in [("sample", lambda lp: lp.sample(logits, seed=1)),
                     ("bitmask", lambda lp: lp.apply_token_bitmask_inplace(logits.clone(), bitmask))]:
        emulation.fail_next_launch(LAUNCH_OUT_OF_RESOURCES)
        with pytest.raises(RuntimeError) as info:
            call(emulation.lp)
        message = str(info.value)
        assert f"the {op} kernel failed to launch" in message, message
        assert "CUDA emulation (132 SMs) (cuda:0)" in message, message
        assert "too many resources requested for launch" in message, message
    call(emulation.lp)  # the failure was not sticky


def test_error_pending_before_a_launch_is_not_reported_as_its_own(emulation):
    """cudaGetLastError returns an earlier call's error too (a launch that succeeds leaves it):
    launch_kernel takes it first and raises it as what it is, launching nothing."""
    logits = torch.randn(4, 100)
    emulation.leave_error_pending()
    launches = emulation.launches()
    with pytest.raises(RuntimeError) as info:
        emulation.lp.sample(logits, seed=1)
    message = str(info.value)
    assert "the sample kernel was not launched: an earlier CUDA call left an error pending" in message, message
    assert "no kernel image is available" in message and "failed to launch" not in message, message
    assert emulation.launches() == launches
    assert torch.equal(emulation.lp.sample(logits, seed=1), emulation.lp.sample(logits, seed=1))  # taken once


def test_gpu_without_kernels_gets_a_clear_error(emulation):
    import tomllib

    from conftest import ROOT

    archs = tomllib.loads((ROOT / "build.toml").read_text())["kernel"]["logits_processor_cuda"]["cuda-capabilities"]
    with emulation.device(1, (7, 5), has_kernels=False) as lp:
        with pytest.raises(RuntimeError) as info:
            lp.sample(torch.randn(2, 10), seed=1)
    assert str(info.value) == ("logits-processor has no kernels for compute capability 7.5 "
                               "(CUDA emulation (132 SMs) (cuda:1)); supported: " + ", ".join(archs))
    emulation.lp.sample(torch.randn(2, 10), seed=1)  # device 0 still works


# --- the traffic counter behind `make traffic` ---------------------------------------------

@pytest.mark.traffic
@pytest.mark.skipif(not COUNTS_TRAFFIC, reason="the traffic build counts global-memory bytes")
def test_traffic_counts_exactly_the_global_bytes(emulation):
    """Greedy reads each logit once and writes one id per row; split over blocks, each chunk
    also publishes its winner, counts its arrival (an atomic: read and write) and the last
    chunk reads every winner. Nothing else (stacks, shared memory, parameters) counts."""
    rows, vocab = 4, 50000
    logits = torch.randn(rows, vocab)
    for sms, splits in [(1, 1), (132, 4)]:  # 132 SMs, 4 rows: ceil(50000 / 16384) = 4 chunks
        with emulation.gpu(sms) as lp:
            emulation.reset_traffic()
            lp.sample(logits, temperature=0.0)
            read, written = emulation.traffic()
        scratch_read = 0 if splits == 1 else rows * splits * (4 + 8)
        scratch_written = 0 if splits == 1 else rows * splits * (8 + 4)
        assert (read, written) == (4 * rows * vocab + scratch_read, 8 * rows + scratch_written), sms


@pytest.mark.traffic
@pytest.mark.skipif(not COUNTS_TRAFFIC, reason="the traffic build counts global-memory bytes")
@pytest.mark.parametrize("dtype", DTYPES)
def test_traffic_counts_vector_loads(emulation, lp_cpu, dtype):
    """The sampler reads logits and bitmask words by 16-byte loads wherever a row is aligned:
    greedy over rows of an odd stride that start one element in, with a bitmask of an odd row
    stride too, reads each logit and each word once, all but each row's edges (under 16 bytes
    at each end) by 16-byte loads."""
    g = torch.Generator().manual_seed(2)
    rows, vocab = 3, 10001
    size = torch.tensor([], dtype=dtype).element_size()
    logits = unaligned_rows(torch.randn(rows, vocab, generator=g).to(dtype))
    bitmask = random_bitmask(rows, vocab, g, "mixed")  # 313 words a row
    for extra, words in [({}, 0), (dict(bitmask=bitmask), bitmask.shape[1])]:
        with emulation.gpu(1) as lp:
            emulation.reset_traffic()
            got = lp.sample(logits, temperature=0.0, **extra)
            read, written = emulation.traffic()
            by_vectors = emulation.vector_read_bytes()
        assert torch.equal(got, lp_cpu.sample(logits, temperature=0.0, **extra))
        assert (read, written) == (rows * (vocab * size + 4 * words), 8 * rows), extra.keys()
        edges = 2 * 15 * (2 if words else 1)
        assert read - by_vectors <= rows * edges, (read, by_vectors)
