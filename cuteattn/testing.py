"""Comparison helpers implementing FlashAttention's correctness rule (used by the tests and the bench).

The rule: a low-precision result passes when its max error against the float32 reference (computed
from the same low-precision inputs) is at most twice the max error of a plain low-precision PyTorch
computation of the same thing, plus a tiny floor. NaN never passes.
"""
from __future__ import annotations

import torch

# The floor only absorbs float32 rounding in the reference where both errors are (near) zero, e.g.
# a single visible key, where every exact implementation returns v itself.
FA_FLOOR = 1e-5


def fa_error(out: torch.Tensor, out_ref: torch.Tensor, out_lowprec: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref|, max |lowprec - ref|) in float32; NaN anywhere in out makes the first NaN."""
    if out.shape != out_ref.shape or out_lowprec.shape != out_ref.shape:
        raise ValueError(
            f"shape mismatch: out {tuple(out.shape)}, ref {tuple(out_ref.shape)}, "
            f"lowprec {tuple(out_lowprec.shape)}"
        )
    if out.numel() == 0:
        return 0.0, 0.0
    ref = out_ref.float()
    err = (out.float() - ref).abs()
    # .max() propagates NaN, but be explicit: an unwritten (NaN-poisoned) element must fail
    err_max = float("nan") if torch.isnan(out).any() else err.max().item()
    base_max = (out_lowprec.float() - ref).abs().max().item()
    return err_max, base_max


def assert_close_fa(
    out: torch.Tensor,
    out_ref: torch.Tensor,
    out_lowprec: torch.Tensor,
    *,
    floor: float = FA_FLOOR,
    name: str = "out",
) -> None:
    """Assert max|out - out_ref| <= 2 * max|out_lowprec - out_ref| + floor, NaN failing.

    out_ref: the float32 reference (reference.attention_ref(..., upcast=True));
    out_lowprec: the same computation in the input dtype (upcast=False).
    """
    if torch.isnan(out_ref).any() or torch.isnan(out_lowprec).any():
        raise AssertionError(f"{name}: the reference itself has NaN")
    err, base = fa_error(out, out_ref, out_lowprec)
    bound = 2 * base + floor
    if not err <= bound:  # also catches NaN
        raise AssertionError(
            f"{name}: max error {err:.3e} exceeds 2 x low-precision error {base:.3e} + {floor:.0e}"
            f" = {bound:.3e}"
        )


def assert_lse_close(lse: torch.Tensor, lse_ref: torch.Tensor, *, atol: float = 1e-3, name: str = "lse"):
    """LSE check: -inf exactly where the reference has -inf (rows with no key), |diff| <= atol elsewhere."""
    if lse.shape != lse_ref.shape:
        raise AssertionError(f"{name}: shape {tuple(lse.shape)} != reference {tuple(lse_ref.shape)}")
    if lse.dtype != torch.float32:
        raise AssertionError(f"{name}: dtype {lse.dtype}, expected float32")
    if torch.isnan(lse).any():
        raise AssertionError(f"{name}: has NaN ({int(torch.isnan(lse).sum())} elements)")
    empty_ref = torch.isneginf(lse_ref)
    empty = torch.isneginf(lse)
    if not torch.equal(empty, empty_ref):
        raise AssertionError(
            f"{name}: -inf pattern differs from the reference in {int((empty != empty_ref).sum())} rows"
        )
    finite = ~empty_ref
    if finite.any():
        err = (lse[finite] - lse_ref[finite]).abs().max().item()
        if not err <= atol:
            raise AssertionError(f"{name}: max error {err:.3e} > atol {atol:.0e}")


def fp8_scores_emulated(q, k, descales, scale: float) -> torch.Tensor:
    """q k^T of fp8 q (b, sq, h, d) and k (b, sk, hk, d) as a plain PyTorch fp8 GEMM computes it
    on this GPU (torch._scaled_mm with fast accumulation: the tensor cores' own, whose partial
    sums keep fewer bits than float32, as an fp8 attention kernel's do), times the descales and
    `scale`: (b, h, sq, sk) float32. CUDA only (the GEMM is the hardware's)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk

    def rows16(x):  # (s, d) fp8 -> zero rows appended to a multiple of 16, contiguous
        out = torch.zeros(-(-x.shape[0] // 16) * 16 or 16, d, dtype=torch.uint8, device=x.device)
        out[: x.shape[0]] = x.view(torch.uint8)
        return out.view(torch.float8_e4m3fn)

    one = torch.ones((), device=q.device)
    scores = torch.empty(b, h, sq, sk, device=q.device)
    for bi in range(b):
        for hi in range(h):
            s = torch._scaled_mm(rows16(q[bi, :, hi]), rows16(k[bi, :, hi // group]).t(),
                                 scale_a=one, scale_b=one, out_dtype=torch.float32,
                                 use_fast_accum=True)
            scores[bi, hi] = s[:sq, :sk]
    factor = torch.ones(b, hk, device=q.device)
    for x in descales[:2]:
        if x is not None:
            factor = factor * x
    return scores * (factor.repeat_interleave(group, dim=1) * scale)[:, :, None, None]


def fp8_attention_emulated(q, k, v, descales, *, causal=False, window_size=(-1, -1),
                           softcap=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 forward done plainly in PyTorch, the low-precision side of FlashAttention's rule
    for fp8 inputs: scores from the hardware's fp8 GEMM (fp8_scores_emulated), the
    probabilities relative to each row's max scaled by 256 and rounded to e4m3 before P V (as an
    fp8 kernel feeds its second GEMM), normalised by the unrounded row sums, v dequantized
    (exact in float32), the output rounded to bf16. Returns (out (b, sq, h, dv) float32, lse
    (b, h, sq))."""
    from .reference import dequantize_fp8, visible_mask, window_bounds
    scores = fp8_scores_emulated(q, k, descales, q.shape[-1] ** -0.5)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window_bounds(window_size)
    if causal:
        right = 0
    mask = visible_mask(q.shape[1], k.shape[1], left, right, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    if scores.shape[-1] == 0:  # no key at all: amax has nothing to reduce; every row is empty
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    else:
        row_max = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - torch.where(row_max == float("-inf"), 0.0, row_max))
    p8 = (p * 256).to(torch.float8_e4m3fn).float() / 256
    total = p.sum(dim=-1, keepdim=True)
    vf = dequantize_fp8(v, descales[2]).repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    out = torch.einsum("bhqk,bkhd->bqhd", p8 / torch.where(total > 0, total, 1.0), vf)
    return out.to(torch.bfloat16).float(), torch.logsumexp(scores, dim=-1)


def assert_lse_close_fa(lse, lse_ref, lse_lowprec, *, floor: float = 1e-3, name: str = "lse"):
    """FlashAttention's rule for the LSE: -inf exactly where the reference has it, elsewhere
    |lse - ref| <= 2 * max|lse_lowprec - ref| + floor (for inputs, such as fp8, whose plain
    low-precision computation is itself this far from the float32 reference)."""
    finite = torch.isfinite(lse_ref)
    base = float((lse_lowprec - lse_ref)[finite].abs().max()) if finite.any() else 0.0
    assert_lse_close(lse, lse_ref, atol=2 * base + floor, name=name)


def rising_row_maxima_qk(b: int, s: int, h: int, d: int, step: float, k_max: float | None = None,
                         device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q, k (b, s, h, d) whose scores climb along the keys, so that the online softmax's
    row max moves block after block: scores q0 * target / 2 with q0 in [1, 1.86) (each row's own
    rate, by row % 7), target rising by `step` (natural units) every 97 keys and by 13 every 701
    (a jump far past any lag); the other columns small noise. k_max clamps k's first column
    (fp8: e4m3's 448)."""
    scale = d ** -0.5
    keys = torch.arange(s, device=device, dtype=torch.float32)
    rows = torch.arange(s, device=device, dtype=torch.float32)
    target = step * torch.floor(keys / 97) + 13.0 * torch.floor(keys / 701)
    q = 0.1 * torch.randn(b, s, h, d, device=device)
    k = 0.1 * torch.randn(b, s, h, d, device=device)
    q[..., 0] = 1.0 + (rows % 7)[None, :, None] / 7
    k0 = target / scale / 2
    k[..., 0] = (k0 if k_max is None else k0.clamp(max=k_max))[None, :, None]
    return q, k
