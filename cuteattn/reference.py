"""The PyTorch reference of every attention feature cuteattn implements.

Used by the tests (the float32 ground truth, and the plain low-precision computation the
FlashAttention correctness rule measures against) and by the API as the fallback where no GPU kernel
serves a problem. It favours obviousness over speed: it materialises the full score matrix.

Semantics (FlashAttention's):
- scores s = softmax_scale * q.k; with softcap c > 0, s = c * tanh(s / c).
- masks are bottom-right aligned: with lengths sq, sk, query i sees key j iff
  j <= i + sk - sq + right and j >= i + sk - sq - left, for the bounded sides (window_bounds:
  -1 or None unbounded; negative edges as FlashAttention-4 defines them). causal means right = 0
  (left from window_size, usually unbounded).
- GQA/MQA: query head h uses key/value head h // (nheads // nheads_k).
- lse is the natural-log logsumexp of the (masked) scores, float32.
- a query row that sees no key gets output 0 and lse -inf (never NaN).
"""
from __future__ import annotations

import math

import torch


def window_bounds(window_size) -> tuple:
    """FlashAttention's window_size -> (left, right), each an int bound or None (unbounded).

    FlashAttention-2's ints: -1 is an unbounded side, values >= 0 bound it. FlashAttention-4's
    additions: None is an unbounded side, and negative values are edges past the diagonal:
    (None, -w) keeps only keys at least w before the query's diagonal, (-w, None) only keys at
    least w after it. Where neither side is None, -1 keeps its FlashAttention-2 meaning and only
    values below -1 are negative edges; where one side is None, the other's -1 is an edge.
    (No type checks here: _checks.normalize_mask makes them for the API.)"""
    left, right = window_size
    if left is None or right is None:
        return left, right
    return (None if left == -1 else left), (None if right == -1 else right)


def visible_mask(seqlen_q: int, seqlen_k: int, left, right, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: True where query i may attend key j (bottom-right aligned):
    diag - left <= j <= diag + right, diag = i + seqlen_k - seqlen_q; a None side is unbounded."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = i + (seqlen_k - seqlen_q)  # the key aligned with query i
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right is not None:
        mask &= j <= diag + right
    if left is not None:
        mask &= j >= diag - left
    return mask


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    score_mod=None,
    mask_mod=None,
    block_sparse=None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of batched q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv).
    FlexAttention's modifiers: score_mod(score, b, h, q_idx, kv_idx) -> score on the scaled
    (softcapped) scores, mask_mod(b, h, q_idx, kv_idx) -> bool on every pair, or with
    block_sparse (sparse.BlockSparseMask) only on its partial blocks (full ones attend every
    pair, unlisted ones none); indices are positions in the sequence, broadcast tensors.
    learnable_sink (h,): one logit per query head joining every row's softmax denominator (as
    in gpt-oss) without a value: rows keep probability mass exp(sink - lse) for it.

    Returns (out, lse): out (b, sq, h, dv) is float32 when `upcast` (the ground truth) and in q's
    dtype otherwise (every step in the input dtype, as plain PyTorch would do it); lse (b, h, sq) is
    always returned as float32. The caller casts out to the dtype it needs.
    """
    h, d, hk = q.shape[2], q.shape[3], k.shape[2]
    if h % hk != 0:
        raise ValueError(f"nheads ({h}) must be a multiple of nheads_k ({hk})")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    dtype = torch.float32 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=2)
        v = v.repeat_interleave(h // hk, dim=2)

    mods = (score_mod, mask_mod, block_sparse)
    outs, lses = [], []
    for rows in _query_chunks(q, k):
        _, probs, _, lse = _scores_and_probs(q[:, rows], k, scale, causal, window_size, softcap,
                                             learnable_sink, mods, (rows.start, q.shape[1]))
        outs.append(torch.einsum("bhqk,bkhd->bqhd", probs, v))
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2).float()


# Scores are materialised a block of query rows at a time, at most this many elements each
# (512 MiB in float32), so the fallback serves long sequences without holding the whole
# (batch, heads, seqlen_q, seqlen_k) matrix; rows are independent, so the results are the same.
CHUNK_ELEMENTS = 1 << 27


def _query_chunks(q: torch.Tensor, k: torch.Tensor) -> list:
    """Slices of query rows whose score blocks stay within CHUNK_ELEMENTS (one, possibly empty,
    slice when everything fits)."""
    b, sq, h = q.shape[:3]
    step = max(1, CHUNK_ELEMENTS // max(1, b * h * k.shape[1]))
    return [slice(start, min(start + step, sq)) for start in range(0, sq, step)] or [slice(0, 0)]


def _scores_and_probs(q, k, scale, causal, window_size, softcap, sink=None, mods=(None,) * 3,
                      rows=None, cols=None):
    """The forward's masked scores (b, h, sq, sk) and probabilities, in q's dtype, for k with
    q's head count; the softcap's tanh values (None without softcap), which the backward's
    derivative needs; and the rows' logsumexp (b, h, sq), the sink included. A row that sees no
    key gets probabilities 0 (softmax would give NaN) and lse -inf, or the sink's logit.
    rows (first row, total rows): q is that block of a longer sequence's query rows; cols (first
    key, total keys): k is that range of a longer key sequence (a split; no modifiers then)."""
    sq, sk = q.shape[1], k.shape[1]
    first, total = (0, sq) if rows is None else rows
    first_key, total_keys = (0, sk) if cols is None else cols
    if cols is not None and any(m is not None for m in mods):
        raise NotImplementedError("the reference splits keys only without modifiers")
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(scores / softcap)
        scores = softcap * t
    score_mod, mask_mod, block_sparse = mods
    if score_mod is not None:
        scores = _apply_score_mod(score_mod, scores, first)
    left, right = window_bounds(window_size)
    if causal:
        right = 0
    mask = visible_mask(total, total_keys, left, right, device=q.device)[
        first:first + sq, first_key:first_key + sk]
    if block_sparse is not None or mask_mod is not None:
        from cuteattn import sparse
        b, h = scores.shape[:2]
        if block_sparse is not None:
            mod_mask = block_sparse.dense(total, sk, mask_mod, batch=b, heads=h,
                                          rows=(first, sq))
        else:
            mod_mask = sparse.evaluate_mask_mod(mask_mod, b, h, sq, sk, q.device, q_offset=first)
        mask = mask & mod_mask  # (b, h, sq, sk)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink is None:
        lse = torch.logsumexp(scores, dim=-1)  # -inf where a row sees no key (also when sk == 0)
        probs = torch.softmax(scores, dim=-1)
        row_sees_a_key = mask.any(dim=-1, keepdim=True)
        row_sees_a_key = row_sees_a_key.view(*row_sees_a_key.shape[:-2], sq, 1)
        probs = torch.where(row_sees_a_key, probs, torch.zeros((), dtype=q.dtype, device=q.device))
    else:  # the sink: one more column of the softmax, per head, that carries no value
        column = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        lse = torch.logsumexp(torch.cat([scores, column], dim=-1), dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
    return scores, probs, t, lse


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    score_mod=None,
    mask_mod=None,
    block_sparse=None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed attention: q (total_q, h, d), k (total_k, hk, d), v (total_k, hk, dv).
    The modifiers as attention_ref takes them, with b the sequence's index and q_idx / kv_idx
    positions within the sequence (FlashAttention-4's varlen semantics).

    Sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1]; with seqused, only its first seqused[b] rows
    take part (and define the lengths the masks align to). Returns (out (total_q, h, dv), lse
    (h, total_q) float32), dtypes as in `attention_ref`. Rows that belong to no sequence or lie beyond
    seqused_q get output 0 and lse -inf (FlashAttention leaves them undefined; we write these).
    Reads the lengths to the host (a sync): a reference, not a hot path.
    """
    total_q, h, _ = q.shape
    dv = v.shape[-1]
    dtype = torch.float32 if upcast else q.dtype
    out = torch.zeros(total_q, h, dv, dtype=dtype, device=q.device)
    lse = torch.full((h, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    for b, q0, len_q, k0, len_k in _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        o, l = attention_ref(
            q[q0 : q0 + len_q].unsqueeze(0),
            k[k0 : k0 + len_k].unsqueeze(0),
            v[k0 : k0 + len_k].unsqueeze(0),
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            learnable_sink=learnable_sink,
            upcast=upcast,
            **_mods_of_sequence(b, score_mod, mask_mod, block_sparse),
        )
        out[q0 : q0 + len_q] = o[0]
        lse[:, q0 : q0 + len_q] = l[0]
    return out, lse


def attention_ref_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    block_sparse=None,
) -> tuple:
    """(dq, dk, dv) of `attention_ref`'s output against dout, in float32, written out (no autograd:
    it also runs where autograd is off, inside a custom op). block_sparse
    (sparse.BlockSparseMask): the pairs its blocks list, as attention_ref attends them. The steps a backward kernel takes:
    P from the recomputed scores, dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), through
    the softcap's derivative (1 - tanh^2) and the scale, then dQ = dS K and dK = dS^T Q; GQA sums
    dK and dV over the query heads of each kv head. Rows that see no key have P = 0: gradient 0.
    With learnable_sink, also dsink (h,): the sink is a softmax column with dP = 0, so its
    gradient is -sum over batch and rows of P_sink * rowsum(dO * O): (dq, dk, dv, dsink)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    q, k, v, do = q.float(), k.float(), v.float(), dout.float()
    group = h // hk
    kr = k.repeat_interleave(group, dim=2) if group > 1 else k
    vr = v.repeat_interleave(group, dim=2) if group > 1 else v

    dq = torch.zeros_like(q)
    dkr, dvr = torch.zeros_like(kr), torch.zeros_like(vr)
    dsink = torch.zeros(h, dtype=torch.float32, device=q.device)
    for rows in _query_chunks(q, k):  # query rows are independent; dK and dV sum over them
        qc, doc = q[:, rows], do[:, rows]
        _, probs, t, lse = _scores_and_probs(qc, kr, scale, causal, window_size, softcap,
                                             learnable_sink, (None, None, block_sparse),
                                             rows=(rows.start, sq))
        out = torch.einsum("bhqk,bkhd->bqhd", probs, vr)
        dvr += torch.einsum("bhqk,bqhd->bkhd", probs, doc)
        dp = torch.einsum("bqhd,bkhd->bhqk", doc, vr)
        delta = (doc * out).sum(-1).permute(0, 2, 1).unsqueeze(-1)  # (b, h, rows, 1)
        ds = probs * (dp - delta)
        if t is not None:
            ds = ds * (1 - t * t)
        ds = ds * scale
        dq[:, rows] = torch.einsum("bhqk,bkhd->bqhd", ds, kr)
        dkr += torch.einsum("bhqk,bqhd->bkhd", ds, qc)
        if learnable_sink is not None:
            p_sink = torch.exp(learnable_sink.float().view(1, -1, 1) - lse)  # (b, h, rows)
            dsink -= (p_sink * delta.squeeze(-1)).sum(dim=(0, 2))
    if group > 1:
        dkr = dkr.reshape(b, sk, hk, group, d).sum(3)
        dvr = dvr.reshape(b, sk, hk, group, v.shape[-1]).sum(3)
    if learnable_sink is None:
        return dq, dkr, dvr
    return dq, dkr, dvr, dsink


def attention_varlen_ref_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    **kwargs,
) -> tuple:
    """`attention_ref_backward` per packed sequence (as `attention_varlen_ref` lays them out);
    rows outside every sequence get gradient 0; with a learnable_sink its gradient summed over
    the sequences comes fourth. float32. Reads the lengths to the host."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    sink = kwargs.get("learnable_sink")
    dsink = None if sink is None else torch.zeros(sink.shape, dtype=torch.float32, device=q.device)
    for _, q0, len_q, k0, len_k in _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        grads = attention_ref_backward(
            dout[q0:q0 + len_q].unsqueeze(0), q[q0:q0 + len_q].unsqueeze(0),
            k[k0:k0 + len_k].unsqueeze(0), v[k0:k0 + len_k].unsqueeze(0), **kwargs)
        dq[q0:q0 + len_q] += grads[0][0]
        dk[k0:k0 + len_k] += grads[1][0]
        dv[k0:k0 + len_k] += grads[2][0]
        if dsink is not None:
            dsink += grads[3]
    return (dq, dk, dv) if dsink is None else (dq, dk, dv, dsink)


def _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
    """(sequence, q start, q rows, k start, k rows) of each packed sequence with query rows, as
    the varlen references lay them out (seqused, when given, sets the rows). Reads the lengths
    to the host."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used_q = seqused_q.tolist() if seqused_q is not None else None
    used_k = seqused_k.tolist() if seqused_k is not None else None
    for b in range(len(starts_q) - 1):
        q0, k0 = starts_q[b], starts_k[b]
        len_q = used_q[b] if used_q is not None else starts_q[b + 1] - q0
        len_k = used_k[b] if used_k is not None else starts_k[b + 1] - k0
        if len_q > 0:
            yield b, q0, len_q, k0, len_k


# ---- KV cache (flash_attn_with_kvcache) ----

def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x (..., seqlen, heads, d) by cos/sin (seqlen, rotary_dim / 2), or per
    batch entry (batch, seqlen, rotary_dim / 2), on the first rotary_dim features, in float32,
    returned in x's dtype. interleaved (GPT-J): features (0, 1), (2, 3), ... rotate as pairs;
    otherwise (GPT-NeoX) feature i pairs with i + rotary_dim/2."""
    rd = 2 * cos.shape[-1]
    xf = x.float()
    c, s = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)  # broadcast over heads
    head, tail = xf[..., :rd], xf[..., rd:]
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = head[..., : rd // 2], head[..., rd // 2:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated, tail), dim=-1).to(x.dtype)


def _cache_rows(k_cache, block_table, row: int, positions: torch.Tensor):
    """Where positions (absolute, in one sequence) live in the cache: (pages/rows, offsets)."""
    if block_table is None:
        return torch.full_like(positions, row), positions
    page = k_cache.shape[1]
    return block_table[row][positions // page].long(), positions % page


def attention_kvcache_ref(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                          cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                          block_table=None, *, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                          learnable_sink=None, descales=(None, None), num_splits=1,
                          upcast=True):
    """flash_attn_with_kvcache's semantics, written out per batch entry (reads lengths to the
    host). Appends k, v (rotated when rotary_cos/sin are given) into the caches in place at
    positions [cache_seqlens[b], cache_seqlens[b] + seqlen_new) of cache row cache_batch_idx[b]
    (or b; with block_table, of sequence b's pages), then attends q (rotated at positions
    cache_seqlens[b] + i when causal or local, at cache_seqlens[b] otherwise) over keys
    [cache_leftpad[b], cache_seqlens[b] + seqlen_new), bottom-right aligned. cache_seqlens None
    means the whole cache (its length; pages per sequence x page size) holds keys.
    An fp8 cache holds values / descale (descales: (k, v) (batch, nheads_k) float32, None =
    1.0): appended tokens are quantized so, gathered keys and values dequantized. num_splits > 1
    computes each sequence's keys in that many ranges of whole 128-key blocks, merged
    (merge_partials: the split-KV path, the sink counted once in the merge).
    Returns (out (b, sq, h, d), lse (b, h, sq)), dtypes as attention_ref's."""
    b, sq = q.shape[:2]
    s_new = 0 if k is None else k.shape[1]
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    seqlens = _per_batch(cache_seqlens, b, capacity)
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else list(range(b))
    starts = cache_leftpad.tolist() if cache_leftpad is not None else [0] * b
    local = any(side is not None for side in window_bounds(window_size))
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    hk = k_cache.shape[2]
    scale_of = lambda which, i: (torch.ones(1, hk, 1, device=q.device) if descales[which] is None
                                 else descales[which][i].float().view(1, hk, 1))
    outs, lses = [], []
    for i in range(b):
        old, row = seqlens[i], rows[i]
        qi = q[i:i + 1]
        if rotary_cos is not None:
            pos = torch.arange(old, old + sq) if (causal or local) else torch.full((sq,), old)
            qi = apply_rotary_ref(qi, rotary_cos[pos], rotary_sin[pos], rotary_interleaved)
        if s_new:
            ki = k[i:i + 1]
            if rotary_cos is not None:
                new = torch.arange(old, old + s_new)
                ki = apply_rotary_ref(ki, rotary_cos[new], rotary_sin[new], rotary_interleaved)
            where = _cache_rows(k_cache, block_table, row, torch.arange(old, old + s_new, device=q.device))
            k_cache[where] = _store(ki[0], k_cache.dtype, scale_of(0, i))
            v_cache[where] = _store(v[i], v_cache.dtype, scale_of(1, i))
        keys = torch.arange(starts[i], old + s_new, device=q.device)
        where = _cache_rows(k_cache, block_table, row, keys)
        kk, vv = k_cache[where], v_cache[where]
        if fp8:
            kk, vv = kk.float() * scale_of(0, i), vv.float() * scale_of(1, i)
        attend = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                      softcap=softcap, upcast=upcast)
        if num_splits > 1:
            o, l = _split_attention(qi, kk[None], vv[None], num_splits, learnable_sink, **attend)
        else:
            o, l = attention_ref(qi, kk[None], vv[None], learnable_sink=learnable_sink, **attend)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def _store(x: torch.Tensor, dtype, descale: torch.Tensor) -> torch.Tensor:
    """Tokens as the cache holds them: as they are, or for an fp8 cache quantized (x / descale)."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (x.float() / descale).to(dtype)
    return x.to(dtype)


def _per_batch(value, batch: int, capacity: int) -> list:
    """cache_seqlens as a list of ints: an int for every entry, a tensor's values, or (None) the
    cache's whole capacity (its length, or pages per sequence x page size)."""
    if value is None:
        return [capacity] * batch
    if isinstance(value, int):
        return [value] * batch
    return value.tolist()


# ---- FP8 inputs ----

def dequantize_fp8(x: torch.Tensor, descale: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """float32 values of an fp8 q, k or v: x times its descale, FlashAttention-3's (batch,
    nheads_k) float32 (None: 1.0), head h of x taking kv head h // (nheads / nheads_k)'s.
    Batched x (batch, seqlen, nheads, d); packed (total, nheads, d) with cu_seqlens, whose
    sequence b's rows take batch b's descales (rows outside every sequence take the last's)."""
    xf = x.float()
    if descale is None:
        return xf
    heads = x.shape[-2]
    head_map = torch.arange(heads, device=x.device) // (heads // descale.shape[1])
    per_head = descale.float()[:, head_map]  # (batch, nheads)
    if cu_seqlens is None:
        return xf * per_head[:, None, :, None]
    rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
    batch = (torch.searchsorted(cu_seqlens, rows, right=True) - 1).clamp(0, descale.shape[0] - 1)
    return xf * per_head[batch][:, :, None]


def _apply_score_mod(score_mod, scores: torch.Tensor, q_offset: int = 0) -> torch.Tensor:
    """score_mod(score, b, h, q_idx, kv_idx) on (b, h, sq, sk) scores of query rows from
    q_offset on, the indices as broadcasting tensors (FlexAttention's signature, vectorised)."""
    b, h, sq, sk = scores.shape
    idx = lambda n, dim: torch.arange(n, device=scores.device).view([-1 if i == dim else 1 for i in range(4)])
    return torch.as_tensor(score_mod(scores, idx(b, 0), idx(h, 1), idx(sq, 2) + q_offset,
                                     idx(sk, 3)), device=scores.device).to(scores.dtype).expand_as(scores)


def _mods_of_sequence(b: int, score_mod, mask_mod, block_sparse) -> dict:
    """The modifiers of packed sequence b as a batch-of-one attention_ref sees them: b added to
    their batch index, the block lists of batch b (or the broadcast ones)."""
    mods = {}
    if score_mod is not None:
        mods["score_mod"] = lambda s, bb, h, qi, kv: score_mod(s, bb + b, h, qi, kv)
    if mask_mod is not None:
        mods["mask_mod"] = lambda bb, h, qi, kv: mask_mod(bb + b, h, qi, kv)
    if block_sparse is not None:
        from cuteattn import sparse
        mods["block_sparse"] = sparse.select_batch(block_sparse, b)
    return mods


# ---- split-KV: partial results over key ranges, merged ----

def merge_partials(outs: torch.Tensor, lses: torch.Tensor, learnable_sink=None):
    """The exact attention from partial results over disjoint key ranges (split-KV decoding,
    context parallelism): outs (splits, ..., sq, h, dv) float32 normalised within each split,
    lses (splits, ..., h, sq). lse = logsumexp over the splits (and the sink, counted once, here
    and not in any split); out = sum_s exp(lse_s - lse) out_s. Splits that saw no key (lse -inf)
    weigh 0; a row no split saw gets 0 and -inf (or the sink's logit)."""
    terms = lses
    if learnable_sink is not None:
        sink = learnable_sink.float().view(-1, 1).expand_as(lses[0])
        terms = torch.cat([lses, sink.unsqueeze(0)], dim=0)
    lse = torch.logsumexp(terms, dim=0)
    finite = torch.isfinite(lse)
    weights = torch.where(finite, torch.exp(lses - torch.where(finite, lse, 0.0)), 0.0)
    out = (outs * weights.transpose(-1, -2).unsqueeze(-1)).sum(0)  # (..., sq, h, dv)
    return out, lse


SPLIT_BLOCK = 128  # keys per block when a key range is split (as a kernel's key blocks)


def _split_attention(q, k, v, num_splits, learnable_sink, *, softmax_scale, causal, window_size,
                     softcap, upcast):
    """attention_ref over num_splits ranges of whole SPLIT_BLOCK-key blocks of k, merged."""
    sk, hk, h = k.shape[1], k.shape[2], q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    dtype = torch.float32 if upcast else q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if hk != h:
        k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    blocks = -(-sk // SPLIT_BLOCK)
    per_split = -(-blocks // num_splits) * SPLIT_BLOCK
    outs, lses = [], []
    for lo in range(0, sk, per_split):
        hi = min(lo + per_split, sk)
        _, probs, _, lse = _scores_and_probs(q, k[:, lo:hi], scale, causal, window_size, softcap,
                                             cols=(lo, sk))
        outs.append(torch.einsum("bhqk,bkhd->bqhd", probs, v[:, lo:hi]).float())
        lses.append(lse.float())
    if not outs:  # no key at all
        return attention_ref(q, k, v, learnable_sink=learnable_sink, softmax_scale=scale,
                             causal=causal, window_size=window_size, softcap=softcap,
                             upcast=upcast)
    return merge_partials(torch.stack(outs), torch.stack(lses), learnable_sink)
