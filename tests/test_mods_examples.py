"""cuteattn.mods, the ready-made FlexAttention mods: each one's mask or scores on index grids,
its compile key (what the kernel traces: tensors as arguments, constants in the key), the same
results as the matching flash_attn_func argument on the reference, and (compile marker) each one
traced into the sm90 forward without spills."""
import os
import re
import warnings

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from cuteattn import flash_attn_func, mods  # noqa: E402
from cuteattn.kernels.launch_common import mod_key  # noqa: E402


def grid(fn, n=8, m=None, b=0, h=0):
    """fn over every (q_idx, kv_idx) of an n x m grid, as FlexAttention calls it (tensors)."""
    q = torch.arange(n).view(-1, 1)
    kv = torch.arange(m or n).view(1, -1)
    return fn(torch.tensor(b), torch.tensor(h), q, kv)


def test_causal_and_sliding_window():
    q, kv = torch.arange(8).view(-1, 1), torch.arange(8).view(1, -1)
    assert torch.equal(grid(mods.causal()), kv <= q)
    assert torch.equal(grid(mods.sliding_window(2, 1)), (kv >= q - 2) & (kv <= q + 1))
    assert torch.equal(grid(mods.sliding_window(3)), (kv >= q - 3) & (kv <= q))
    with pytest.raises(ValueError, match="left, right >= 0"):
        mods.sliding_window(-1)


def test_document_masks():
    fn = mods.document_from_lengths([2, 3, 0, 1])
    ids = torch.tensor([0, 0, 1, 1, 1, 3])
    want = ids.view(-1, 1) == ids.view(1, -1)
    assert torch.equal(grid(fn, 6), want)
    tri = torch.arange(6).view(1, -1) <= torch.arange(6).view(-1, 1)
    assert torch.equal(grid(mods.document_from_lengths([2, 3, 0, 1], causal=True), 6), want & tri)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        mods.document(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="non-negative"):
        mods.document_from_lengths([2, -1])


def test_prefix_lm():
    fn = mods.prefix_lm(torch.tensor([3, 0]))
    q, kv = torch.arange(6).view(-1, 1), torch.arange(6).view(1, -1)
    assert torch.equal(grid(fn, 6, b=0), (kv <= q) | (kv < 3))
    assert torch.equal(grid(fn, 6, b=1), kv <= q)


def test_alibi_and_softcap_scores():
    fn = mods.alibi(4)
    score = torch.zeros(1)
    bias = fn(score, torch.tensor(0), torch.tensor(1), torch.tensor(5), torch.tensor(2))
    assert torch.allclose(bias, torch.tensor([2.0 ** (-4.0) * -3]))
    cap = mods.softcap(10.0)
    s = torch.tensor([-50.0, 0.0, 3.0, 80.0])
    assert torch.allclose(cap(s, 0, 0, 0, 0), 10.0 * torch.tanh(s / 10.0))
    with pytest.raises(ValueError, match="cap > 0"):
        mods.softcap(0)


def test_keys_what_the_kernel_traces():
    """Tensors the mods read become kernel arguments; their constants are in the key."""
    assert mod_key(mods.sliding_window(64, 0)) != mod_key(mods.sliding_window(128, 0))
    assert mod_key(mods.document_from_lengths([4, 4])).tensors == (("int32", 1),)
    assert mod_key(mods.prefix_lm(torch.tensor([3]))).tensors == (("int32", 1),)
    assert mod_key(mods.alibi(8), "score_mod").tensors == (("float32", 1),)
    assert mod_key(mods.softcap(30.0), "score_mod").constants == (30.0,)


def test_same_as_the_matching_arguments_on_the_reference():
    """On the CPU reference: sliding_window equals window_size (seqlen_q == seqlen_k, where
    top-left and bottom-right agree), softcap equals softcap=, causal equals causal=True."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 70, 4, 32, dtype=torch.bfloat16) for _ in range(3))
    same = lambda a, b: torch.allclose(a.float(), b.float(), atol=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (CPU tensors: the reference, with its warning)
        assert same(flash_attn_func(q, k, v, mask_mod=mods.sliding_window(9, 3)),
                    flash_attn_func(q, k, v, window_size=(9, 3)))
        assert same(flash_attn_func(q, k, v, score_mod=mods.softcap(5.0)),
                    flash_attn_func(q, k, v, softcap=5.0))
        assert same(flash_attn_func(q, k, v, mask_mod=mods.causal()),
                    flash_attn_func(q, k, v, causal=True))
        assert not same(flash_attn_func(q, k, v, mask_mod=mods.causal()),
                        flash_attn_func(q, k, v))  # (the comparison can fail)


EXAMPLES = {
    "causal": ("mask_mod", lambda: mods.causal()),
    "sliding_window": ("mask_mod", lambda: mods.sliding_window(256, 0)),
    "document_causal": ("mask_mod", lambda: mods.document_from_lengths([100, 28], causal=True)),
    "prefix_lm": ("mask_mod", lambda: mods.prefix_lm(torch.tensor([5, 7]))),
    "alibi": ("score_mod", lambda: mods.alibi(8)),
    "softcap": ("score_mod", lambda: mods.softcap(30.0)),
}


@pytest.mark.compile
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_compile_forward_with_each_example(name, capfd, tmp_path, monkeypatch):
    """Every ready-made mod traces into the sm90 forward (d=128) without spills."""
    import cutlass
    from cuteattn.kernels.sm90 import config
    from cuteattn.kernels.sm90.compile import compile_fwd
    monkeypatch.chdir(tmp_path)
    kind, make = EXAMPLES[name]
    fn = make()
    key = {kind: mod_key(fn, kind)}
    cfg = config.fwd_config(cutlass.BFloat16, 128, 128, False, False, False, False, False, **key)
    fns = (fn, None) if kind == "mask_mod" else (None, fn)
    compile_fwd(cfg, options="--keep-ptx remarks{ptx}", mod_fns=fns)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0
