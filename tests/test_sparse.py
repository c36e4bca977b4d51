"""Block-sparse metadata, its builders and FlexAttention's modifiers, on the CPU (the reference
computes; no kernel takes them yet): the dense mask each form means, the exact expansion of a
logical mask to finer physical blocks, gradients, and the argument rules."""

import dataclasses
import itertools
import warnings

import pytest
import torch

from cuteattn import flash_attn_func, flash_attn_varlen_func, sparse
from cuteattn.reference import attention_ref

BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("quiet_fallback")


def token_mask(block_mask, qb, kb, sq, sk):
    """The token-level mask of a block mask, by loops (independent of BlockSparseMask.dense)."""
    B, H, nq, nk = block_mask.shape
    out = torch.zeros(B, H, sq, sk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            out[:, :, i * qb:(i + 1) * qb, j * kb:(j + 1) * kb] = block_mask[:, :, i:i + 1, j:j + 1]
    return out


def test_from_block_mask_lists_and_dense(seed):
    bm = torch.rand(2, 3, 4, 5) < 0.4
    m = sparse.from_block_mask(bm, 16, 32)
    full, partial = m.block_masks()
    assert torch.equal(full, bm) and not partial.any()
    assert torch.equal(m.full_count, bm.sum(-1, dtype=torch.int32))
    first = m.full_index[..., 0]
    has = m.full_count > 0
    assert torch.all(bm.gather(-1, first.long().unsqueeze(-1)).squeeze(-1)[has])
    assert torch.equal(m.dense(60, 150), token_mask(bm, 16, 32, 60, 150))


@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_compacted_lists_equal_a_stable_sort(seed, density):
    """sparse._compact (a running count and one scatter) gives what a stable sort of each row
    gives: the selected blocks in increasing order, then the unselected ones in increasing
    order; on a broadcast (expanded) mask too."""
    for shape in ((2, 3, 7, 33), (1, 12, 64, 128), (3, 1, 4, 1)):
        mask = torch.rand(shape) < density
        if shape[0] == 1:
            mask = mask.expand(2, -1, -1, -1)
        count, index = sparse._compact(mask)
        assert torch.equal(count, mask.sum(-1, dtype=torch.int32))
        want = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        assert index.dtype == torch.int32 and torch.equal(index, want)


def test_topk_and_expansion_select_the_same_pairs(seed):
    """VSA: top-k key blocks of a 64x64 logical mask; expanded to 32x16 physical blocks the
    dense mask, and the attention, are identical."""
    idx = torch.randint(0, 6, (1, 2, 3, 2))
    logical = sparse.from_topk(idx, 6, 64, 64)
    physical = sparse.expand(logical, 32, 16)
    assert physical.num_blocks == (6, 24)
    direct = sparse.from_topk(idx, 6, 64, 64, physical=(32, 16))  # (built at 32x16 at once)
    for name in ("full_count", "full_index", "partial_count", "partial_index"):
        assert torch.equal(getattr(direct, name), getattr(physical, name)), name
    assert torch.equal(logical.dense(180, 350), physical.dense(180, 350))
    q = torch.randn(1, 180, 2, 64, dtype=BF16)
    k, v = torch.randn(1, 350, 2, 64, dtype=BF16), torch.randn(1, 350, 2, 64, dtype=BF16)
    assert torch.equal(flash_attn_func(q, k, v, block_sparse=logical),
                       flash_attn_func(q, k, v, block_sparse=physical))


@pytest.mark.parametrize("fine_block", [(128, 128), (128, 64), (64, 64), (256, 32)])
def test_expanded_lists_equal_the_fine_masks_compacted(seed, fine_block):
    """expand rewrites the lists themselves; for the builders' lists that is, bit for bit, what
    compacting the fine block masks gives (the lists the kernels walk, and their order)."""
    selected = torch.rand(1, 3, 5, 7) < 0.4
    partial = selected & (torch.rand(1, 3, 5, 7) < 0.5)
    logical = sparse.from_block_mask(selected, 256, 256, partial)
    got = sparse.expand(logical, *fine_block)
    rq, rk = 256 // fine_block[0], 256 // fine_block[1]
    fine = lambda m: m.repeat_interleave(rq, 2).repeat_interleave(rk, 3)
    want = sparse.from_block_mask(fine(selected), *fine_block, fine(partial))
    for name in ("full_count", "full_index", "partial_count", "partial_index"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == torch.int32 and torch.equal(g, w), name
    assert torch.equal(got.dense(1200, 1700), logical.dense(1200, 1700))
    all_full = sparse.from_block_mask(selected, 256, 256)  # (its own path: no partial compaction)
    none_partial = sparse.from_block_mask(selected, 256, 256, torch.zeros_like(selected))
    for name in ("full_count", "full_index", "partial_count", "partial_index"):
        assert torch.equal(getattr(all_full, name), getattr(none_partial, name)), name


def test_from_mask_mod_classifies_blocks(seed):
    causal = lambda b, h, q, kv: q >= kv
    m = sparse.from_mask_mod(causal, 1, 1, 100, 100, 32, 32)
    full, partial = m.block_masks()
    assert torch.equal(full[0, 0], torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool))
    assert torch.equal(partial[0, 0], torch.eye(4, dtype=torch.bool))
    dense = m.dense(100, 100, causal)
    assert torch.equal(dense[0, 0], torch.ones(100, 100, dtype=torch.bool).tril())


@pytest.mark.parametrize("name", ["causal", "document", "prefix_lm", "sliding"])
def test_mask_mods_equal_their_dense_masks(seed, name):
    S = 70
    doc = torch.tensor([0] * 30 + [1] * 25 + [2] * 15)
    mods = {
        "causal": lambda b, h, q, kv: q >= kv,
        "document": lambda b, h, q, kv: doc[q] == doc[kv],
        "prefix_lm": lambda b, h, q, kv: (kv < 20) | (q >= kv),
        "sliding": lambda b, h, q, kv: (q - kv).abs() <= 8,
    }
    q, k, v = (torch.randn(2, S, 2, 64, dtype=BF16) for _ in range(3))
    out, lse = flash_attn_func(q, k, v, mask_mod=mods[name], return_lse=True)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    dense = mods[name](None, None, i, j)
    ref_s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / 8.0
    ref_s = ref_s.masked_fill(~dense, float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(ref_s, -1), v.float())
    assert torch.allclose(out.float(), ref, atol=2e-2)
    # the same mask as block-sparse metadata with the mod on partial blocks
    m = sparse.from_mask_mod(mods[name], 1, 1, S, S, 16, 16)
    assert torch.allclose(flash_attn_func(q, k, v, block_sparse=m, mask_mod=mods[name]).float(),
                          out.float(), atol=1e-2)


def test_score_mods_alibi_and_softcap_with_gradients(seed):
    """ALiBi as a score_mod, with its slopes learnable; softcap as a score_mod equals softcap=."""
    q, k, v = (torch.randn(1, 12, 4, 64, dtype=BF16, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
    alibi = lambda s, b, h, qi, kv: s + slopes[h] * (kv - qi)
    out = flash_attn_func(q, k, v, causal=True, score_mod=alibi)
    out.float().sum().backward()
    assert slopes.grad is not None and slopes.grad.abs().sum() > 0 and q.grad is not None
    cap = lambda s, b, h, qi, kv: 5.0 * torch.tanh(s / 5.0)
    with torch.no_grad():
        a = flash_attn_func(q, k, v, causal=True, score_mod=cap)
        b = flash_attn_func(q, k, v, causal=True, softcap=5.0)
    assert torch.allclose(a.float(), b.float(), atol=1e-2)


def test_empty_rows_and_block_lists(seed):
    """A query block with no key block: its rows get 0 and -inf."""
    bm = torch.zeros(1, 1, 2, 2, dtype=torch.bool)
    bm[0, 0, 1, 0] = True
    q, k, v = (torch.randn(1, 40, 1, 64, dtype=BF16) for _ in range(3))
    out, lse = flash_attn_func(q, k, v, block_sparse=sparse.from_block_mask(bm, 32, 32),
                               return_lse=True)
    assert torch.all(out[:, :32] == 0) and torch.isneginf(lse[:, :, :32]).all()
    ref, _ = attention_ref(q[:, 32:], k[:, :32], v[:, :32], softmax_scale=64 ** -0.5)
    assert torch.allclose(out[:, 32:].float(), ref, atol=2e-2)


def test_bad_metadata_is_a_clear_error():
    q = torch.randn(1, 40, 2, 64, dtype=BF16)
    good = sparse.from_block_mask(torch.ones(1, 2, 2, 2, dtype=torch.bool), 32, 32)
    with pytest.raises(ValueError, match="must have shape"):
        flash_attn_func(q.repeat(1, 3, 1, 1), q, q, block_sparse=good)  # 4 query blocks, not 2
    bad = sparse.BlockSparseMask(32, 32, good.full_count + 5, good.full_index,
                                 good.partial_count, good.partial_index)
    with pytest.raises(ValueError, match="count outside"):
        flash_attn_func(q, q, q, block_sparse=bad)
    # a key block listed twice (the forward kernel would count it twice): refused where the
    # values are read, within one list or across both
    twice = good.full_index.clone()
    twice[..., 1] = twice[..., 0]
    repeated = sparse.BlockSparseMask(32, 32, good.full_count, twice, good.partial_count,
                                      good.partial_index)
    with pytest.raises(ValueError, match="more than once"):
        flash_attn_func(q, q, q, block_sparse=repeated)
    half = torch.tensor([1], dtype=torch.int32).expand(1, 2, 2)
    both = sparse.BlockSparseMask(32, 32, half, good.full_index, half, good.full_index)
    with pytest.raises(ValueError, match="more than once"):
        flash_attn_func(q, q, q, block_sparse=both)
    wrong = sparse.BlockSparseMask(32, 32, good.full_count, good.full_index.long(),
                                   good.partial_count, good.partial_index)
    with pytest.raises(ValueError, match="must be int32"):
        flash_attn_func(q, q, q, block_sparse=wrong)
    with pytest.raises(ValueError, match="multiple of 16"):
        sparse.from_block_mask(torch.ones(1, 1, 1, 1, dtype=torch.bool), 24, 32)
    with pytest.raises(TypeError, match="mask_mod must be callable"):
        flash_attn_func(q, q, q, mask_mod=3)
    with pytest.raises(RuntimeError, match="strict"):
        flash_attn_func(q, q, q, mask_mod=lambda b, h, i, j: i >= j, strict=True)


def test_varlen_mods_see_sequence_indices_and_positions(seed):
    """Packed sequences: b is the sequence's index, q_idx / kv_idx positions inside it; equal to
    each sequence run alone through flash_attn_func with its own b."""
    from cuteattn import flash_attn_varlen_func
    lens = [9, 0, 14]
    cu = torch.tensor([0, 9, 9, 23], dtype=torch.int32)
    q, k, v = (torch.randn(23, 2, 64, dtype=BF16, requires_grad=True) for _ in range(3))
    bias = torch.tensor([0.0, 5.0, -1.0])
    score_mod = lambda s, b, h, qi, kv: s + bias[b] * (kv == 0)
    mask_mod = lambda b, h, qi, kv: (qi - kv).abs() <= 3 + b
    every = torch.ones(3, 1, 1, 1, dtype=torch.bool)
    blocks = sparse.from_block_mask(every, 16, 16, partial=every)  # partial: the mask_mod decides
    out = flash_attn_varlen_func(q, k, v, cu, cu, 14, 14, score_mod=score_mod, mask_mod=mask_mod,
                                 block_sparse=blocks)
    for b, (start, n) in enumerate(((0, 9), (9, 0), (9, 14))):
        if n == 0:
            continue
        rows = slice(start, start + n)
        alone = flash_attn_func(*(t[rows][None] for t in (q, k, v)),
                                score_mod=lambda s, bb, h, qi, kv, b=b: score_mod(s, bb + b, h, qi, kv),
                                mask_mod=lambda bb, h, qi, kv, b=b: mask_mod(bb + b, h, qi, kv))
        assert torch.equal(out[rows], alone[0])
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()


def test_full_blocks_skip_the_mask_mod(seed):
    """FlashAttention-4's semantics: a full block attends every pair whatever mask_mod says; a
    partial one applies it."""
    q, k, v = (torch.randn(1, 32, 1, 64, dtype=BF16) for _ in range(3))
    never = lambda b, h, qi, kv: qi < 0
    every = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    full = flash_attn_func(q, k, v, block_sparse=sparse.from_block_mask(every, 32, 32), mask_mod=never)
    assert torch.equal(full, flash_attn_func(q, k, v))
    partial = flash_attn_func(q, k, v, block_sparse=sparse.from_block_mask(every, 32, 32, every),
                              mask_mod=never)
    assert torch.all(partial == 0)


def test_block_sparse_calls_reach_the_kernel_once_dispatched(monkeypatch):
    """Host side of the block-sparse kernel path, with stand-ins for the kernels: the first call
    dispatches (the kernel's spec carries the lists' block shape), a repeated call with the same
    signature reuses the launch without dispatching again, a coarser mask is expanded to a
    kernel block shape first, and a call that needs gradients runs the forward kernel under an
    autograd function whose backward launch gets the transposed lists."""
    from cuteattn import api
    launched, dispatched, backward_lists = [], [], []

    def launch(q, k, v, out, lse, sparse=None):
        launched.append(sparse)
        out.zero_()
        lse.zero_()

    def backward(dout, q, k, v, out, lse, sparse=()):
        backward_lists.append(sparse)
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    def select(spec, device):
        dispatched.append((spec.kind, spec.sparse_q_block, spec.sparse_kv_block))
        return (backward if spec.kind == "bwd" else launch), None

    monkeypatch.setattr(api, "_select_kernel", select)
    monkeypatch.setattr(api, "_sparse_reason", lambda q, sink: None)
    monkeypatch.setattr(api, "_launches", {})
    q = torch.randn(1, 256, 2, 64, dtype=torch.bfloat16)
    lists = sparse.from_topk(torch.tensor([[[[0], [1]]]]).expand(1, 2, 2, 1), 2, 128, 128)
    for _ in range(3):
        out = flash_attn_func(q, q, q, block_sparse=lists)
        assert out.shape == q.shape and bool((out == 0).all())
    assert dispatched == [("fwd", 128, 128)] and len(launched) == 3
    assert launched[0][1] is lists.full_index  # the caller's lists, not copies
    logical = sparse.from_topk(torch.tensor([[[[0]]]]), 1, 256, 256)
    flash_attn_func(q, q, q, block_sparse=logical)
    assert dispatched[-1] == ("fwd", 128, 128) and launched[-1][1].shape[-2:] == (2, 2)
    # gradients: the kept launch is not taken for them; the backward is dispatched too
    qg = q.clone().requires_grad_()
    out = flash_attn_func(qg, q, q, block_sparse=lists)
    assert ("bwd", 128, 128) in dispatched and out.requires_grad
    out.sum().backward()
    assert bool((qg.grad == 1).all())
    (full_count, full_index, partial_count, partial_index, halves, turns), = backward_lists
    assert halves is None and turns is None  # (128-key lists, deterministic=False)
    # query block b attends key block b: transposed, key block n is seen by query block n
    assert full_count.tolist() == [[[1, 1], [1, 1]]] and full_index[..., 0].tolist() == [[[0, 1], [0, 1]]]
    assert int(partial_count.sum()) == 0


@pytest.mark.parametrize("nk", [6, 7])
def test_transpose_paired_lists_the_union_and_each_half(nk):
    """sparse.transpose_paired (lists of 64-key blocks for a backward of 128-key blocks): per
    pair of key blocks the query blocks either attends (as partial blocks), and per 64-key
    block exactly the query blocks it attends (an odd last block pairs with nothing)."""
    torch.manual_seed(nk)
    selected = torch.rand(2, 3, 5, nk) < 0.4
    partial = selected & (torch.rand(2, 3, 5, nk) < 0.4)
    mask = sparse.from_block_mask(selected, 128, 64, partial)
    pairs, halves = sparse.transpose_paired(mask)
    assert (pairs.q_block, pairs.kv_block) == (128, 128) and halves.dtype == torch.int32
    seen = selected.transpose(-1, -2)
    assert torch.equal(halves, seen.to(torch.int32))
    padded = torch.cat([seen, torch.zeros(2, 3, nk % 2, 5, dtype=torch.bool)], dim=2)
    union = padded.view(2, 3, -1, 2, 5).any(-2)
    p_full, p_part = pairs.block_masks()
    assert not p_full.any() and torch.equal(p_part, union)

def test_block_sparse_deterministic_reaches_the_backward_spec(monkeypatch):
    """deterministic=True with block-sparse lists reaches the spec the backward kernel is chosen
    by (a kernel that cannot promise bitwise-reproducible gradients must be able to decline it),
    and deterministic=False leaves it off."""
    from cuteattn import api
    specs = []

    def select(spec, device):
        specs.append(spec)
        return None, "stand-in: no kernel"

    monkeypatch.setattr(api, "_select_kernel", select)
    monkeypatch.setattr(api, "_sparse_reason", lambda q, sink: None)
    monkeypatch.setattr(api, "_launches", {})
    q = torch.randn(1, 256, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    lists = sparse.from_topk(torch.tensor([[[[0], [1]]]]).expand(1, 2, 2, 1), 2, 128, 128)
    cu = torch.tensor([0, 256], dtype=torch.int32)
    calls = [lambda d: flash_attn_func(q, q, q, block_sparse=lists, deterministic=d),
             lambda d: flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 256, 256,
                                              block_sparse=lists, deterministic=d)]
    for call in calls:
        for deterministic in (True, False):
            specs.clear()
            with warnings.catch_warnings():  # (nothing served: the reference runs, warning once)
                warnings.simplefilter("ignore")
                call(deterministic)
            assert specs and all(s.deterministic == deterministic for s in specs)


@pytest.mark.parametrize("kv_block", [128, 64])
def test_dq_turns_count_the_key_blocks_before(kv_block):
    """sparse.dq_turns: for query block m and key block n (of 128 keys: 64-key lists in pairs),
    how many key blocks before n attend m (the deterministic backward's order of the dQ
    additions); a pair attends where either half does."""
    torch.manual_seed(kv_block)
    selected = torch.rand(2, 1, 4, 7) < 0.5
    mask = sparse.from_block_mask(selected, 128, kv_block)
    turns = sparse.dq_turns(mask)
    attends = selected
    if kv_block == 64:
        attends = torch.cat([selected, torch.zeros(2, 1, 4, 1, dtype=torch.bool)], -1)
        attends = attends.view(2, 1, 4, 4, 2).any(-1)
    assert turns.dtype == torch.int32 and turns.shape == attends.shape
    for idx in itertools.product(*map(range, attends.shape)):
        assert turns[idx] == int(attends[idx[:-1]][:idx[-1]].sum())


@pytest.mark.parametrize("padding", ["zeros", "repeats"])
def test_list_padding_never_unsets_a_listed_block(seed, padding):
    """Lists as users write them (FlashAttention-4's, FlexAttention's): the entries past each
    count may hold anything, zeros or repeats of a listed block. The block masks, the dense
    mask, the transposed lists (the backward's) and the expansion to finer blocks must see
    every listed block. A padding entry equal to a listed one could unset it (on the CPU it
    did: block 0 of a zero-padded list dropped out of the transposed lists the backward walks,
    out of the reference's mask, and out of an expansion to finer blocks)."""
    selected = torch.rand(1, 2, 6, 5) < 0.5
    selected[0, 0, 0] = False
    selected[0, 0, 0, 0] = True  # a row whose only block is block 0
    partial = selected & (torch.rand(1, 2, 6, 5) < 0.3)
    canonical = sparse.from_block_mask(selected, 64, 64, partial)

    def pad(count, index):
        listed = torch.arange(index.shape[-1]) < count.unsqueeze(-1)
        filler = torch.zeros_like(index) if padding == "zeros" else index[..., :1].expand_as(index)
        return torch.where(listed, index, filler)

    user = sparse.BlockSparseMask(64, 64, canonical.full_count,
                                  pad(canonical.full_count, canonical.full_index),
                                  canonical.partial_count,
                                  pad(canonical.partial_count, canonical.partial_index))
    for got, want in zip(user.block_masks(), canonical.block_masks()):
        assert torch.equal(got, want)
    assert torch.equal(user.dense(380, 300), canonical.dense(380, 300))
    for got, want in zip(sparse.transpose(user).block_masks(), sparse.transpose(canonical).block_masks()):
        assert torch.equal(got, want)
    assert torch.equal(sparse.expand(user, 32, 32).dense(380, 300), canonical.dense(380, 300))
    assert torch.equal(sparse.dq_turns(user), sparse.dq_turns(canonical))


def test_transpose_lists_the_same_pairs():
    """sparse.transpose: per key block the query blocks that attend it, full and partial kept
    apart; the dense mask it implies is the original's, transposed."""
    torch.manual_seed(0)
    selected = torch.rand(2, 3, 5, 4) < 0.5
    partial = selected & (torch.rand(2, 3, 5, 4) < 0.4)
    mask = sparse.from_block_mask(selected, 64, 128, partial)
    t = sparse.transpose(mask)
    assert (t.q_block, t.kv_block) == (128, 64)
    full, part = mask.block_masks()
    t_full, t_part = t.block_masks()
    assert torch.equal(t_full, full.transpose(-1, -2)) and torch.equal(t_part, part.transpose(-1, -2))
    assert torch.equal(t.dense(500, 300), mask.dense(300, 500).transpose(-1, -2))


@pytest.mark.parametrize("chunk", [1, 1 << 14, 1 << 27], ids=["row", "some-rows", "all-rows"])
def test_from_mask_mod_chunks_agree(seed, chunk, monkeypatch):
    """from_mask_mod evaluates block rows in chunks (sparse.MASK_MOD_CHUNK pairs): one block row
    at a time, a few, or all at once give the same lists, short last blocks included, with the
    mod depending on batch and head."""
    monkeypatch.setattr(sparse, "MASK_MOD_CHUNK", chunk)
    docs = torch.arange(1000) // 230

    def mod(b, h, q_idx, kv_idx):
        return ((docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx + 40 * h)) | (kv_idx < 30 * b)
    got = sparse.from_mask_mod(mod, 2, 3, 1000, 777, 64, 128)
    monkeypatch.setattr(sparse, "MASK_MOD_CHUNK", 1)
    want = sparse.from_mask_mod(mod, 2, 3, 1000, 777, 64, 128)
    for a, b in zip(got.block_masks(), want.block_masks()):
        assert torch.equal(a, b)
    # and the lists mean exactly the mod's pairs on their partial blocks, nothing else
    dense = got.dense(1000, 777, mod, batch=2, heads=3)
    assert torch.equal(dense, sparse.evaluate_mask_mod(mod, 2, 3, 1000, 777, "cpu"))


def test_packed_sequences_take_each_sequences_lists():
    """flash_attn_varlen_func(block_sparse=) on the reference (CPU): sequence b attends what
    the lists' batch entry b lists, blocks counted from its own start: equal to each sequence
    alone with its lists (the rule the GPU kernel is tested against)."""
    import itertools
    import warnings
    from cuteattn import FallbackWarning, flash_attn_varlen_func
    from cuteattn.reference import attention_ref
    torch.manual_seed(0)
    lens_q, lens_k = [70, 0, 33, 100], [90, 5, 33, 0]
    cu = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 32, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 2, 32, dtype=torch.bfloat16) for _ in range(2))
    nq, nk = -(-max(lens_q) // 32), -(-max(lens_k) // 32)
    lists = sparse.from_block_mask(torch.rand(4, 4, nq, nk) < 0.5, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        out, lse = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q),
                                          max(lens_k), causal=True, block_sparse=lists,
                                          return_lse=True)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        rows = slice(sum(lens_q[:b]), sum(lens_q[:b + 1]))
        keys = slice(sum(lens_k[:b]), sum(lens_k[:b + 1]))
        ref, ref_lse = attention_ref(q[rows][None], k[keys][None], v[keys][None], causal=True,
                                     block_sparse=sparse.select_batch(lists, b))
        assert torch.allclose(out[rows].float(), ref[0], atol=1e-2)
        assert torch.equal(torch.isneginf(lse[:, rows]), torch.isneginf(ref_lse[0]))


def _lists(count_shape=(1, 1, 3), index_shape=(1, 1, 3, 3), partial_index_shape=(1, 1, 3, 3)):
    i32 = torch.int32
    return sparse.BlockSparseMask(16, 16, torch.zeros(count_shape, dtype=i32),
                                  torch.zeros(index_shape, dtype=i32), torch.zeros((1, 1, 3), dtype=i32),
                                  torch.zeros(partial_index_shape, dtype=i32))


@pytest.mark.parametrize("mask, match", [
    (_lists(partial_index_shape=(1, 1, 3, 5)), "full_index and partial_index must have the same shape"),
    # (a broadcast partial list beside per-head full ones: the kernels read both at one (b, h))
    (dataclasses.replace(_lists(count_shape=(1, 4, 3), index_shape=(1, 4, 3, 3))),
     "full_index and partial_index must have the same shape"),
    (_lists(count_shape=(1, 1, 4)), "full_count's shape"),
    (dataclasses.replace(_lists(), full_index=[[[[0]]]]), "must be a torch.Tensor"),
])
def test_check_rejects_lists_that_disagree(mask, match):
    q, k = torch.randn(2, 40, 4, 64, dtype=BF16), torch.randn(2, 40, 2, 64, dtype=BF16)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attn_func(q, k, k, block_sparse=mask)


def test_topk_indices_out_of_range_select_nothing():
    # (a -1 filling a short selection, or an index past the blocks: never a clamped block)
    lists = sparse.from_topk(torch.tensor([[[[1, -1], [7, 0]]]], dtype=torch.int32), 3, 16, 16)
    full, _ = lists.block_masks()
    assert full[0, 0].tolist() == [[False, True, False], [True, False, False]]
    with pytest.raises(ValueError, match="num_kv_blocks must be an int >= 1"):
        sparse.from_topk(torch.zeros(1, 1, 1, 1, dtype=torch.int32), 0, 16, 16)


def test_builders_name_their_bad_arguments():
    with pytest.raises(TypeError, match="block_mask must be a torch.Tensor"):
        sparse.from_block_mask([[True]], 16, 16)
    with pytest.raises(TypeError, match="indices must be a torch.Tensor"):
        sparse.from_topk([[[[0]]]], 2, 16, 16)
    top = torch.zeros(1, 1, 2, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="physical blocks 48x64 must divide the logical 256x256"):
        sparse.from_topk(top, 2, 256, 256, physical=(48, 64))
    with pytest.raises(ValueError, match=r"physical must be \(q_block, kv_block\)"):
        sparse.from_topk(top, 2, 256, 256, physical=(64,))
    with pytest.raises(ValueError, match="q_block must be"):
        sparse.from_topk(top, 2, 256, 256, physical=(8, 64))
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="partial must be a bool tensor of block_mask's shape"):
        sparse.from_block_mask(mask, 16, 16, partial=torch.ones(1, 1, 2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="seqlen_q must be an int >= 1"):
        sparse.from_mask_mod(lambda b, h, q, kv: q >= kv, 1, 1, 0, 40, 16, 16)
    with pytest.raises(ValueError, match="mask_mod.* must broadcast"):
        sparse.from_mask_mod(lambda b, h, q, kv: torch.ones(3, 5, dtype=torch.bool), 1, 1, 40,
                             40, 16, 16)
