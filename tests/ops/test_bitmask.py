"""Grammar bitmask ops against plain torch and XGrammar's own function, through the loader."""

import pytest
import torch
import xgrammar

from conftest import devices
from harness import names_as_subject
from reference import bitmask_reference, pack_bitmask, random_bitmask, unpack_bitmask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VOCABS = [1, 31, 32, 33, 1000, 128000, 128257]
PATTERNS = ["mixed", "zeros", "ones", "words"]


def rows_for(vocab):
    return 3 if vocab >= 100000 else 7


@pytest.mark.kernels_ci
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("device", devices())
def test_matches_reference_and_xgrammar(lp_variant, dtype, vocab, device):
    if device == "cuda" and lp_variant.__name__.startswith("_logits_processor_cpu"):
        pytest.skip("the CPU variant serves CPU tensors only")
    g = torch.Generator().manual_seed(vocab)
    rows = rows_for(vocab)
    for pattern in PATTERNS:
        logits = torch.randn(rows, vocab, generator=g).to(dtype)
        bitmask = random_bitmask(rows, vocab, g, pattern)
        expected = bitmask_reference(logits, bitmask)
        xgr = logits.clone()
        xgrammar.apply_token_bitmask_inplace(xgr, bitmask)
        assert torch.equal(expected, xgr), "the reference disagrees with XGrammar"
        got = logits.to(device, copy=True)
        lp_variant.apply_token_bitmask_inplace(got, bitmask.to(device))
        assert torch.equal(got.cpu(), expected), pattern
        source = logits.to(device, copy=True)
        out = lp_variant.apply_packed_bitmask(source, bitmask.to(device))
        assert torch.equal(out.cpu(), expected), pattern
        assert torch.equal(source.cpu(), logits), "the out-of-place op wrote its input"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_vocab_leaves_tail_untouched(lp, device, dtype):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 1100, generator=g).to(dtype)
    bitmask = random_bitmask(5, 1100, g, "zeros")
    for vocab_size in [0, 1, 31, 33, 1000, 1056, 1100]:
        got = logits.to(device, copy=True)
        lp.apply_token_bitmask_inplace(got, bitmask.to(device), vocab_size=vocab_size)
        xgr = logits.clone()
        xgrammar.apply_token_bitmask_inplace(xgr, bitmask, vocab_size=vocab_size)
        assert torch.equal(got.cpu(), xgr), vocab_size
        assert torch.equal(got.cpu()[:, vocab_size:], logits[:, vocab_size:])
        assert torch.isinf(got.cpu()[:, :vocab_size]).all()


@pytest.mark.parametrize("device", devices())
def test_bitmask_narrower_than_logits_masks_only_covered_columns(lp, device):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 100, generator=g)
    bitmask = random_bitmask(4, 64, g, "zeros")  # 2 words: 64 tokens
    got = logits.to(device, copy=True)
    with pytest.warns(UserWarning) as ours:
        lp.apply_token_bitmask_inplace(got, bitmask.to(device))
    assert torch.isinf(got.cpu()[:, :64]).all()
    assert torch.equal(got.cpu()[:, 64:], logits[:, 64:])
    with pytest.warns(UserWarning) as theirs:
        xgrammar.apply_token_bitmask_inplace(logits.clone(), bitmask)
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]  # XGrammar's warning
    assert ours[0].filename == __file__  # the caller's line: once per call site by default
    with pytest.warns(UserWarning):
        lp.apply_token_bitmask(got, bitmask.to(device))


def test_bitmask_warns_only_when_narrower_without_vocab_size(lp):
    import warnings
    logits = torch.randn(2, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lp.apply_token_bitmask_inplace(logits, torch.full((2, 4), -1, dtype=torch.int32))  # 128 >= 100
        lp.apply_token_bitmask_inplace(logits, torch.full((2, 2), -1, dtype=torch.int32), vocab_size=64)


@pytest.mark.kernels_ci
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("as_tensor", [False, True])
def test_indices_select_rows(lp, device, as_tensor):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 333, generator=g)
    bitmask = random_bitmask(12, 333, g, "mixed")  # batch sizes may differ with indices
    indices = [7, 0, 3, 3, 8]  # any order, duplicates allowed
    passed = torch.tensor(indices, device=device) if as_tensor else indices
    xgr = logits.clone()
    xgrammar.apply_token_bitmask_inplace(xgr, bitmask, indices=indices)
    assert torch.equal(xgr, bitmask_reference(logits, bitmask, indices=indices))
    got = logits.to(device, copy=True)
    lp.apply_token_bitmask_inplace(got, bitmask.to(device), indices=passed)
    assert torch.equal(got.cpu(), xgr)
    untouched = [r for r in range(9) if r not in indices]
    assert torch.equal(got.cpu()[untouched], logits[untouched])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_guard_bands(lp, device, dtype):
    """Rows of a view into a padded buffer (XGrammar's CUDA path once missed these)."""
    g = torch.Generator().manual_seed(4)
    rows, vocab, stride = 6, 1027, 1100
    buffer = torch.randn(rows * stride + 64, generator=g).to(dtype).to(device)
    original = buffer.clone()
    view = buffer[32 : 32 + rows * stride].view(rows, stride)[:, 5 : 5 + vocab]
    assert view.stride(0) == stride
    bitmask = random_bitmask(rows, vocab, g, "words").to(device)
    expected = bitmask_reference(view.cpu(), bitmask.cpu())
    lp.apply_token_bitmask_inplace(view, bitmask)
    assert torch.equal(view.cpu(), expected)
    # Everything outside the view is untouched: the guard bands and the padding of each row.
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[32 : 32 + rows * stride].view(rows, stride)[:, 5 : 5 + vocab] = False
    assert torch.equal(buffer[outside].cpu(), original[outside].cpu())

    out = torch.full((rows, vocab), 7.0, dtype=dtype, device=device)
    lp.apply_packed_bitmask(original[32 : 32 + rows * stride].view(rows, stride)[:, 5 : 5 + vocab], bitmask, out=out)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("device", devices())
def test_one_dimensional_logits(lp, device):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(100, generator=g)
    bitmask = random_bitmask(1, 100, g, "mixed")
    xgr = logits.clone()
    xgrammar.apply_token_bitmask_inplace(xgr, bitmask[0])
    assert torch.equal(xgr, bitmask_reference(logits, bitmask[0]))
    assert torch.isinf(xgr).any() and torch.isfinite(xgr).any()  # the mask keeps some tokens, not all
    for mask in [bitmask, bitmask[0]]:
        got = logits.to(device, copy=True)
        lp.apply_token_bitmask_inplace(got, mask.to(device))
        assert torch.equal(got.cpu(), xgr), mask.shape


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fill_value", [float("-inf"), -1e4])
def test_fully_masked_rows_get_the_fill_everywhere(lp, device, fill_value):
    """Both ops; a finite fill keeps such a row finite, so its softmax is uniform, not NaN."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 77, generator=g)
    bitmask = torch.zeros(3, 3, dtype=torch.int32, device=device)
    filled = torch.full((3, 77), fill_value)
    source = logits.to(device, copy=True)
    out = lp.apply_packed_bitmask(source, bitmask, fill_value)
    assert torch.equal(out.cpu(), filled)
    assert torch.equal(source.cpu(), logits)  # out of place: logits unchanged
    got = logits.to(device, copy=True)
    lp.apply_token_bitmask_inplace(got, bitmask, fill_value=fill_value)
    assert torch.equal(got.cpu(), filled)
    if fill_value > float("-inf"):
        assert torch.allclose(torch.softmax(out, dim=-1).cpu(), torch.full((3, 77), 1 / 77))


@pytest.mark.parametrize("device", devices())
def test_packed_bitmask_into_logits_itself(lp, device):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 200, generator=g)
    bitmask = random_bitmask(4, 200, g, "mixed")
    expected = bitmask_reference(logits, bitmask)
    x = logits.to(device, copy=True)
    assert lp.apply_packed_bitmask(x, bitmask.to(device), out=x) is x
    assert torch.equal(x.cpu(), expected)


def test_apply_token_bitmask_returns_logits(lp):
    logits = torch.randn(2, 64)
    bitmask = torch.tensor([[0, -1], [-1, 0]], dtype=torch.int32)
    expected = bitmask_reference(logits, bitmask)
    assert lp.apply_token_bitmask(logits, bitmask) is logits
    assert torch.equal(logits, expected)


def test_allocation_helpers_match_xgrammar(lp):
    for batch, vocab in [(1, 1), (3, 31), (2, 32), (5, 33), (4, 128257)]:
        assert lp.get_bitmask_shape(batch, vocab) == tuple(xgrammar.get_bitmask_shape(batch, vocab))
        mask = lp.allocate_token_bitmask(batch, vocab)
        assert torch.equal(mask, xgrammar.allocate_token_bitmask(batch, vocab))
        mask.zero_()
        lp.reset_token_bitmask(mask)
        assert (mask == -1).all()
    assert lp.bitmask_dtype == xgrammar.bitmask_dtype == torch.int32


def test_pack_unpack_roundtrip():
    g = torch.Generator().manual_seed(8)
    allowed = torch.rand(5, 70, generator=g) < 0.5
    assert torch.equal(unpack_bitmask(pack_bitmask(allowed), 70), allowed)


# --- bad input: each raises naming the argument, before anything is written -------------

def _bad_calls(device):
    mask = torch.full((4, 2), 0, dtype=torch.int32, device=device)
    return [
        ("bitmask", lambda lp, x: lp.apply_token_bitmask_inplace(x, mask.to(torch.int64))),
        ("logits", lambda lp, x: lp.apply_token_bitmask_inplace(x.to(torch.float64), mask)),
        ("logits", lambda lp, x: lp.apply_token_bitmask_inplace(x.view(2, 2, 64), mask)),
        ("bitmask", lambda lp, x: lp.apply_token_bitmask_inplace(x, mask[:3])),
        ("bitmask", lambda lp, x: lp.apply_token_bitmask_inplace(x, mask[:, :1], vocab_size=64)),
        ("vocab_size", lambda lp, x: lp.apply_token_bitmask_inplace(x, mask, vocab_size=-1)),
        ("vocab_size", lambda lp, x: lp.apply_token_bitmask_inplace(x, mask, vocab_size=65)),
        ("indices", lambda lp, x: lp.apply_token_bitmask_inplace(x, mask, indices=[0, 4])),
        ("indices", lambda lp, x: lp.apply_token_bitmask_inplace(x, mask, indices=[-1])),
        ("indices", lambda lp, x: lp.apply_token_bitmask_inplace(x, mask, indices=torch.tensor([0.0]))),
        ("indices", lambda lp, x: lp.apply_token_bitmask_inplace(x, mask, indices=torch.tensor([[0]]))),
        ("logits", lambda lp, x: lp.apply_token_bitmask_inplace(x.t(), mask)),
        ("bitmask", lambda lp, x: lp.apply_token_bitmask_inplace(x, torch.zeros(2, 4, dtype=torch.int32, device=device).t())),
        ("logits", lambda lp, x: lp.apply_token_bitmask_inplace(x[:1].expand(4, 64), mask)),
        ("out", lambda lp, x: lp.apply_packed_bitmask(x, mask, out=torch.empty(4, 63, device=device))),
        ("out", lambda lp, x: lp.apply_packed_bitmask(x, mask, out=torch.empty(4, 64, dtype=torch.half, device=device))),
        ("out", lambda lp, x: lp.apply_packed_bitmask(x, mask, out=torch.empty(64, 4, device=device).t())),
        ("bitmask", lambda lp, x: lp.apply_packed_bitmask(x, mask[:2])),
    ] + ([
        ("bitmask", lambda lp, x: lp.apply_token_bitmask_inplace(x, mask.cpu())),
        ("out", lambda lp, x: lp.apply_packed_bitmask(x, mask, out=torch.empty(4, 64))),
    ] if device == "cuda" else [])


@pytest.mark.kernels_ci
@pytest.mark.parametrize("device", devices())
def test_bad_input_raises_naming_the_argument(lp, device):
    for name, call in _bad_calls(device):
        x = torch.randn(4, 64, device=device)
        before = x.clone()
        with pytest.raises((RuntimeError, ValueError, TypeError, IndexError)) as info:
            call(lp, x)
        assert names_as_subject(str(info.value), name), (name, str(info.value))
        assert torch.equal(x, before), name


def test_overlapping_out_is_rejected(lp):
    buffer = torch.randn(4 * 64 + 1)
    logits = buffer[:256].view(4, 64)
    out = buffer[1:257].view(4, 64)
    with pytest.raises(RuntimeError, match="^out "):
        lp.apply_packed_bitmask(logits, torch.zeros(4, 2, dtype=torch.int32), out=out)


def test_empty_inputs_are_fine(lp):
    lp.apply_token_bitmask_inplace(torch.empty(0, 100), torch.empty(0, 4, dtype=torch.int32))
    lp.apply_token_bitmask_inplace(torch.empty(3, 0), torch.empty(3, 0, dtype=torch.int32))
    lp.apply_token_bitmask_inplace(torch.randn(3, 10), torch.zeros(3, 1, dtype=torch.int32), indices=[])
    assert lp.apply_packed_bitmask(torch.empty(0, 10), torch.empty(0, 1, dtype=torch.int32)).shape == (0, 10)


# --- torch integration --------------------------------------------------------------------

def test_opcheck(lp):
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 100, generator=g)
    bitmask = random_bitmask(4, 100, g, "mixed")
    ops = lp._ops.ops
    torch.library.opcheck(ops.apply_token_bitmask_inplace, (logits.clone(), bitmask, None, None, float("-inf")))
    torch.library.opcheck(ops.apply_token_bitmask_inplace, (logits.clone(), bitmask, 90, torch.tensor([2, 0]), -5.0))
    torch.library.opcheck(ops.apply_packed_bitmask, (logits, bitmask, float("-inf"), torch.empty_like(logits)))


def test_torch_compile_fullgraph(lp):
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(4, 100, generator=g)
    bitmask = random_bitmask(4, 100, g, "mixed")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, m):
        y = x * 2.0
        lp.apply_token_bitmask_inplace(y, m)
        return torch.softmax(lp.apply_packed_bitmask(y, m, -1e9), dim=-1)

    expected = torch.softmax(bitmask_reference(logits * 2.0, bitmask, fill_value=-1e9), dim=-1)
    assert torch.allclose(step(logits, bitmask), expected)
