"""The reference against attention written the slow, obvious way: one query row at a time, float64."""
import math

import pytest
import torch

from cuteattn.reference import attention_ref, attention_varlen_ref


def naive_attention(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, bounds=None):
    """Row-by-row float64 attention with the mask written directly from its definition.
    `bounds` (left, right), each an int or None (unbounded), overrides window's FA2 ints."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    if bounds is not None:
        left, right = bounds
    else:  # FlashAttention-2's ints: negative means no bound
        left, right = (None if x < 0 else x for x in window)
    if causal:
        right = 0
    out = torch.zeros(b, sq, h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, h, sq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // hk)
            for i in range(sq):
                keys = [
                    j for j in range(sk)
                    if (right is None or j <= i + sk - sq + right)
                    and (left is None or j >= i + sk - sq - left)
                ]
                if not keys:
                    continue
                s = torch.stack([(q[bi, i, hi] * k[bi, j, kv]).sum() * scale for j in keys])
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                m = s.max()
                e = torch.exp(s - m)
                lse[bi, hi, i] = m + torch.log(e.sum())
                out[bi, i, hi] = (e[:, None] * v[bi, keys, kv]).sum(0) / e.sum()
    return out, lse


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float32)


def check(q, k, v, **kw):
    out, lse = attention_ref(q, k, v, **kw)
    naive_kw = dict(
        scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
        window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
    )
    out_n, lse_n = naive_attention(q, k, v, **naive_kw)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), out_n, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_n))
    torch.testing.assert_close(lse.double(), lse_n, atol=1e-5, rtol=1e-5)
    return out, lse


@pytest.mark.parametrize("sq, sk", [(5, 5), (3, 7), (7, 3), (1, 6), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_causal_and_plain(seed, sq, sk, causal):
    check(rand(2, sq, 2, 8), rand(2, sk, 2, 8), rand(2, sk, 2, 8), causal=causal)


@pytest.mark.parametrize("window", [(2, 1), (0, 0), (3, -1), (-1, 2), (1, 0)])
@pytest.mark.parametrize("sq, sk", [(6, 6), (4, 9), (9, 4)])
def test_window(seed, window, sq, sk):
    check(rand(1, sq, 2, 8), rand(1, sk, 2, 8), rand(1, sk, 2, 8), window_size=window)


# FlashAttention-4's window edges past the diagonal, with the bounds they mean written by hand
NEGATIVE_EDGES = [((None, -1), (None, -1)), ((None, -3), (None, -3)), ((-2, None), (-2, None)),
                  ((-1, None), (-1, None)), ((4, -2), (4, -2)), ((-2, 5), (-2, 5)),
                  ((None, 2), (None, 2)), ((-1, -1), (None, None))]


@pytest.mark.parametrize("window,bounds", NEGATIVE_EDGES, ids=[str(w) for w, _ in NEGATIVE_EDGES])
@pytest.mark.parametrize("sq, sk", [(6, 6), (4, 9), (9, 4)])
def test_negative_window_edges(seed, window, bounds, sq, sk):
    """Rows whose window holds no key (the first rows under (None, -1)) get 0 and -inf."""
    q, k, v = rand(1, sq, 2, 8), rand(1, sk, 2, 8), rand(1, sk, 2, 8)
    out, lse = attention_ref(q, k, v, window_size=window)
    out_n, lse_n = naive_attention(q, k, v, bounds=bounds)
    torch.testing.assert_close(out.double(), out_n, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_n))
    if window == (None, -1) and sq == sk:
        assert torch.isneginf(lse[:, :, 0]).all() and torch.all(out[:, 0] == 0)


def test_causal_with_window_keeps_left(seed):
    q, k, v = rand(1, 6, 2, 8), rand(1, 8, 2, 8), rand(1, 8, 2, 8)
    out, lse = check(q, k, v, causal=True, window_size=(2, 5))
    out_w, lse_w = attention_ref(q, k, v, window_size=(2, 0))
    assert torch.equal(out, out_w) and torch.equal(lse, lse_w)


@pytest.mark.parametrize("softcap", [0.5, 30.0])
def test_softcap(seed, softcap):
    q, k, v = rand(1, 5, 2, 8) * 3, rand(1, 6, 2, 8) * 3, rand(1, 6, 2, 8)
    check(q, k, v, softcap=softcap, softmax_scale=0.7, causal=True)


@pytest.mark.parametrize("h, hk", [(4, 2), (6, 1), (3, 3)])
def test_gqa(seed, h, hk):
    check(rand(2, 4, h, 8), rand(2, 5, hk, 8), rand(2, 5, hk, 8))


def test_gqa_head_mapping(seed):
    """Query heads 0..h/hk-1 use kv head 0: equal to MHA with the kv heads repeated."""
    q, k, v = rand(1, 4, 6, 8), rand(1, 5, 2, 8), rand(1, 5, 2, 8)
    out, _ = attention_ref(q, k, v)
    out_mha, _ = attention_ref(q, k.repeat_interleave(3, 2), v.repeat_interleave(3, 2))
    assert torch.equal(out, out_mha)


def test_rows_without_keys_are_zero_and_minus_inf(seed):
    # causal with sq > sk: the first sq - sk rows see no key
    q, k, v = rand(1, 7, 2, 8), rand(1, 3, 2, 8), rand(1, 3, 2, 8)
    out, lse = check(q, k, v, causal=True)
    assert torch.all(out[:, :4] == 0) and torch.all(torch.isneginf(lse[:, :, :4]))
    assert torch.isfinite(lse[:, :, 4:]).all()
    # a window that excludes every key for some rows
    out, lse = check(q, k, v, window_size=(0, 0))
    assert torch.all(out[:, :4] == 0)


def test_no_keys_at_all(seed):
    q, k, v = rand(1, 3, 2, 8), rand(1, 0, 2, 8), rand(1, 0, 2, 8)
    out, lse = attention_ref(q, k, v)
    assert out.shape == (1, 3, 2, 8) and torch.all(out == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_modes(seed, dtype):
    q, k, v = (rand(1, 9, 2, 64).to(dtype) for _ in range(3))
    out, lse = attention_ref(q, k, v, causal=True)
    out_lp, lse_lp = attention_ref(q, k, v, causal=True, upcast=False)
    assert out.dtype == torch.float32 and out_lp.dtype == dtype and lse_lp.dtype == torch.float32
    err = (out_lp.float() - out).abs().max().item()
    assert 0 < err < 0.05  # really computed in low precision, and still close


def test_upcast_matches_naive_on_low_precision_inputs(seed):
    q, k, v = (rand(2, 6, 2, 16).bfloat16() for _ in range(3))
    check(q, k, v, window_size=(2, 1))


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1))])
def test_varlen_matches_per_sequence(seed, causal, window):
    lens_q, lens_k = [3, 0, 5, 1, 4], [4, 2, 5, 0, 6]
    h, hk, d = 4, 2, 8
    q, k, v = rand(sum(lens_q), h, d), rand(sum(lens_k), hk, d), rand(sum(lens_k), hk, d)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, window_size=window)
    assert out.shape == (sum(lens_q), h, d) and lse.shape == (h, sum(lens_q))
    for b in range(len(lens_q)):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        qs, ks = slice(q0, q0 + lens_q[b]), slice(k0, k0 + lens_k[b])
        o_b, l_b = attention_ref(q[None, qs], k[None, ks], v[None, ks], causal=causal, window_size=window)
        assert torch.equal(out[qs], o_b[0])
        assert torch.equal(lse[:, qs], l_b[0])
    # sequence 3 has a query but no key
    assert torch.all(out[int(cu_q[3])] == 0) and torch.all(torch.isneginf(lse[:, int(cu_q[3])]))


def test_varlen_seqused(seed):
    lens_q, lens_k = [4, 5], [6, 3]
    used_q, used_k = [2, 5], [6, 1]
    q, k, v = rand(9, 2, 8), rand(9, 2, 8), rand(9, 2, 8)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 9], dtype=torch.int32)
    out, lse = attention_varlen_ref(
        q, k, v, cu_q, cu_k, torch.tensor(used_q, dtype=torch.int32),
        torch.tensor(used_k, dtype=torch.int32), causal=True,
    )
    # rows beyond seqused_q: 0 and -inf
    assert torch.all(out[2:4] == 0) and torch.all(torch.isneginf(lse[:, 2:4]))
    # the masks align to the used lengths: sequence 1 has 5 queries and 1 key
    o1, l1 = naive_attention(q[None, 4:9], k[None, 6:7], v[None, 6:7], causal=True)
    torch.testing.assert_close(out[4:9].double(), o1[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse[:, 4:9]), torch.isneginf(l1[0]))


# ---- the written-out backward against autograd of the forward ----

from cuteattn.reference import attention_ref_backward, attention_varlen_ref_backward  # noqa: E402

BWD_CASES = [  # (sq, sk, h, hk, causal, window, softcap)
    (9, 13, 4, 2, False, (-1, -1), 0.0),
    (9, 13, 4, 2, True, (-1, -1), 0.0),
    (13, 9, 4, 1, True, (-1, -1), 0.0),      # rows that see no key (sq > sk, causal)
    (17, 17, 2, 2, False, (3, 2), 0.0),
    (17, 17, 4, 2, False, (0, -1), 5.0),
    (8, 20, 6, 3, True, (4, -1), 2.0),
]


@pytest.mark.parametrize("sq,sk,h,hk,causal,window,softcap", BWD_CASES)
def test_reference_backward_equals_autograd(sq, sk, h, hk, causal, window, softcap):
    torch.manual_seed(sq * 31 + sk)
    q = torch.randn(2, sq, h, 16).requires_grad_()
    k = torch.randn(2, sk, hk, 16).requires_grad_()
    v = torch.randn(2, sk, hk, 24).requires_grad_()
    kw = dict(softmax_scale=0.3, causal=causal, window_size=window, softcap=softcap)
    out, _ = attention_ref(q, k, v, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    dq, dk, dv = attention_ref_backward(dout, q.detach(), k.detach(), v.detach(), **kw)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_varlen_reference_backward_equals_autograd():
    torch.manual_seed(0)
    cu_q = torch.tensor([0, 3, 3, 10, 15], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 7, 16], dtype=torch.int32)
    q = torch.randn(16, 4, 16).requires_grad_()   # one trailing row outside every sequence
    k = torch.randn(16, 2, 16).requires_grad_()
    v = torch.randn(16, 2, 16).requires_grad_()
    kw = dict(causal=True, softcap=3.0)
    out, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, **kw)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = attention_varlen_ref_backward(dout, q.detach(), k.detach(), v.detach(), cu_q, cu_k, **kw)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert (grads[0][15] == 0).all()


# ---- learnable sinks ----

@pytest.mark.parametrize("causal", [False, True])
def test_sink_is_one_more_softmax_column_without_value(seed, causal):
    """Against a softmax over the scores plus one column of the sink's logit, whose value row is
    zero, written directly (float64)."""
    b, sq, sk, h, hk, d = 2, 5, 7, 4, 2, 8
    q, k, v = rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    sink = torch.randn(h)
    out, lse = attention_ref(q, k, v, causal=causal, learnable_sink=sink)
    kr, vr = (t.repeat_interleave(h // hk, dim=2).double() for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kr) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), -math.inf)
    full = torch.cat([s, sink.double().view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
    p = torch.softmax(full, dim=-1)[..., :sk]
    torch.testing.assert_close(out.double(), torch.einsum("bhqk,bkhd->bqhd", p, vr), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(full, dim=-1), atol=1e-5, rtol=1e-5)


def test_sink_keeps_rows_without_keys_finite(seed):
    q, k, v = rand(1, 3, 2, 8), rand(1, 0, 2, 8), rand(1, 0, 2, 8)
    sink = torch.tensor([0.5, -1.0])
    out, lse = attention_ref(q, k, v, learnable_sink=sink)
    assert torch.all(out == 0) and torch.equal(lse, sink.view(1, 2, 1).expand(1, 2, 3))


@pytest.mark.parametrize("window,softcap", [((-1, -1), 0.0), ((3, 0), 2.0)])
def test_sink_backward_equals_autograd(seed, window, softcap):
    q, k, v = rand(2, 6, 4, 8), rand(2, 9, 2, 8), rand(2, 9, 2, 8)
    sink = torch.randn(4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out, _ = attention_ref(*leaves[:3], window_size=window, softcap=softcap, learnable_sink=leaves[3])
    g = torch.randn_like(out)
    out.backward(g)
    got = attention_ref_backward(g, q, k, v, window_size=window, softcap=softcap, learnable_sink=sink)
    for mine, leaf in zip(got, leaves):
        torch.testing.assert_close(mine, leaf.grad, atol=1e-5, rtol=1e-5)


# ---- long sequences: scores a block of query rows at a time ----

@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(3, 1), softcap=2.0),
                                dict(learnable_sink="sink"), dict(mask_mod="doc"),
                                dict(score_mod="alibi"), dict(block_sparse="blocks")])
def test_chunked_rows_equal_one_block(seed, monkeypatch, kw):
    """With the score budget forcing 4-row blocks, forward and backward equal the one-block
    computation (the masks, modifiers and block lists see each block's true row indices)."""
    from cuteattn import reference, sparse
    b, sq, sk, h, hk = 2, 13, 37, 4, 2
    q, k, v = rand(b, sq, h, 8), rand(b, sk, hk, 8), rand(b, sk, hk, 8)
    doc = torch.arange(37) // 10
    extras = {"sink": torch.randn(h), "doc": lambda bb, hh, i, j: doc[i] >= doc[j],
              "alibi": lambda s, bb, hh, i, j: s - 0.1 * (i - j).abs(),
              "blocks": sparse.from_block_mask(torch.rand(1, 1, 1, 3) < 0.7, 16, 16,
                                               partial=torch.ones(1, 1, 1, 3, dtype=torch.bool))}
    kw = {n: extras.get(x, x) if isinstance(x, str) else x for n, x in kw.items()}
    if "block_sparse" in kw:
        kw["mask_mod"] = lambda bb, hh, i, j: (i + j) % 3 != 0
    g = torch.randn(b, sq, h, 8)
    whole = attention_ref(q, k, v, **kw)
    grads = None
    if "mask_mod" not in kw and "score_mod" not in kw and "block_sparse" not in kw:
        grads = attention_ref_backward(g, q, k, v, **kw)
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", b * h * sk * 4)
    assert len(reference._query_chunks(q, k)) == 4
    for a, c in zip(whole, attention_ref(q, k, v, **kw)):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6)
    if grads is not None:
        for a, c in zip(grads, attention_ref_backward(g, q, k, v, **kw)):
            torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


# ---- merging split-KV partials ----

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sink", [False, True])
def test_merge_partials_equals_one_pass(seed, causal, sink):
    """Keys split into ranges (one of them empty for some rows under the causal mask), each
    attended alone (bottom-right alignment kept by masking in the full frame), merged: equal to
    one pass over all keys; the sink counted once, in the merge."""
    from cuteattn.reference import merge_partials, visible_mask
    b, sq, sk, h = 2, 5, 23, 3
    q, k, v = rand(b, sq, h, 8), rand(b, sk, h, 8), rand(b, sk, h, 8)
    s = torch.randn(h) if sink else None
    want, want_lse = attention_ref(q, k, v, causal=causal, learnable_sink=s)
    outs, lses = [], []
    for lo, hi in ((0, 7), (7, 18), (18, 23)):
        # the split's own mask: the full-frame mask's columns [lo, hi)
        mask = visible_mask(sq, sk, None, 0 if causal else None)[:, lo:hi]
        kk = k[:, lo:hi]
        sc = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(8)
        sc = sc.masked_fill(~mask, -math.inf)
        lse = torch.logsumexp(sc, -1)
        p = torch.where(torch.isfinite(lse).unsqueeze(-1), torch.exp(sc - lse.unsqueeze(-1)), 0.0)
        outs.append(torch.einsum("bhqk,bkhd->bqhd", p, v[:, lo:hi]))
        lses.append(lse)
    out, lse = merge_partials(torch.stack(outs), torch.stack(lses), s)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_merge_partials_of_rows_no_split_saw():
    from cuteattn.reference import merge_partials
    outs = torch.zeros(2, 1, 3, 2, 4)
    lses = torch.full((2, 1, 2, 3), -math.inf)
    out, lse = merge_partials(outs, lses)
    assert torch.all(out == 0) and torch.isneginf(lse).all()
    out, lse = merge_partials(outs, lses, torch.tensor([0.5, -1.0]))
    assert torch.all(out == 0) and torch.equal(lse[0, :, 0], torch.tensor([0.5, -1.0]))
