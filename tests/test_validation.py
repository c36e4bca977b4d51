"""Every rejected input, for both entry points: the error type and that the message names the rule."""
import warnings

import pytest
import torch

from cuteattn import flash_attn_func, flash_attn_varlen_func

BF16 = torch.bfloat16
KINDS = ["fixed", "varlen"]


def make(kind, *, dtype=BF16, d=64, dv=None, h=4, hk=4):
    """Valid arguments for one call of `kind` (small, CPU)."""
    dv = d if dv is None else dv
    if kind == "fixed":
        return dict(
            q=torch.randn(2, 8, h, d, dtype=dtype),
            k=torch.randn(2, 12, hk, d, dtype=dtype),
            v=torch.randn(2, 12, hk, dv, dtype=dtype),
        )
    return dict(
        q=torch.randn(10, h, d, dtype=dtype),
        k=torch.randn(14, hk, d, dtype=dtype),
        v=torch.randn(14, hk, dv, dtype=dtype),
        cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 6, 14], dtype=torch.int32),
        max_seqlen_q=6,
        max_seqlen_k=8,
    )


def call(kind, args, **kw):
    fn = flash_attn_func if kind == "fixed" else flash_attn_varlen_func
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # valid calls fall back to the reference on CPU
        return fn(**args, **kw)


def rejects(kind, args, exc, match, **kw):
    with pytest.raises(exc, match=match):
        call(kind, args, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_valid_arguments_pass(kind):
    args = make(kind)
    out = call(kind, args)
    assert out.shape == args["q"].shape


# ---- dtypes and devices ----

@pytest.mark.parametrize("kind", KINDS)
def test_float32_rejected(kind):
    rejects(kind, make(kind, dtype=torch.float32), TypeError,
            "q dtype must be float16, bfloat16 or float8_e4m3fn")


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_e5m2_rejected(kind):
    args = {n: (t.to(torch.float8_e5m2) if n in "qkv" else t) for n, t in make(kind).items()}
    rejects(kind, args, TypeError, "float8_e5m2 is not supported")


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_with_bf16_k_rejected(kind):
    args = make(kind)
    args["q"] = args["q"].to(torch.float8_e4m3fn)
    rejects(kind, args, TypeError, "k dtype")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad,exc,match", [
    ("shape", ValueError, r"q_descale must be float32 of shape \(batch, nheads_k\) = \(2, 4\)"),
    ("dtype", ValueError, "q_descale must be float32"),
    ("not fp8", ValueError, "q_descale applies to float8_e4m3fn inputs only"),
    ("type", TypeError, "q_descale must be a torch.Tensor"),
])
def test_fp8_descale_rules(kind, bad, exc, match):
    args = make(kind)
    if bad != "not fp8":
        args = {n: (t.to(torch.float8_e4m3fn) if n in "qkv" else t) for n, t in args.items()}
    descale = {"shape": torch.ones(2, 3), "dtype": torch.ones(2, 4, dtype=torch.float64),
               "not fp8": torch.ones(2, 4), "type": [[1.0] * 4] * 2}[bad]
    rejects(kind, args, exc, match, q_descale=descale)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["k", "v"])
def test_dtype_mismatch(kind, name):
    args = make(kind)
    args[name] = args[name].half()
    rejects(kind, args, TypeError, f"{name} dtype .* must equal q's")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["k", "v"])
def test_mixed_devices(kind, name):
    args = make(kind)
    args[name] = args[name].to("meta")
    rejects(kind, args, ValueError, f"{name} is on meta but q is on cpu")


def test_non_tensor_rejected():
    args = make("fixed")
    args["k"] = args["k"].tolist()
    rejects("fixed", args, TypeError, "k must be a torch.Tensor")


# ---- ranks and shapes ----

@pytest.mark.parametrize("kind", KINDS)
def test_rank(kind):
    args = make(kind)
    args["q"] = args["q"][0]
    want = "4-D" if kind == "fixed" else "3-D"
    rejects(kind, args, ValueError, f"q must be {want}")


def test_batch_mismatch():
    args = make("fixed")
    args["k"], args["v"] = args["k"][:1], args["v"][:1]
    rejects("fixed", args, ValueError, "k's batch")


@pytest.mark.parametrize("kind", KINDS)
def test_v_shape_mismatch(kind):
    args = make(kind)
    args["v"] = args["v"][..., :2, :]
    rejects(kind, args, ValueError, "v's shape .* must match k's")


@pytest.mark.parametrize("kind", KINDS)
def test_k_head_dim_mismatch(kind):
    args = make(kind)
    args["k"] = torch.randn(*args["k"].shape[:-1], 128, dtype=BF16)
    rejects(kind, args, ValueError, "k's head_dim")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [4, 12, 84, 264, 512])
def test_unsupported_head_dim(kind, d):
    """FlashAttention's range: multiples of 8 up to 256."""
    rejects(kind, make(kind, d=d), NotImplementedError, f"head_dim {d} is not supported")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d,dv", [(32, 32), (80, 80), (160, 160), (128, 64), (192, 128), (64, 256)])
def test_head_dims_without_a_kernel_run_on_the_reference(kind, d, dv):
    """Head dims FlashAttention serves but no kernel does yet: accepted, computed by the reference
    (on a GPU a FallbackWarning would name the reason), out shaped by v's head dim."""
    out = call(kind, make(kind, d=d, dv=dv))
    assert out.shape[-1] == dv and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("kind", KINDS)
def test_head_dim_v_too_large(kind):
    rejects(kind, make(kind, d=128, dv=264), NotImplementedError, "head_dim_v")


@pytest.mark.parametrize("kind", KINDS)
def test_nheads_not_multiple(kind):
    rejects(kind, make(kind, h=6, hk=4), ValueError, r"nheads \(6\) must be a multiple of nheads_k \(4\)")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_unit_head_stride(kind, name):
    args = make(kind)
    wide = torch.randn(*args[name].shape[:-1], 2 * args[name].shape[-1], dtype=BF16)
    args[name] = wide[..., ::2]
    rejects(kind, args, ValueError, f"{name} must have stride 1 in its last")


# ---- scalars and unsupported features ----

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [(-2, 1), (3, -5), (-4, 0), (0, -1 - 1)])
def test_window_that_leaves_no_key(kind, window):
    """Two bounded sides with left + right < 0: no query sees any key."""
    rejects(kind, make(kind), ValueError, r"left \+ right must be >= 0", window_size=window)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [(1.5, 0), (0,), "ab", 3])
def test_window_type(kind, window):
    rejects(kind, make(kind), TypeError, "window_size", window_size=window)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf")])
def test_bad_softcap(kind, softcap):
    rejects(kind, make(kind), ValueError, "softcap must be finite and >= 0", softcap=softcap)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale", [0.0, -0.1, float("inf"), float("nan")])
def test_bad_softmax_scale(kind, scale):
    rejects(kind, make(kind), ValueError, "softmax_scale must be finite and > 0", softmax_scale=scale)


def test_softmax_scale_tensor_rejected():
    rejects("fixed", make("fixed"), TypeError, "softmax_scale", softmax_scale=torch.tensor(0.1))


@pytest.mark.parametrize("kind", KINDS)
def test_dropout(kind):
    rejects(kind, make(kind), NotImplementedError, "dropout_p", dropout_p=0.1)


@pytest.mark.parametrize("kind", KINDS)
def test_alibi_slopes_checked(kind):
    """FlashAttention-2's alibi_slopes (tests/test_alibi.py has their values): float32,
    (nheads,) or (batch, nheads)."""
    rejects(kind, make(kind), ValueError, "alibi_slopes must have shape", alibi_slopes=torch.ones(3))
    rejects(kind, make(kind), TypeError, "alibi_slopes must be float32",
            alibi_slopes=torch.ones(4, dtype=torch.float64))
    assert call(kind, make(kind), alibi_slopes=torch.ones(2, 4)).shape == make(kind)["q"].shape


@pytest.mark.parametrize("kind", KINDS)
def test_return_attn_probs_is_flashattention2s_triple(kind):
    """FlashAttention-2 returns (out, softmax_lse, S_dmask) for return_attn_probs=True, S_dmask
    None without dropout (ring / context-parallel code reads the lse that way)."""
    args = make(kind)
    out, lse = call(kind, args, return_lse=True)
    for extra in ({}, {"return_lse": True}, {"return_lse": False}):
        triple = call(kind, args, return_attn_probs=True, **extra)
        assert isinstance(triple, tuple) and len(triple) == 3 and triple[2] is None
        torch.testing.assert_close(triple[0], out, rtol=0, atol=0)
        torch.testing.assert_close(triple[1], lse, rtol=0, atol=0)
    rejects(kind, args, TypeError, "return_attn_probs must be a bool", return_attn_probs="yes")
    rejects(kind, args, NotImplementedError, "dropout_p", return_attn_probs=True, dropout_p=0.1)


@pytest.mark.parametrize("kind", KINDS)
def test_return_attn_probs_keeps_gradients(kind):
    """The triple's out carries the gradient as a plain call's does (its lse none)."""
    args = {n: (t.clone().requires_grad_(True) if n in "qkv" else t) for n, t in make(kind).items()}
    out, lse, _ = call(kind, args, return_attn_probs=True)
    assert not lse.requires_grad
    grads = torch.autograd.grad(out.float().square().sum(), [args["q"], args["k"], args["v"]])
    plain = call(kind, args)
    expected = torch.autograd.grad(plain.float().square().sum(), [args["q"], args["k"], args["v"]])
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


# ---- out / lse buffers ----

@pytest.mark.parametrize("kind", KINDS)
def test_out_buffer_shape_and_dtype(kind):
    args = make(kind)
    rejects(kind, args, ValueError, "out must be", out=torch.empty(3, dtype=BF16))
    rejects(kind, args, ValueError, "out must be", out=torch.empty_like(args["q"], dtype=torch.half))
    rejects(kind, args, ValueError, "lse must be", lse=torch.empty(3))


# ---- varlen index tensors ----

@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_dtype(name):
    args = make("varlen")
    args[name] = args[name].long()
    rejects("varlen", args, TypeError, f"{name} must be int32")


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_device(name):
    args = make("varlen")
    args[name] = args[name].to("meta")
    rejects("varlen", args, ValueError, f"{name} is on meta but q is on cpu")


def test_cu_seqlens_rank():
    args = make("varlen")
    args["cu_seqlens_q"] = args["cu_seqlens_q"].view(1, 3)
    rejects("varlen", args, ValueError, "cu_seqlens_q must be 1-D")


def test_cu_seqlens_length_mismatch():
    args = make("varlen")
    args["cu_seqlens_k"] = torch.tensor([0, 6, 10, 14], dtype=torch.int32)
    rejects("varlen", args, ValueError,
            r"cu_seqlens_k \(length 4\) does not match cu_seqlens_q \(length 3\)")


def test_cu_seqlens_empty():
    args = make("varlen")
    args["cu_seqlens_q"] = torch.zeros(0, dtype=torch.int32)
    rejects("varlen", args, ValueError, "batch \\+ 1 >= 1")


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_none_means_a_batched_side(name):
    """Without its cu_seqlens a side must be batched (batch, seqlen, nheads, head_dim)."""
    args = make("varlen")
    args[name] = None
    side = "q" if name.endswith("q") else "k"
    rejects("varlen", args, ValueError, rf"{side} must be 4-D \(batch, seqlen, nheads, head_dim\) "
            "without cu_seqlens")


def test_one_sided_batch_mismatch():
    args = make("varlen")
    args["cu_seqlens_k"] = None
    args["k"] = torch.randn(3, 5, 4, 64, dtype=BF16)
    args["v"] = torch.randn(3, 5, 4, 64, dtype=BF16)
    rejects("varlen", args, ValueError, r"k's batch \(3\) does not match cu_seqlens_q \(length 3\)")


@pytest.mark.parametrize("name", ["seqused_q", "seqused_k"])
def test_seqused_shape_dtype_device(name):
    args = make("varlen")
    rejects("varlen", args, ValueError, f"{name} must have length batch = 2",
            **{name: torch.tensor([1, 2, 3], dtype=torch.int32)})
    rejects("varlen", args, TypeError, f"{name} must be int32", **{name: torch.tensor([1, 2])})
    rejects("varlen", args, ValueError, f"{name} is on meta",
            **{name: torch.tensor([1, 2], dtype=torch.int32, device="meta")})


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_max_seqlen(name):
    args = make("varlen")
    args[name] = -1
    rejects("varlen", args, ValueError, f"{name} must be >= 0")
    for bad in (6.0, torch.tensor(6), True):
        args[name] = bad
        rejects("varlen", args, TypeError, f"{name} must be a Python int")


# ---- validate=True: the checks that read the lengths ----

def test_validate_accepts_good_input():
    args = make("varlen")
    call("varlen", args, validate=True, seqused_q=torch.tensor([4, 0], dtype=torch.int32))


@pytest.mark.parametrize(
    "name, values, match",
    [
        ("cu_seqlens_q", [1, 4, 10], "cu_seqlens_q must start at 0"),
        ("cu_seqlens_q", [0, 7, 6], "cu_seqlens_q must be non-decreasing"),
        ("cu_seqlens_k", [0, 6, 12], r"cu_seqlens_k must end at the total number of rows \(14\)"),
        ("cu_seqlens_k", [0, 6, 15], "cu_seqlens_k must end at"),
    ],
)
def test_validate_cu_seqlens(name, values, match):
    args = make("varlen")
    args[name] = torch.tensor(values, dtype=torch.int32)
    if name == "cu_seqlens_q" and values[-1] != 10:
        args["q"] = torch.randn(values[-1], 4, 64, dtype=BF16)
    rejects("varlen", args, ValueError, match, validate=True)


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_validate_max_seqlen_too_small(name):
    args = make("varlen")
    args[name] = 5  # the longest q sequence has 6 rows, the longest k sequence 8
    rejects("varlen", args, ValueError, f"{name} .* smaller than a sequence's length", validate=True)


def test_validate_max_seqlen_counts_seqused():
    args = make("varlen")
    args["max_seqlen_k"] = 6  # cu_seqlens_k gives lengths 6 and 8, but only 6 and 5 are used
    call("varlen", args, validate=True, seqused_k=torch.tensor([6, 5], dtype=torch.int32))


@pytest.mark.parametrize("used", [[5, 0], [0, -1]])
def test_validate_seqused_range(used):
    args = make("varlen")
    rejects("varlen", args, ValueError, r"seqused_q\[\d\] = -?\d must lie in \[0, \d\]",
            validate=True, seqused_q=torch.tensor(used, dtype=torch.int32))


# ---- the reference fallback reads the lengths anyway: it applies validate=True's rules ----

def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def packed12(batch=2):
    """12 packed q and k tokens (the issue's repro, smaller head_dim), valid metadata."""
    cu = [0, 4, 12] if batch == 2 else [0, 4, 8, 12]
    return dict(
        q=torch.randn(12, 4, 64, dtype=BF16),
        k=torch.randn(12, 4, 64, dtype=BF16),
        v=torch.randn(12, 4, 64, dtype=BF16),
        cu_seqlens_q=_i32(cu), cu_seqlens_k=_i32(cu), max_seqlen_q=8, max_seqlen_k=8,
    )


# (changed arguments, batch, the rule the message names)
BAD_METADATA = [
    (dict(cu_seqlens_q=[0, 4, 20]), 2, r"cu_seqlens_q must end at the total number of rows \(12\); got 20"),
    (dict(cu_seqlens_k=[0, 4, 20]), 2, r"cu_seqlens_k must end at the total number of rows \(12\); got 20"),
    (dict(cu_seqlens_q=[0, 4, 4000]), 2, "cu_seqlens_q must end at .* got 4000"),
    (dict(cu_seqlens_k=[0, 4, 4000]), 2, "cu_seqlens_k must end at .* got 4000"),
    (dict(cu_seqlens_q=[-8, 4, 12]), 2, "cu_seqlens_q must start at 0; got -8"),
    (dict(cu_seqlens_k=[-8, 4, 12]), 2, "cu_seqlens_k must start at 0; got -8"),
    (dict(cu_seqlens_q=[-2**31 + 1, 0, 12]), 2, f"cu_seqlens_q must start at 0; got {-2**31 + 1}"),
    (dict(cu_seqlens_q=[0, -4, 12]), 2, "cu_seqlens_q must be non-decreasing"),
    (dict(cu_seqlens_q=[0, 8, 4, 12]), 3, "cu_seqlens_q must be non-decreasing; it decreases after index 1"),
    (dict(cu_seqlens_k=[0, 8, 4, 12]), 3, "cu_seqlens_k must be non-decreasing; it decreases after index 1"),
    (dict(max_seqlen_q=1), 2, r"max_seqlen_q \(1\) is smaller than a sequence's length \(8\)"),
    (dict(max_seqlen_k=1), 2, r"max_seqlen_k \(1\) is smaller than a sequence's length \(8\)"),
    (dict(seqused_q=[-1, 8]), 2, r"seqused_q\[0\] = -1 must lie in \[0, 4\]"),
    (dict(seqused_q=[4, 9]), 2, r"seqused_q\[1\] = 9 must lie in \[0, 8\]"),
    (dict(seqused_k=[5, 8]), 2, r"seqused_k\[0\] = 5 must lie in \[0, 4\]"),
    (dict(seqused_k=[0, -2**31]), 2, rf"seqused_k\[1\] = {-2**31} must lie in \[0, 8\]"),
    (dict(seqused_k=[2**30, 0]), 2, rf"seqused_k\[0\] = {2**30} must lie in \[0, 4\]"),
]


def varlen_args(change, batch):
    args = packed12(batch)
    for name, value in change.items():
        args[name] = _i32(value) if isinstance(value, list) else value
    return args


@pytest.mark.parametrize("change, batch, match", BAD_METADATA,
                         ids=[";".join(f"{n}={v}" for n, v in c.items()) for c, _, _ in BAD_METADATA])
def test_fallback_rejects_bad_metadata_like_validate(change, batch, match):
    args = varlen_args(change, batch)
    with pytest.raises(ValueError, match=match) as validated:
        call("varlen", args, validate=True)
    # without validate=True the fallback checks too, before computing: out stays untouched
    out = torch.full((12, 4, 64), 1234.0, dtype=BF16)
    lse = torch.full((4, 12), 1234.0)
    with pytest.raises(ValueError, match=match) as fallback:
        call("varlen", args, out=out, lse=lse)
    assert str(fallback.value) == str(validated.value)
    assert torch.all(out == 1234.0) and torch.all(lse == 1234.0)


@pytest.mark.parametrize(
    "change",
    [dict(), dict(seqused_q=[4, 3], seqused_k=[0, 8]), dict(cu_seqlens_q=[0, 12, 12], max_seqlen_q=12),
     dict(cu_seqlens_q=[0, 0, 4, 12], cu_seqlens_k=[0, 4, 4, 12], max_seqlen_q=9, max_seqlen_k=12)],
)
def test_fallback_accepts_good_metadata(change):
    from cuteattn.reference import attention_varlen_ref

    args = varlen_args(change, len(change.get("cu_seqlens_q", [0, 4, 12])) - 1)
    out, lse = call("varlen", args, causal=True, return_lse=True)
    checked = call("varlen", args, causal=True, return_lse=True, validate=True)
    ref, ref_lse = attention_varlen_ref(
        args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"],
        args.get("seqused_q"), args.get("seqused_k"), causal=True,
    )
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)
    assert torch.equal(checked[0], out) and torch.equal(checked[1], lse)


def test_fallback_reads_the_lengths_once(monkeypatch):
    from cuteattn import _checks

    reads = []
    real = _checks.varlen_values_on_host
    monkeypatch.setattr(_checks, "varlen_values_on_host", lambda *a: reads.append(1) or real(*a))
    call("varlen", packed12())
    assert len(reads) == 1
    call("varlen", packed12(), validate=True)  # validate=True's copies serve the fallback
    assert len(reads) == 2


def test_kernel_path_does_not_read_the_lengths(monkeypatch):
    # a kernel trusts the metadata (its launch must not sync): bad values reach it unchecked
    from cuteattn import _checks, api

    launched = []
    monkeypatch.setattr(api, "_select_kernel", lambda spec, dev: (lambda *a, **kw: launched.append(kw), None))
    monkeypatch.setattr(_checks, "varlen_values_on_host", lambda *a: pytest.fail("values read"))
    call("varlen", varlen_args(dict(cu_seqlens_q=[0, 4, 4000]), 2))
    assert launched and launched[0]["cu_seqlens_q"].tolist() == [0, 4, 4000]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flag, value", [("causal", "False"), ("causal", 2),
                                         ("deterministic", "yes"), ("return_lse", None),
                                         ("strict", "no")])
def test_flags_must_be_bools(kind, flag, value):
    # a string "False" is truthy: taken as given it would apply (or skip) a mask silently
    rejects(kind, make(kind), TypeError, f"{flag} must be a bool", **{flag: value})


@pytest.mark.parametrize("kind", KINDS)
def test_flags_take_bools_and_0_1(kind):
    import numpy as np
    args = make(kind)
    out = call(kind, args, causal=np.bool_(True))
    assert torch.equal(out, call(kind, args, causal=1))
    assert torch.equal(out, call(kind, args, causal=True))
    assert not torch.equal(out, call(kind, args, causal=0))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [(2 ** 31, 0), (0, -2 ** 40), (None, 2 ** 70)])
def test_window_edges_must_fit_int32(kind, window):
    # (the kernels take them as int32: a larger value would wrap into another mask)
    rejects(kind, make(kind), ValueError, "must fit int32", window_size=window)


@pytest.mark.parametrize("kind", KINDS)
def test_softmax_scale_must_fit_float32(kind):
    rejects(kind, make(kind), ValueError, "softmax_scale must be finite", softmax_scale=1e300)


@pytest.mark.parametrize("cu_q, max_k, match", [([0, 4, 10], 0, "max_seqlen_k .0. is smaller"),
                                                ([7, -3, 99], 0, "cu_seqlens_q must start at 0")])
def test_an_empty_claim_on_the_host_is_checked(cu_q, max_k, match):
    # max_seqlen_k = 0 would take the empty shortcut (out 0, lse -inf); on the host the
    # lengths cost nothing to read, so metadata that contradicts it is an error, not zeros
    args = dict(make("varlen"), cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
                max_seqlen_k=max_k)
    rejects("varlen", args, ValueError, match)
