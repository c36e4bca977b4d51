"""GPU block-sparse forward (flash_attn_func(block_sparse=...)) against the float32 reference with
the dense mask the block lists imply, FlashAttention's rule.

strict=True: a call the kernel does not serve fails. Outputs are NaN-poisoned (out= / lse=), so a
row the kernel leaves unwritten fails. Covers every physical block shape, selected counts 0..5
and all, rows with no block (out 0, lse -inf), full-only / partial-only / mixed lists, odd
lengths, GQA, both dtypes, the call's own masks on top, broadcast lists, and the exact-expansion
identity (a 256x256 logical mask gives the reference's output at every physical shape).
"""
import itertools

import pytest
import torch

from cuteattn import flash_attn_func, sparse
from cuteattn.reference import attention_ref
from cuteattn.testing import assert_close_fa, assert_lse_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BLOCKS = list(sparse.KERNEL_BLOCKS)
MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(300, 100)),
         "softcap": dict(softcap=20.0)}
SEQLENS = [(1000, 1000), (700, 1100), (129, 65), (1, 300), (2048, 2048)]
KEEP = [0, 1, 2, 3, 5, "all"]


def check(q, k, v, mask, **kw):
    b, sq, h, _ = q.shape
    out = torch.full((b, sq, h, v.shape[-1]), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    got, got_lse = flash_attn_func(q, k, v, block_sparse=mask, return_lse=True, strict=True,
                                   out=out, lse=lse, **kw)
    assert got is out and got_lse is lse
    ref, ref_lse = attention_ref(q, k, v, block_sparse=mask, **kw)
    lowprec, _ = attention_ref(q, k, v, block_sparse=mask, upcast=False, **kw)
    assert_close_fa(out, ref, lowprec)
    assert_lse_close(lse, ref_lse)
    return out


def inputs(b, sq, sk, h, hk, d, dtype):
    return (torch.randn(b, sq, h, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hk, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hk, d, device="cuda", dtype=dtype))


def random_lists(b, h, sq, sk, block, keep, partial_share=0.5):
    """Every query block keeps `keep` random key blocks (all of them for "all"), about
    partial_share of them listed as partial."""
    nq, nk = -(-sq // block[0]), -(-sk // block[1])
    n = nk if keep == "all" else min(keep, nk)
    chosen = torch.rand(b, h, nq, nk, device="cuda").argsort(-1)[..., :n]
    selected = torch.zeros(b, h, nq, nk, dtype=torch.bool, device="cuda")
    selected.scatter_(-1, chosen, True)
    partial = selected & (torch.rand(b, h, nq, nk, device="cuda") < partial_share)
    return sparse.from_block_mask(selected, *block, partial)


def cases():
    out = []
    for (i_b, block), (i_m, mask), (i_k, keep) in itertools.product(
            enumerate(BLOCKS), enumerate(MASKS), enumerate(KEEP)):
        sl = SEQLENS[(i_b + i_m + i_k) % len(SEQLENS)]
        d = (64, 128)[(i_b + i_k) % 2]
        dtype = (torch.bfloat16, torch.float16)[(i_m + i_k) % 2]
        heads = [(4, 4), (8, 2), (6, 1)][(i_b + 2 * i_m + i_k) % 3]
        out.append((block, mask, keep, sl, d, dtype, heads))
    return out


CASES = cases()


def case_id(c):
    (bq, bk), mask, keep, (sq, sk), d, dtype, (h, hk) = c
    return f"{bq}x{bk}-{mask}-keep{keep}-{sq}x{sk}-d{d}-{str(dtype)[6:]}-h{h}:{hk}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_block_sparse(seed, case):
    block, mask, keep, (sq, sk), d, dtype, (h, hk) = case
    q, k, v = inputs(2, sq, sk, h, hk, d, dtype)
    check(q, k, v, random_lists(2, h, sq, sk, block, keep), **MASKS[mask])


@pytest.mark.parametrize("d", [80, 96])
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_block_sparse_head_dims_of_narrow_swizzle_atoms(seed, block, d):
    """Head dims whose rows are not whole 128-byte swizzle atoms (d=80: 32-byte atoms, d=96:
    64-byte): 64-key lists come in pairs, each half by TMA copies one atom wide (a 64-column
    copy at d=96 left columns out, and the tile waited for them for ever). Keys not a
    multiple of the block, all blocks kept (the dense answer) and a few, causal."""
    q, k, v = inputs(2, 1000, 333, 4, 2, d, torch.bfloat16)
    check(q, k, v, random_lists(2, 4, 1000, 333, block, "all"))
    q, k, v = inputs(1, 700, 1100, 6, 1, d, torch.float16)
    check(q, k, v, random_lists(1, 6, 700, 1100, block, 3), causal=True)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("share", [0.0, 1.0], ids=["full-only", "partial-only"])
def test_full_only_and_partial_only(seed, block, share):
    q, k, v = inputs(1, 777, 913, 8, 2, 128, torch.bfloat16)
    check(q, k, v, random_lists(1, 8, 777, 913, block, 3, partial_share=share))


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_broadcast_lists(seed, block):
    """Lists with a batch mode of 1 (shared by the batch) and a head mode of 1 (by the heads)."""
    q, k, v = inputs(3, 500, 600, 4, 2, 64, torch.float16)
    check(q, k, v, random_lists(1, 4, 500, 600, block, 2))
    check(q, k, v, random_lists(3, 1, 500, 600, block, "all", partial_share=0.3))


def test_empty_rows(seed):
    """Query blocks with no key block: out 0, lse -inf (the reference says so); the others
    normal."""
    q, k, v = inputs(2, 600, 600, 4, 4, 128, torch.bfloat16)
    lists = random_lists(2, 4, 600, 600, (128, 64), 2)
    counts = lists.full_count.clone()
    counts[:, :, ::2] = 0
    partial = lists.partial_count.clone()
    partial[:, :, ::2] = 0
    check(q, k, v, sparse.BlockSparseMask(128, 64, counts, lists.full_index, partial,
                                          lists.partial_index))


@pytest.mark.parametrize("seqlen", [8192, 8192 + 100])
@pytest.mark.parametrize("keep", [1, 4])
def test_exact_expansion(seed, seqlen, keep):
    """VSA's 256x256 logical top-k mask: passed as it is (the call expands it to 128x128) and
    expanded to every physical shape, each gives the reference's output for the logical mask."""
    q, k, v = inputs(1, seqlen, seqlen, 4, 4, 128, torch.bfloat16)
    n = -(-seqlen // 256)
    top = torch.rand(1, 4, n, n, device="cuda").topk(keep, dim=-1).indices
    logical = sparse.from_topk(top, n, 256, 256)
    outs = [check(q, k, v, logical)]
    for block in BLOCKS:
        outs.append(check(q, k, v, sparse.expand(logical, *block)))
    # the same token pairs in a different block order: equal up to float32 summation order
    for o in outs[1:]:
        assert (o.float() - outs[0].float()).abs().max().item() < 2e-2


def cu(lens):
    """cu_seqlens of these lengths."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")


def packed_inputs(lens_q, lens_k, h, hk, d):
    """Packed bf16 q (total_q, h, d), k and v (total_k, hk, d)."""
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{q}x{k}" for q, k in BLOCKS])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "mask_mod"])
def test_packed_sequences(seed, block, mask):
    """flash_attn_varlen_func(block_sparse=): the lists' batch mode is the sequence, their
    blocks count from its start (FlashAttention-4's varlen semantics); each sequence against the
    reference on its own lists. Lengths with an empty sequence, a sequence without keys, odd
    and unequal q/k lengths; GQA."""
    from cuteattn import flash_attn_varlen_func
    lens_q, lens_k = [700, 0, 129, 1000, 64], [900, 5, 129, 1000, 0]
    h, hk, d = 4, 2, 128
    q, k, v = packed_inputs(lens_q, lens_k, h, hk, d)
    lists = random_lists(len(lens_q), h, max(lens_q), max(lens_k), block, 3)
    # (a mask_mod on the partial blocks: positions within the sequence)
    kw = dict(mask_mod=lambda b, hh, q_idx, kv_idx: kv_idx <= q_idx + 50) if mask == "mask_mod" \
        else MASKS[mask]
    out, lse = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                      block_sparse=lists, return_lse=True, strict=True, **kw)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq == 0:
            continue
        rows, keys = slice(sum(lens_q[:b]), sum(lens_q[:b + 1])), slice(sum(lens_k[:b]), sum(lens_k[:b + 1]))
        one = sparse.select_batch(lists, b)
        args = (q[rows][None], k[keys][None], v[keys][None])
        ref, ref_lse = attention_ref(*args, block_sparse=one, **kw)
        lowprec, _ = attention_ref(*args, block_sparse=one, upcast=False, **kw)
        assert_close_fa(out[rows][None], ref, lowprec, name=f"out of sequence {b}")
        assert_lse_close(lse[:, rows][None], ref_lse, name=f"lse of sequence {b}")


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{q}x{k}" for q, k in BLOCKS])
def test_packed_sequences_seqused_k_nan_past_it(seed, block):
    """flash_attn_varlen_func(block_sparse=, seqused_k=): keys past seqused_k are memory the
    call does not own (here NaN); every sequence lists all its blocks, in ascending order, so
    the block with the sequence's end (and blocks wholly past it) come last, not first, in the
    visit. Each sequence against the reference on its first seqused_k keys."""
    from cuteattn import flash_attn_varlen_func
    lens_q, lens_k, used_k = [300, 129, 200], [500, 333, 200], [330, 100, 200]
    h, hk, d = 4, 2, 128
    q, k, v = packed_inputs(lens_q, lens_k, h, hk, d)
    for b, used in enumerate(used_k):  # past seqused_k: NaN
        k[sum(lens_k[:b]) + used:sum(lens_k[:b + 1])] = float("nan")
        v[sum(lens_k[:b]) + used:sum(lens_k[:b + 1])] = float("nan")
    lists = random_lists(len(lens_q), h, max(lens_q), max(lens_k), block, "all", 0.3)
    out, lse = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                      seqused_k=torch.tensor(used_k, dtype=torch.int32, device="cuda"),
                                      block_sparse=lists, return_lse=True, strict=True)
    for b, (sq, used) in enumerate(zip(lens_q, used_k)):
        rows = slice(sum(lens_q[:b]), sum(lens_q[:b + 1]))
        keys = slice(sum(lens_k[:b]), sum(lens_k[:b]) + used)
        one = sparse.select_batch(lists, b)
        args = (q[rows][None], k[keys][None], v[keys][None])
        ref, ref_lse = attention_ref(*args, block_sparse=one)
        lowprec, _ = attention_ref(*args, block_sparse=one, upcast=False)
        assert_close_fa(out[rows][None], ref, lowprec, name=f"out of sequence {b}")
        assert_lse_close(lse[:, rows][None], ref_lse, name=f"lse of sequence {b}")


def test_lying_lists_stay_inside_the_tensors(seed):
    """Counts above nk and indices outside [0, nk) (validated only on the reference path): the
    kernel clamps them, so the call returns (any values) without touching memory outside k/v;
    a block past the sequence's end adds nothing."""
    q, k, v = inputs(1, 300, 300, 2, 2, 64, torch.bfloat16)
    lists = random_lists(1, 2, 300, 300, (64, 64), 2)
    bad = sparse.BlockSparseMask(64, 64, lists.full_count + 100, lists.full_index * 1000 - 7,
                                 lists.partial_count - 50, lists.partial_index)
    out = flash_attn_func(q, k, v, block_sparse=bad, strict=True)
    torch.cuda.synchronize()
    assert out.shape == q.shape


@pytest.mark.parametrize("paired", [False, True], ids=["128-key", "paired"])
@pytest.mark.parametrize("b,h,nq,nk", [(2, 3, 5, 7), (1, 1, 300, 130), (2, 1, 64, 301)])
def test_transposed_lists_kernel_equals_the_pytorch_form(seed, paired, b, h, nq, nk):
    """The backward's list transposition in one launch (common/list_transpose.py) against
    sparse.transpose / transpose_paired: every count, each list's entries up to its count, the
    halves' table; over rounds of query blocks (nq > 256) and CTAs of key blocks (nk > 128, odd),
    broadcast heads, lists with a repeated entry, blocks listed both full and partial, garbage
    (out-of-range too) past the counts."""
    from cuteattn.api import _kernel_lists
    from cuteattn.kernels.launch_common import transpose_lists
    full_count, full_index = sparse._compact(torch.rand(b, h, nq, nk) < 0.25)
    partial_count, partial_index = sparse._compact(torch.rand(b, h, nq, nk) < 0.25)
    partial_index[..., 1] = partial_index[..., 0]  # (a repeat where the count is 2 or more)
    past = torch.arange(nk) >= full_count.unsqueeze(-1)
    full_index = torch.where(past, torch.randint(-5, nk + 5, full_index.shape, dtype=torch.int32),
                             full_index)
    mask = sparse.BlockSparseMask(128, 64 if paired else 128, full_count, full_index,
                                  partial_count, partial_index)
    if paired:
        want, want_halves = sparse.transpose_paired(mask)
    else:
        want, want_halves = sparse.transpose(mask), None
    on_gpu = sparse.BlockSparseMask(mask.q_block, mask.kv_block,
                                    *(t.cuda() for t in _kernel_lists(mask)))
    got, halves = transpose_lists(_kernel_lists(on_gpu), paired)
    torch.cuda.synchronize()
    rows = (nk + 1) // 2 if paired else nk
    for name, count, index, got_count, got_index in (
            ("full", want.full_count, want.full_index, got[0], got[1]),
            ("partial", want.partial_count, want.partial_index, got[2], got[3])):
        assert got_count.shape == (b, h, rows) and got_index.shape == (b, h, rows, nq)
        assert torch.equal(got_count.cpu(), count), f"{name} counts"
        listed = torch.arange(nq) < count.unsqueeze(-1)
        assert torch.equal(got_index.cpu()[listed], index[listed]), f"{name} lists"
    if paired:
        assert torch.equal(halves.cpu(), want_halves)
    else:
        assert halves is None


@pytest.mark.parametrize("physical", [None, (128, 128), (128, 64), (64, 64)])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_topk_lists_kernel_equals_the_pytorch_form(seed, physical, partial, dtype):
    """VSA's builder in one launch (common/topk_lists.py) against from_topk's PyTorch form on the
    CPU (expand after it): every count, each list up to its count, in order; over rounds of
    key blocks (300 > 128), broadcast batch or heads, repeated indices, -1 and other
    out-of-range ones (an int64 one that would wrap to a valid int32), a row selecting none."""
    for shape, n in (((2, 3, 5, 4), 7), ((1, 2, 3, 40), 300), ((2, 1, 4, 6), 129)):
        idx = torch.randint(-3, n + 3, shape, dtype=dtype)
        idx[..., 0] = idx[..., 1]
        idx[0, 0, 0] = -1
        if dtype == torch.int64:
            idx[..., 2] = 2 ** 33 + 1
        want = sparse.from_topk(idx, n, 256, 256, partial=partial, physical=physical)
        got = sparse.from_topk(idx.cuda(), n, 256, 256, partial=partial, physical=physical)
        torch.cuda.synchronize()
        assert (got.q_block, got.kv_block) == (want.q_block, want.kv_block)
        for kind in ("full", "partial"):
            count, index = getattr(want, f"{kind}_count"), getattr(want, f"{kind}_index")
            got_count, got_index = getattr(got, f"{kind}_count"), getattr(got, f"{kind}_index")
            assert got_count.shape == count.shape and got_index.shape == index.shape, kind
            assert torch.equal(got_count.cpu(), count), f"{kind} counts"
            listed = torch.arange(index.shape[-1]) < count.unsqueeze(-1)
            assert torch.equal(got_index.cpu()[listed], index[listed]), f"{kind} lists"
        assert int((want.full_count + want.partial_count).sum()) > 0  # (something listed)


# ---- the backward (lists of 128x128 blocks, or coarser ones expanded to them) ----

def check_grads(q, k, v, mask, deterministic=False, **kw):
    """dq, dk, dv through autograd against the reference's autograd on the dense mask."""
    from test_gpu_bwd import check_grads as check, poison_allocator, reference_grads
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = flash_attn_func(*leaves, block_sparse=mask, strict=True, deterministic=deterministic,
                          **kw)
    dout = torch.randn_like(out)
    poison_allocator()
    got = torch.autograd.grad(out, leaves, dout)
    ref, low = reference_grads(attention_ref, (q, k, v), dout, block_sparse=mask, **kw)
    check(got, ref, low)


BWD_CASES = [(mask, keep, sl, d, dtype, heads) for (i, (mask, keep)) in enumerate(
    itertools.product(MASKS, [0, 2, 5, "all"]))
    for sl, d, dtype, heads in [(SEQLENS[i % len(SEQLENS)], (64, 96, 128)[i % 3],
                                 (torch.bfloat16, torch.float16)[i % 2], [(4, 4), (8, 2)][i % 2])]]


@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: f"{c[0]}-keep{c[1]}-{c[2][0]}x{c[2][1]}-d{c[3]}")
def test_block_sparse_backward(seed, case):
    mask, keep, (sq, sk), d, dtype, (h, hk) = case
    q, k, v = inputs(2, sq, sk, h, hk, d, dtype)
    check_grads(q, k, v, random_lists(2, h, sq, sk, (128, 128), keep), **MASKS[mask])


def test_block_sparse_backward_of_a_logical_mask(seed):
    """VSA's 256x256 top-k mask (expanded to 128x128 for both passes), sequence not a multiple
    of the block, lists broadcast over the batch."""
    q, k, v = inputs(2, 1000, 1000, 4, 2, 128, torch.bfloat16)
    top = torch.rand(1, 4, 4, 4, device="cuda").topk(2, dim=-1).indices
    check_grads(q, k, v, sparse.from_topk(top, 4, 256, 256))


# lists of 64-key blocks: a 128-key block walks the union of its halves' query blocks, each
# half leaving out what it does not attend (sparse.transpose_paired)
PAIRED_CASES = [((64, 64), "none", 1, (256, 256), 64), ((64, 64), "causal", 3, (700, 700), 128),
                ((128, 64), "window", 2, (333, 1000), 128), ((128, 64), "none", "all", (1000, 333), 96),
                ((64, 64), "softcap", 0, (129, 257), 64), ((128, 64), "causal", 5, (1023, 1023), 64)]


@pytest.mark.parametrize("case", PAIRED_CASES, ids=lambda c: f"{c[0][0]}x{c[0][1]}-{c[1]}-keep{c[2]}-{c[3][0]}x{c[3][1]}-d{c[4]}")
def test_block_sparse_backward_of_64_key_blocks(seed, case):
    block, mask, keep, (sq, sk), d = case
    q, k, v = inputs(2, sq, sk, 4, 2, d, torch.bfloat16)
    check_grads(q, k, v, random_lists(2, 4, sq, sk, block, keep), **MASKS[mask])


def test_backward_no_kernel_serves_falls_back(seed):
    """A block-sparse backward no kernel serves yet (a mask_mod on 64-key lists; the forward
    serves it): strict mode names the reason before the forward runs."""
    q, k, v = (x.requires_grad_() for x in inputs(1, 256, 256, 2, 2, 64, torch.bfloat16))
    lists = random_lists(1, 2, 256, 256, (64, 64), 1)

    def near(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 100
    with pytest.raises(RuntimeError, match=r"with 64-key block-sparse lists: no sm90 backward"):
        flash_attn_func(q, k, v, block_sparse=lists, mask_mod=near, strict=True)
    flash_attn_func(q.detach(), k.detach(), v.detach(), block_sparse=lists, mask_mod=near,
                    strict=True)  # (served)


PACKED_BWD = [((128, 128), "causal"), ((128, 64), "none"), ((64, 64), "window"), ((128, 128), "none")]


@pytest.mark.parametrize("block,mask", PACKED_BWD,
                         ids=lambda c: f"{c[0]}x{c[1]}" if isinstance(c, tuple) else str(c))
def test_packed_sequences_backward(seed, block, mask):
    """Gradients of flash_attn_varlen_func(block_sparse=) on the backward kernel: the lists'
    batch mode is the sequence (transposed per sequence), an empty sequence, one without keys,
    odd and unequal lengths, GQA; dq, dk, dv against the varlen reference's autograd on the
    same lists. (deterministic=True there takes the reference: launch_bwd.unserved_sparse.)"""
    from cuteattn import flash_attn_varlen_func
    from cuteattn.reference import attention_varlen_ref
    from test_gpu_bwd import check_grads as check, reference_grads
    lens_q, lens_k = [700, 0, 129, 1000, 64], [900, 5, 129, 1000, 0]
    h, hk, d = 4, 2, 128
    q, k, v = (t.requires_grad_() for t in packed_inputs(lens_q, lens_k, h, hk, d))
    lists = random_lists(len(lens_q), h, max(lens_q), max(lens_k), block, 3)
    kw = MASKS[mask]
    run = lambda: flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                         block_sparse=lists, strict=True, **kw)
    out = run()
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref_fn = lambda q_, k_, v_, **a: attention_varlen_ref(q_, k_, v_, cu(lens_q), cu(lens_k),
                                                          block_sparse=lists, **a)
    check(got, *reference_grads(ref_fn, (q, k, v), dout, **kw))
