"""The backward's exact gradient on rows that see one key (the sm80 and sm90 backward kernels).

Kept apart from mask.py, which the forward kernels import, so that the forward's compiled
variants (keyed by their sources) stay as they were."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def may_hold_one_key_row(key_start: Int32, keys: cutlass.Constexpr, seqlen_k: Int32,
                         window_left: Int32, window_right: Int32, causal: cutlass.Constexpr,
                         local: cutlass.Constexpr):
    """Whether keys [key_start, key_start + keys) can be the one key some query row sees (the
    blocks zero_one_key_ds must visit). A row sees keys [max(0, q + off - left),
    min(seqlen_k, q + off + right + 1)) (right 0 under causal, no left edge without a window):
    one key either at an end of the sequence (key 0, or the last key where a window's left
    edge meets it) or anywhere when left + right = 0; without causal or a window, only when
    the sequence has one key. A test per block on values the loop holds anyway: the
    masked-block test in its place spilled packed d=128 on sm90."""
    holds = key_start == 0
    if cutlass.const_expr(not (causal or local)):
        holds = holds & (seqlen_k == 1)
    if cutlass.const_expr(local):
        right = cutlass.min(window_right, 0) if cutlass.const_expr(causal) else window_right
        holds = holds | (key_start + keys >= seqlen_k) | (window_left == -right)
    return holds


@cute.jit
def zero_one_key_ds(acc_dS_mn: cute.Tensor, coord_mn: cute.Tensor, q_start: Int32,
                    seqlen_q: Int32, seqlen_k: Int32, window_left: Int32, window_right: Int32,
                    causal: cutlass.Constexpr, local: cutlass.Constexpr,
                    queries_mode: cutlass.Constexpr):
    """dS = 0 for the queries whose row, by the sequence end, the causal diagonal and the
    window, sees exactly one key. The softmax of one score is 1 whatever the score, so its
    gradient is exactly 0 (with softcap or a score_mod too; a mask_mod or block list can only
    leave that row fewer keys, and none means P = 0). P (dP - D) leaves ~1e-5 there instead,
    D being rowsum(dO O) of the rounded O, and dK of a one-key sequence is nothing but that.
    Not with a learnable sink, which joins every row's denominator. Callers run this on the
    blocks may_hold_one_key_row names. acc_dS_mn and coord_mn: (rows, cols) views, queries
    along mode queries_mode (1: the backward's S^T), query q_start + that coordinate."""
    off = seqlen_k - seqlen_q
    for a in cutlass.range_constexpr(cute.size(acc_dS_mn, mode=[queries_mode])):
        first = (0, a) if cutlass.const_expr(queries_mode == 1) else (a, 0)
        q = q_start + coord_mn[first][queries_mode]
        one_key = seqlen_k == 1  # (every row's count without causal or a window)
        if cutlass.const_expr(causal or local):
            key_hi = seqlen_k  # exclusive
            key_lo = Int32(0)
            if cutlass.const_expr(causal):
                key_hi = cutlass.min(key_hi, q + off + 1)
            if cutlass.const_expr(local):
                key_hi = cutlass.min(key_hi, q + off + window_right + 1)
                key_lo = cutlass.max(key_lo, q + off - window_left)
            one_key = key_hi - key_lo == 1
        keep = Float32(1.0)  # (a factor: dS times 0 on a one-key row)
        if one_key:
            keep = Float32(0.0)
        for b in cutlass.range_constexpr(cute.size(acc_dS_mn, mode=[1 - queries_mode])):
            rc = (b, a) if cutlass.const_expr(queries_mode == 1) else (a, b)
            acc_dS_mn[rc] = acc_dS_mn[rc] * keep
