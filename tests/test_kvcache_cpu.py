"""flash_attn_with_kvcache on the CPU (the reference path): FlashAttention's semantics checked
against an independent construction (the sequence's keys assembled by hand, rotary by complex
multiplication), the in-place append (exactly the new positions change), paged caches with
shuffled and shared pages, and every argument rule."""

import warnings

import pytest
import torch

from cuteattn import flash_attn_with_kvcache
from cuteattn.reference import attention_ref

BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("quiet_fallback")


def rotary_tables(n, rd, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rd, 2).float() / rd)
    ang = torch.arange(n).float()[:, None] * inv[None]
    return ang.cos(), ang.sin()


def rotate_complex(x, cos, sin, interleaved):
    """Rotary as a complex multiplication (independent of reference.apply_rotary_ref)."""
    rd = 2 * cos.shape[-1]
    xf = x.float()
    head = xf[..., :rd]
    if interleaved:
        z = torch.view_as_complex(head.reshape(*head.shape[:-1], rd // 2, 2).contiguous())
    else:
        z = torch.complex(head[..., : rd // 2], head[..., rd // 2:])
    z = z * torch.complex(cos, sin)[:, None, :]
    if interleaved:
        out = torch.view_as_real(z).flatten(-2)
    else:
        out = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out, xf[..., rd:]), dim=-1).to(x.dtype)


def by_hand(q, cache_k, cache_v, lens, k_new, v_new, starts=None, rot=None, causal=False,
            window=(-1, -1), interleaved=True):
    """Per sequence: rotate, concatenate the cache's keys with the new ones, attend."""
    outs = []
    for b in range(q.shape[0]):
        n, s0 = lens[b], 0 if starts is None else starts[b]
        qb, kb, vb = q[b], cache_k[b][s0:n], cache_v[b][s0:n]
        if k_new is not None:
            kn = k_new[b]
            if rot is not None:
                kn = rotate_complex(kn, rot[0][n:n + kn.shape[0]], rot[1][n:n + kn.shape[0]], interleaved)
            kb, vb = torch.cat([kb, kn]), torch.cat([vb, v_new[b]])
        if rot is not None:
            local = window[0] >= 0 or window[1] >= 0
            pos = torch.arange(n, n + qb.shape[0]) if causal or local else torch.full((qb.shape[0],), n)
            qb = rotate_complex(qb, rot[0][pos], rot[1][pos], interleaved)
        o, _ = attention_ref(qb[None], kb[None], vb[None], causal=causal, window_size=window)
        outs.append(o[0])
    return torch.stack(outs)


def close(a, b):
    assert (a.float() - b.float()).abs().max() <= 1e-2, (a.float() - b.float()).abs().max()


@pytest.mark.parametrize("causal", [False, True])
def test_contiguous_cache_without_new_tokens(seed, causal):
    q = torch.randn(3, 4, 8, 64, dtype=BF16)
    kc, vc = torch.randn(3, 40, 2, 64, dtype=BF16), torch.randn(3, 40, 2, 64, dtype=BF16)
    lens = torch.tensor([0, 1, 37], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=causal,
                                       return_softmax_lse=True)
    close(out, by_hand(q, kc, vc, lens.tolist(), None, None, causal=causal))
    assert torch.all(out[0] == 0) and torch.isneginf(lse[0]).all()  # an empty cache: no key
    assert lse.shape == (3, 8, 4) and lse.dtype == torch.float32


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_append_with_rotary_writes_exactly_the_new_positions(seed, interleaved, causal):
    b, s_new, cap = 2, 3, 24
    q = torch.randn(b, s_new, 4, 64, dtype=BF16)
    kc, vc = torch.randn(b, cap, 4, 64, dtype=BF16), torch.randn(b, cap, 4, 64, dtype=BF16)
    k, v = torch.randn(b, s_new, 4, 64, dtype=BF16), torch.randn(b, s_new, 4, 64, dtype=BF16)
    cos, sin = rotary_tables(cap, 32)
    lens = [5, 21]
    before_k, before_v = kc.clone(), vc.clone()
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, torch.tensor(lens, dtype=torch.int32),
                                  causal=causal, rotary_interleaved=interleaved)
    want = by_hand(q, before_k, before_v, lens, k, v, rot=(cos, sin), causal=causal,
                   interleaved=interleaved)
    close(out, want)
    for i, n in enumerate(lens):
        new = slice(n, n + s_new)
        assert torch.equal(vc[i, new], v[i])
        close(kc[i, new], rotate_complex(k[i], cos[new], sin[new], interleaved))
        keep = torch.ones(cap, dtype=torch.bool)
        keep[new] = False
        assert torch.equal(kc[i, keep], before_k[i, keep]) and torch.equal(vc[i, keep], before_v[i, keep])


def test_paged_cache_shuffled_and_shared_pages_equal_contiguous(seed):
    """Two sequences share their first page (a common prefix); pages in shuffled order."""
    page, b, s_new = 16, 2, 2
    lens = [20, 33]
    contiguous_k = torch.randn(b, 64, 2, 64, dtype=BF16)
    contiguous_v = torch.randn(b, 64, 2, 64, dtype=BF16)
    contiguous_k[1, :page], contiguous_v[1, :page] = contiguous_k[0, :page], contiguous_v[0, :page]
    table = torch.tensor([[5, 2, 7, 0], [5, 6, 1, 3]], dtype=torch.int32)  # page 5 shared
    kp, vp = torch.zeros(8, page, 2, 64, dtype=BF16), torch.zeros(8, page, 2, 64, dtype=BF16)
    for i in range(b):
        for j, p in enumerate(table[i].tolist()):
            kp[p], vp[p] = contiguous_k[i, j * page:(j + 1) * page], contiguous_v[i, j * page:(j + 1) * page]
    q = torch.randn(b, s_new, 4, 64, dtype=BF16)
    k, v = torch.randn(b, s_new, 2, 64, dtype=BF16), torch.randn(b, s_new, 2, 64, dtype=BF16)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    paged = flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=seqlens, block_table=table,
                                    causal=True, validate=True)
    flat = flash_attn_with_kvcache(q, contiguous_k, contiguous_v, k, v, cache_seqlens=seqlens,
                                   causal=True)
    assert torch.equal(paged, flat)
    assert torch.equal(kp[2, 4:6], k[0]) and torch.equal(kp[1, 1:3], k[1])  # appended by page


def test_cache_batch_idx_and_leftpad(seed):
    q = torch.randn(2, 1, 4, 64, dtype=BF16)
    kc, vc = torch.randn(5, 30, 4, 64, dtype=BF16), torch.randn(5, 30, 4, 64, dtype=BF16)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    pad = torch.tensor([4, 0], dtype=torch.int32)
    lens = torch.tensor([17, 9], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=idx,
                                  cache_leftpad=pad, causal=True, validate=True)
    close(out, by_hand(q, kc[idx.long()], vc[idx.long()], lens.tolist(), None, None,
                       starts=pad.tolist(), causal=True))


def test_speculative_rows_are_bottom_right_causal(seed):
    """Four query rows over a cache of 10 plus 4 new keys: row i sees keys [0, 10 + i]."""
    q = torch.randn(1, 4, 2, 64, dtype=BF16)
    kc, vc = torch.randn(1, 16, 2, 64, dtype=BF16), torch.randn(1, 16, 2, 64, dtype=BF16)
    k, v = torch.randn(1, 4, 2, 64, dtype=BF16), torch.randn(1, 4, 2, 64, dtype=BF16)
    before_k, before_v = kc.clone(), vc.clone()
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=10, causal=True,
                                  window_size=(6, -1))
    close(out, by_hand(q, before_k, before_v, [10], k, v, causal=True, window=(6, 0)))


def test_whole_cache_when_cache_seqlens_is_none(seed):
    q = torch.randn(2, 1, 2, 64, dtype=BF16)
    kc, vc = torch.randn(2, 12, 2, 64, dtype=BF16), torch.randn(2, 12, 2, 64, dtype=BF16)
    close(flash_attn_with_kvcache(q, kc, vc), by_hand(q, kc, vc, [12, 12], None, None))


def test_strict_and_the_fallback_warning():
    q = torch.randn(1, 1, 2, 64, dtype=BF16)
    kc = torch.randn(1, 8, 2, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="strict"):
        flash_attn_with_kvcache(q, kc, kc, strict=True)


def args(**over):
    a = dict(q=torch.randn(2, 1, 4, 64, dtype=BF16), k_cache=torch.randn(2, 32, 2, 64, dtype=BF16),
             v_cache=torch.randn(2, 32, 2, 64, dtype=BF16))
    a.update(over)
    return a


PAGED = dict(k_cache=torch.randn(4, 16, 2, 64, dtype=BF16), v_cache=torch.randn(4, 16, 2, 64, dtype=BF16))


@pytest.mark.parametrize("over,exc,match", [
    (dict(k_cache=torch.randn(4, 24, 2, 64, dtype=BF16), v_cache=torch.randn(4, 24, 2, 64, dtype=BF16),
          block_table=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "multiple of 16"),
    (dict(**PAGED, block_table=torch.zeros(2, 2, dtype=torch.int64)), TypeError, "block_table must be int32"),
    (dict(**PAGED, block_table=torch.zeros(3, 2, dtype=torch.int32)), ValueError, r"block_table must have shape \(batch=2"),
    (dict(**PAGED, block_table=torch.zeros(2, 2, dtype=torch.int32),
          cache_leftpad=torch.zeros(2, dtype=torch.int32)), ValueError, "cache_leftpad cannot"),
    (dict(cache_seqlens=40), ValueError, r"cache_seqlens \(40\) must lie in"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), TypeError, "cache_seqlens must be int32"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=1.5), TypeError, "cache_seqlens must be None, an int"),
    (dict(k_cache=torch.randn(2, 32, 3, 64, dtype=BF16), v_cache=torch.randn(2, 32, 3, 64, dtype=BF16)),
     ValueError, "multiple of nheads_k"),
    (dict(k_cache=torch.randn(2, 32, 2, 64, dtype=torch.float16),
          v_cache=torch.randn(2, 32, 2, 64, dtype=torch.float16)), (TypeError, ValueError), "dtype"),
    (dict(k=torch.randn(2, 1, 2, 64, dtype=BF16)), ValueError, "k and v"),
    (dict(k=torch.randn(2, 1, 2, 64, dtype=BF16), v=torch.randn(2, 1, 2, 64, dtype=BF16)),
     ValueError, "need cache_seqlens"),
    (dict(k=torch.randn(2, 1, 3, 64, dtype=BF16), v=torch.randn(2, 1, 3, 64, dtype=BF16)), ValueError, "nheads_k=2"),
    (dict(rotary_cos=torch.ones(32, 16)), ValueError, "rotary_cos and rotary_sin"),
    (dict(rotary_cos=torch.ones(32, 12), rotary_sin=torch.ones(32, 12)), ValueError, "multiple of 16"),
    (dict(rotary_cos=torch.ones(8, 16), rotary_sin=torch.ones(8, 16)), ValueError, "cover every cache position"),
    (dict(k_cache=torch.randn(1, 32, 2, 64, dtype=BF16), v_cache=torch.randn(1, 32, 2, 64, dtype=BF16)),
     ValueError, "cache_batch_idx"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(alibi_slopes=torch.ones(4)), NotImplementedError, "ALiBi"),
    (dict(window_size=(-3, 0)), ValueError, "window_size"),
])
def test_bad_arguments_raise_before_any_work(over, exc, match):
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**args(**over))


@pytest.mark.parametrize("over,match", [
    (dict(cache_seqlens=torch.tensor([3, 33], dtype=torch.int32)), r"cache_seqlens\[1\] = 33"),
    (dict(cache_seqlens=torch.tensor([3, 5], dtype=torch.int32),
          cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)), r"cache_leftpad\[0\] = 4"),
    (dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), "outside the cache's 2 rows"),
    (dict(cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32)), "must not repeat"),
    (dict(**PAGED, block_table=torch.tensor([[0, 9], [1, 2]], dtype=torch.int32),
          cache_seqlens=torch.tensor([20, 3], dtype=torch.int32)), r"block_table\[0\] holds page 9"),
])
def test_validate_checks_the_index_values(over, match):
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(**args(**over), validate=True)


def test_learnable_sink(seed):
    q = torch.randn(2, 1, 4, 64, dtype=BF16)
    kc, vc = torch.randn(2, 20, 2, 64, dtype=BF16), torch.randn(2, 20, 2, 64, dtype=BF16)
    sink = torch.randn(4)
    lens = torch.tensor([7, 0], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, learnable_sink=sink,
                                       return_softmax_lse=True)
    ref, ref_lse = attention_ref(q[:1], kc[:1, :7], vc[:1, :7], learnable_sink=sink)
    close(out[:1], ref)
    assert torch.allclose(lse[:1], ref_lse, atol=1e-5)
    assert torch.all(out[1] == 0) and torch.allclose(lse[1], sink.view(4, 1))  # no key: the sink
    with pytest.raises(ValueError, match="learnable_sink"):
        flash_attn_with_kvcache(q, kc, vc, learnable_sink=torch.zeros(3))


def test_decode_step_under_torch_compile(seed):
    """A decode step compiled with fullgraph=True (the cache lengths are read inside an opaque
    op that declares it writes the caches): equal to eager, caches appended alike."""
    torch._dynamo.reset()
    q = torch.randn(2, 1, 4, 64, dtype=BF16)
    k, v = torch.randn(2, 1, 2, 64, dtype=BF16), torch.randn(2, 1, 2, 64, dtype=BF16)
    caches = [(torch.randn(2, 16, 2, 64, dtype=BF16), torch.randn(2, 16, 2, 64, dtype=BF16))
              for _ in range(2)]
    caches[1] = tuple(c.clone() for c in caches[0])
    lens = torch.tensor([3, 9], dtype=torch.int32)

    def step(q, kc, vc, k, v, lens):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, *caches[0], k, v, lens)
    want = step(q, *caches[1], k, v, lens)
    assert torch.equal(got, want)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[0][1][1, 9], v[1, 0])
    torch._dynamo.reset()


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_dequantized_and_appended_with_descales(seed, cache_dtype):
    b, cap, hk = 2, 24, 2
    q = torch.randn(b, 2, 4, 64, dtype=BF16)
    kd, vd = torch.rand(b, hk) + 0.5, torch.rand(b, hk) + 0.5
    real_k, real_v = torch.randn(b, cap, hk, 64), torch.randn(b, cap, hk, 64)
    kc = (real_k / kd[:, None, :, None]).to(cache_dtype)
    vc = (real_v / vd[:, None, :, None]).to(cache_dtype)
    k, v = torch.randn(b, 2, hk, 64, dtype=BF16), torch.randn(b, 2, hk, 64, dtype=BF16)
    lens = torch.tensor([5, 20], dtype=torch.int32)
    before_k, before_v = kc.clone(), vc.clone()
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True,
                                  k_descale=kd, v_descale=vd)
    for i, n in enumerate(lens.tolist()):
        assert torch.equal(kc[i, n:n + 2], (k[i].float() / kd[i][None, :, None]).to(cache_dtype))
        assert torch.equal(vc[i, :n], before_v[i, :n])
    deq = lambda c, d: c.float() * d[:, None, :, None]
    want = by_hand(q, deq(before_k, kd), deq(before_v, vd), lens.tolist(),
                   deq(kc, kd)[torch.arange(b)[:, None], lens[:, None].long() + torch.arange(2)],
                   deq(vc, vd)[torch.arange(b)[:, None], lens[:, None].long() + torch.arange(2)],
                   causal=True)
    close(out, want)


@pytest.mark.parametrize("over,exc,match", [
    (dict(k_descale=torch.ones(2, 2)), ValueError, "applies to an fp8 cache only"),
    (dict(q=torch.randn(2, 1, 4, 64).to(torch.float8_e4m3fn)), TypeError, "q dtype must be float16 or bfloat16"),
])
def test_fp8_cache_rules(over, exc, match):
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**args(**over))


def test_fp8_cache_rules_with_an_fp8_cache():
    kc = torch.zeros(2, 32, 2, 64).to(torch.float8_e4m3fn)
    base = dict(q=torch.randn(2, 1, 4, 64, dtype=BF16), k_cache=kc, v_cache=kc.clone())
    with pytest.raises(ValueError, match=r"k_descale must be float32 of shape \(batch, nheads_k\)"):
        flash_attn_with_kvcache(**base, k_descale=torch.ones(2, 3))
    with pytest.raises(ValueError, match="quantizes them"):
        flash_attn_with_kvcache(**base, k=torch.zeros(2, 1, 2, 64).to(torch.float8_e4m3fn),
                                v=torch.zeros(2, 1, 2, 64).to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="v dtype"):
        flash_attn_with_kvcache(**{**base, "v_cache": torch.zeros(2, 32, 2, 64, dtype=BF16)})


def test_paged_prefill_through_varlen_equals_contiguous(seed):
    """flash_attn_varlen_func(block_table=...): keys read from shuffled pages give what the same
    keys packed contiguously give."""
    from cuteattn import flash_attn_varlen_func
    page, lens_k, lens_q = 16, [20, 5, 33], [7, 0, 12]
    table = torch.tensor([[4, 1, 0], [2, 0, 0], [6, 3, 5]], dtype=torch.int32)
    kp, vp = torch.randn(7, page, 2, 64, dtype=BF16), torch.randn(7, page, 2, 64, dtype=BF16)
    gather = lambda c: torch.cat([c[table[b].long()].reshape(-1, 2, 64)[:n] for b, n in enumerate(lens_k)])
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 64, dtype=BF16)
    got, lse = flash_attn_varlen_func(q, kp, vp, cu(lens_q), cu(lens_k), 12, 33, causal=True,
                                      block_table=table, return_lse=True)
    want, want_lse = flash_attn_varlen_func(q, gather(kp), gather(vp), cu(lens_q), cu(lens_k), 12,
                                            33, causal=True, return_lse=True)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    with pytest.raises(ValueError, match="must fit its pages"):
        flash_attn_varlen_func(q, kp, vp, cu(lens_q), cu([20, 5, 60]), 12, 60, block_table=table)
    with pytest.raises(ValueError, match="block_table must be an int32"):
        flash_attn_varlen_func(q, kp, vp, cu(lens_q), cu(lens_k), 12, 33, block_table=table.long())
    with pytest.raises(ValueError, match="multiple of 16"):
        flash_attn_varlen_func(q, kp[:, :8], vp[:, :8], cu(lens_q), cu(lens_k), 12, 33, block_table=table)


@pytest.mark.parametrize("splits", [2, 3, 7, 50])
@pytest.mark.parametrize("sink", [False, True])
def test_num_splits_give_the_same_result(seed, splits, sink):
    """num_splits: each sequence's keys in ranges of whole 128-key blocks, merged by their lse,
    the sink counted once in the merge: equal to one pass (some splits hold no visible key)."""
    q = torch.randn(2, 3, 4, 64, dtype=BF16)
    kc, vc = torch.randn(2, 700, 2, 64, dtype=BF16), torch.randn(2, 700, 2, 64, dtype=BF16)
    lens = torch.tensor([650, 129], dtype=torch.int32)
    kw = dict(cache_seqlens=lens, causal=True, window_size=(300, -1), return_softmax_lse=True,
              learnable_sink=torch.randn(4) if sink else None)
    one, one_lse = flash_attn_with_kvcache(q, kc, vc, num_splits=1, **kw)
    got, got_lse = flash_attn_with_kvcache(q, kc, vc, num_splits=splits, **kw)
    close(got, one)
    assert torch.allclose(got_lse, one_lse, atol=1e-4)


def test_split_count_heuristic():
    from cuteattn.kvcache import split_count
    slots = 2 * 132  # an H200: 132 SMs, two decode CTAs each
    assert split_count(8, slots, 1024) == 32      # batch 1, 8 kv heads, 131072 keys: 256 CTAs
    assert split_count(8, slots, 1000) == 33      # 264 CTAs of 31 blocks (32 splits: 32 blocks)
    assert split_count(64, slots, 256) == 4       # batch 8: 256 CTAs
    assert split_count(128, slots, 256) == 2      # batch 16: 256 CTAs
    assert split_count(512, slots, 64) == 1       # batch 64 fills the GPU alone
    assert split_count(8, slots, 3) == 3          # never more splits than key blocks
    assert split_count(0, slots, 10) == 1


def test_the_reference_path_checks_values_even_without_validate():
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 33"):
        flash_attn_with_kvcache(**args(cache_seqlens=torch.tensor([3, 33], dtype=torch.int32)))


# ---- the decode kernel's host side: the device-side append and rotation ----

@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("paged", [False, True])
def test_append_and_rotate_matches_the_reference_path(seed, interleaved, causal, paged):
    """kvcache.append_and_rotate (what runs before a decode kernel, with no sync) leaves the
    caches exactly as the reference path does, and rotates q as the hand-written rotation."""
    from cuteattn.kvcache import append_and_rotate
    from cuteattn.reference import attention_kvcache_ref
    b, sq, s_new, h, hk, d, cap = 3, 2, 3, 4, 2, 32, 48
    q = torch.randn(b, sq, h, d, dtype=BF16)
    k_new, v_new = torch.randn(b, s_new, hk, d, dtype=BF16), torch.randn(b, s_new, hk, d, dtype=BF16)
    lens = torch.tensor([5, 0, 40], dtype=torch.int32)
    cos, sin = rotary_tables(cap + 4, 16)
    block_table = batch_idx = None
    if paged:  # pages of 16, shuffled
        k_cache = torch.randn(12, 16, hk, d, dtype=BF16)
        block_table = torch.randperm(12).reshape(b, 4).to(torch.int32)[:, :3]
        cap = 48
    else:
        k_cache = torch.randn(5, cap, hk, d, dtype=BF16)
        batch_idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    v_cache = torch.randn_like(k_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    attention_kvcache_ref(q, ref_k, ref_v, k_new, v_new, cos, sin, lens, batch_idx, None,
                          block_table, causal=causal, rotary_interleaved=interleaved)
    q_rot, used = append_and_rotate(q, k_cache, v_cache, k_new, v_new, cos, sin, lens, batch_idx,
                                    block_table, causal, interleaved, cap)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert used.dtype == torch.int32 and used.tolist() == [8, 3, 43]
    for i in range(b):
        n = int(lens[i])
        pos = torch.arange(n, n + sq) if causal else torch.full((sq,), n)
        want = rotate_complex(q[i], cos[pos], sin[pos], interleaved)
        assert torch.allclose(q_rot[i].float(), want.float(), atol=1e-2, rtol=1e-2)


def test_append_and_rotate_without_new_tokens_or_rotary():
    from cuteattn.kvcache import append_and_rotate
    q = torch.randn(2, 1, 4, 32, dtype=BF16)
    k_cache = torch.randn(2, 64, 2, 32, dtype=BF16)
    before = k_cache.clone()
    q_rot, used = append_and_rotate(q, k_cache, k_cache, None, None, None, None, 17, None, None,
                                    False, True, 64)
    assert q_rot is q and torch.equal(k_cache, before) and used.tolist() == [17, 17]
    _, used = append_and_rotate(q, k_cache, k_cache, None, None, None, None, None, None, None,
                                False, True, 64)
    assert used.tolist() == [64, 64]
    # int32 lengths pass through untouched (no copy, so no kernel launch on a GPU); other
    # dtypes and strided ones are converted
    lens = torch.tensor([3, 60], dtype=torch.int32)
    assert append_and_rotate(q, k_cache, k_cache, None, None, None, None, lens, None, None,
                             False, True, 64)[1] is lens
    for other in (lens.long(), torch.tensor([3, 0, 60, 0], dtype=torch.int32)[::2]):
        _, used = append_and_rotate(q, k_cache, k_cache, None, None, None, None, other, None,
                                    None, False, True, 64)
        assert used is not other and used.dtype == torch.int32 and used.tolist() == [3, 60]


# ---- the decode-step shortcut (kvcache.DecodeStep): a served call's decisions kept under its
# signature. A stand-in launch takes the kernel's place (the CPU has none): it records the spec
# and what it was handed, and writes sentinels.

class FakeDecode:
    def __init__(self):
        self.selections, self.calls = 0, []

    def select(self, spec, device):  # kvcache._decode_launch's contract: (launch, None)
        self.selections += 1
        return (lambda *a, **kw: self.launch(spec, *a, **kw)), None

    def launch(self, spec, q, k_cache, v_cache, out, lse, seqused_k, kv_batch_idx, leftpad_k,
               page_table, num_splits, learnable_sink=None, **extra):
        self.calls.append(dict(spec=spec, q=q, seqused_k=seqused_k.clone(), page_table=page_table,
                               splits=num_splits, sink=learnable_sink))
        out.fill_(1.0)
        lse.fill_(2.0)


@pytest.fixture
def fake_decode(monkeypatch):
    from cuteattn import kvcache
    fake = FakeDecode()
    monkeypatch.setattr(kvcache, "_decode_launch", fake.select)
    monkeypatch.setattr(kvcache, "_steps", {})
    return fake


def test_repeated_decode_step_skips_checks_and_selection(fake_decode, monkeypatch):
    from cuteattn import kvcache
    checks = []
    full = kvcache._check_cache
    monkeypatch.setattr(kvcache, "_check_cache", lambda *a, **kw: checks.append(1) or full(*a, **kw))
    a = args()
    kc, vc = a["k_cache"].clone(), a["v_cache"].clone()
    lens = torch.tensor([3, 7], dtype=torch.int32)
    for step in range(3):
        k_new, v_new = torch.randn(2, 1, 2, 64, dtype=BF16), torch.randn(2, 1, 2, 64, dtype=BF16)
        out, lse = flash_attn_with_kvcache(a["q"], kc, vc, k_new, v_new, cache_seqlens=lens,
                                           causal=True, return_softmax_lse=True)
        # the update still runs every step: the new row lands at each sequence's length
        for b in range(2):
            assert torch.equal(kc[b, int(lens[b])], k_new[b, 0])
            assert torch.equal(vc[b, int(lens[b])], v_new[b, 0])
        assert fake_decode.calls[-1]["seqused_k"].tolist() == (lens + 1).tolist()
        assert torch.all(out == 1) and torch.all(lse == 2) and out.shape == a["q"].shape
        lens = lens + 1  # (a new tensor of the same signature, as a decoder's loop makes)
    assert len(checks) == 1 and fake_decode.selections == 1 and len(fake_decode.calls) == 3
    assert fake_decode.calls[2]["spec"] is fake_decode.calls[0]["spec"]


@pytest.mark.parametrize("change", ["shape", "dtype", "causal", "window", "int-lengths", "splits",
                                    "scale", "softcap", "paged", "sink"])
def test_decode_shortcut_misses_on_any_change(fake_decode, change):
    a = args()
    kw = dict(cache_seqlens=torch.tensor([3, 7], dtype=torch.int32), causal=False,
              window_size=(-1, -1), num_splits=0)
    flash_attn_with_kvcache(**a, **kw)
    if change == "shape":
        a["q"] = torch.randn(2, 2, 4, 64, dtype=BF16)
    elif change == "dtype":
        a = {n: t.to(torch.float16) for n, t in a.items()}
    elif change == "causal":
        kw["causal"] = True
    elif change == "window":
        kw["window_size"] = (4, 0)
    elif change == "int-lengths":
        kw["cache_seqlens"] = 5
    elif change == "splits":
        kw["num_splits"] = 3
    elif change == "scale":
        kw["softmax_scale"] = 0.5
    elif change == "softcap":
        kw["softcap"] = 10.0
    elif change == "paged":
        a.update(PAGED)
        kw["block_table"] = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    else:
        kw["learnable_sink"] = torch.zeros(4)
    flash_attn_with_kvcache(**a, **kw)
    assert fake_decode.selections == 2  # the second call took the full path
    first, second = fake_decode.calls
    if change == "int-lengths":  # (the spec is alike: the lengths reach the kernel as a tensor)
        assert second["seqused_k"].tolist() == [5, 5]
    elif change == "splits":  # (not in the spec either: the launch takes the count)
        assert first["splits"] != second["splits"] == 3
    else:
        assert first["spec"] != second["spec"]


def test_decode_shortcut_still_checks_what_it_must(fake_decode):
    a = args()
    lens = torch.tensor([3, 7], dtype=torch.int32)
    flash_attn_with_kvcache(**a, cache_seqlens=lens, window_size=(1, 0))
    # True == 1 and hashes alike, but a bool window side is an error
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_with_kvcache(**a, cache_seqlens=lens, window_size=(True, 0))
    # validate=True reads the values every call: past the capacity raises even after a hit
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(**a, cache_seqlens=torch.tensor([3, 40], dtype=torch.int32),
                                window_size=(1, 0), validate=True)
    # a list is unhashable: no shortcut, the full path every time (and still served)
    for _ in range(2):
        flash_attn_with_kvcache(**a, cache_seqlens=lens, window_size=[1, 0])
    assert fake_decode.selections == 4  # (the first call, validate's and the two lists)


def _decode_args(b=2, sq=4, cap=32, hk=2, h=4, d=64):
    return (torch.randn(b, sq, h, d, dtype=BF16), torch.randn(b, cap, hk, d, dtype=BF16),
            torch.randn(b, cap, hk, d, dtype=BF16))


@pytest.mark.parametrize("kw, position", [
    (dict(), 32),                                       # a full cache: q at its capacity
    (dict(cache_seqlens=30, causal=True), 33),          # q row i at 30 + i
    (dict(cache_seqlens=torch.tensor([30, 2], dtype=torch.int32), causal=True), 33),
])
def test_rotary_tables_must_cover_q_positions(kw, position):
    q, kc, vc = _decode_args()
    cos = sin = torch.randn(32, 16)
    with pytest.raises(ValueError, match=f"rotated at position {position}"):
        flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=sin, **kw)


def test_rotary_table_exactly_long_enough_passes():
    q, kc, vc = _decode_args()
    cos = sin = torch.randn(32, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=sin, cache_seqlens=28,
                                      causal=True)
    assert out.shape == (2, 4, 4, 64) and not out.isnan().any()


def test_page_size_zero_rejected():
    z = torch.zeros(6, 0, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match="positive multiple of 16"):
        flash_attn_with_kvcache(torch.randn(2, 1, 4, 64, dtype=BF16), z, z, cache_seqlens=0,
                                block_table=torch.zeros(2, 3, dtype=torch.int32))


def test_batch_zero_returns_empty_results():
    q, kc, vc = _decode_args(b=0)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=0, return_softmax_lse=True)
    assert out.shape == (0, 4, 4, 64) and lse.shape == (0, 4, 4)


def test_numpy_int_cache_seqlens_is_an_int():
    import numpy as np
    q, kc, vc = _decode_args(sq=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=np.int64(5))
        want = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5)
    assert torch.equal(got, want)


def test_paged_varlen_checks_cu_seqlens_q_first():
    from cuteattn import flash_attn_varlen_func
    kp = torch.randn(6, 16, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D"):
        flash_attn_varlen_func(torch.randn(30, 4, 64, dtype=BF16), kp, kp,
                               torch.tensor(0, dtype=torch.int32),
                               torch.tensor([0, 15, 40], dtype=torch.int32), 6, 40,
                               block_table=torch.zeros(2, 3, dtype=torch.int32))


def test_paged_varlen_without_sequences_writes_nothing_to_attend():
    from cuteattn import flash_attn_varlen_func
    kp = torch.randn(6, 16, 2, 64, dtype=BF16)
    out, lse = flash_attn_varlen_func(torch.randn(5, 4, 64, dtype=BF16), kp, kp,
                                      torch.tensor([0], dtype=torch.int32),
                                      torch.tensor([0], dtype=torch.int32), 0, 0, return_lse=True,
                                      block_table=torch.zeros(0, 3, dtype=torch.int32))
    assert torch.all(out == 0) and out.shape == (5, 4, 64)
    assert lse.shape == (4, 5) and torch.all(lse == float("-inf"))


def test_paged_varlen_fallback_holds_cu_seqlens_k_to_start_at_0():
    # (as validate=True does on the kernel path: one rule whichever path serves the call)
    from cuteattn import flash_attn_varlen_func
    kp = torch.randn(6, 16, 2, 64, dtype=BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="cu_seqlens_k must start at 0; got 3"):
            flash_attn_varlen_func(torch.randn(8, 4, 64, dtype=BF16), kp, kp,
                                   torch.tensor([0, 4, 8], dtype=torch.int32),
                                   torch.tensor([3, 20, 40], dtype=torch.int32), 4, 20,
                                   block_table=torch.arange(6, dtype=torch.int32).view(2, 3))
