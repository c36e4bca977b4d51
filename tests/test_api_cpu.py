"""The API on CPU: reference fallback, strict mode, autograd, normalisation, compile keys, and the
contract with cuteattn.dispatch (exercised with a fake dispatch module)."""
import functools
import types
import warnings

import pytest
import torch

import cuteattn
from cuteattn import _checks, api, flash_attn_func, flash_attn_varlen_func
from cuteattn.api import FallbackWarning
from cuteattn.reference import attention_ref, attention_varlen_ref

BF16 = torch.bfloat16


def qkv(b=2, sq=9, sk=13, h=4, hk=2, d=64, dtype=BF16, **kw):
    return (
        torch.randn(b, sq, h, d, dtype=dtype, **kw),
        torch.randn(b, sk, hk, d, dtype=dtype, **kw),
        torch.randn(b, sk, hk, d, dtype=dtype, **kw),
    )


def packed(lens_q=(3, 0, 7), lens_k=(5, 2, 0), h=4, hk=4, d=64, device="cpu"):
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), h, d, dtype=BF16)
    k = torch.randn(sum(lens_k), hk, d, dtype=BF16)
    v = torch.randn(sum(lens_k), hk, d, dtype=BF16)
    args = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k),
                max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return [t.to(device) for t in (q, k, v)], {n: t.to(device) if torch.is_tensor(t) else t
                                               for n, t in args.items()}


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        return fn(*args, **kw)


def test_public_names():
    assert set(cuteattn.__all__) == {
        "flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
        "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
        "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "FallbackWarning",
        "__version__"}
    assert isinstance(cuteattn.__version__, str)


# ---- fallback ----

@pytest.mark.parametrize(
    "kw",
    [dict(), dict(causal=True), dict(window_size=(3, 2)), dict(softcap=5.0, softmax_scale=0.2),
     dict(causal=True, window_size=(4, -1))],
)
def test_cpu_falls_back_to_reference(seed, kw):
    q, k, v = qkv()
    with pytest.warns(FallbackWarning, match="no kernel for cpu tensors.*strict=True or set CUTEATTN_STRICT=1"):
        out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    assert out.dtype == BF16 and out.shape == q.shape and lse.shape == (2, 4, 9)
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)


def test_varlen_falls_back_to_reference(seed):
    (q, k, v), args = packed(h=4, hk=2)
    with pytest.warns(FallbackWarning):
        out, lse = flash_attn_varlen_func(q, k, v, **args, causal=True, return_lse=True)
    ref, ref_lse = attention_varlen_ref(q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], causal=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    assert torch.equal(out, ref.to(BF16)) and torch.equal(lse, ref_lse)


def test_warns_once_per_reason(seed, monkeypatch):
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flash_attn_func(q, k, v)
        flash_attn_func(q, k, v, causal=True)
        monkeypatch.setattr(api, "_select_kernel", lambda spec, dev: (None, "sm_80 has no kernel yet"))
        flash_attn_func(q, k, v)
        flash_attn_func(q, k, v)
    messages = [str(w.message) for w in caught if w.category is FallbackWarning]
    assert len(messages) == 2
    assert "no kernel for cpu tensors" in messages[0] and "sm_80 has no kernel yet" in messages[1]


def test_warning_points_at_the_caller(seed):
    q, k, v = qkv()
    with pytest.warns(FallbackWarning) as record:
        flash_attn_func(q, k, v)
    assert record[0].filename == __file__


def test_strict_argument_raises(seed):
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"no GPU kernel for this call \(no kernel for cpu tensors\)"):
        flash_attn_func(q, k, v, strict=True)
    (q, k, v), args = packed()
    with pytest.raises(RuntimeError, match="strict mode"):
        flash_attn_varlen_func(q, k, v, **args, strict=True)


def test_strict_env(seed, monkeypatch):
    q, k, v = qkv()
    monkeypatch.setenv("CUTEATTN_STRICT", "1")
    with pytest.raises(RuntimeError, match="CUTEATTN_STRICT"):
        flash_attn_func(q, k, v)
    quiet(flash_attn_func, q, k, v, strict=False)  # the argument wins over the environment
    monkeypatch.setenv("CUTEATTN_STRICT", "0")
    quiet(flash_attn_func, q, k, v)


def test_validation_comes_before_strict(seed):
    q, k, v = qkv(d=84)  # not a multiple of 8: an argument error, not a missing kernel
    with pytest.raises(NotImplementedError, match="head_dim 84"):
        flash_attn_func(q, k, v, strict=True)


# ---- empty problems: no launch, no fallback ----

@pytest.mark.parametrize("b, sq", [(0, 5), (2, 0)])
def test_empty_queries(b, sq):
    q, k, v = qkv(b=b, sq=sq)
    out, lse = flash_attn_func(q, k, v, return_lse=True, strict=True)
    assert out.shape == q.shape and lse.shape == (b, 4, sq)


def test_no_keys_gives_zero_and_minus_inf():
    q, k, v = qkv(sk=0)
    out, lse = flash_attn_func(q, k, v, return_lse=True, strict=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_varlen_empty():
    (q, k, v), args = packed(lens_q=(0, 0), lens_k=(3, 1))
    out, lse = flash_attn_varlen_func(q, k, v, **args, return_lse=True, strict=True)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)
    (q, k, v), args = packed(lens_q=(2, 1), lens_k=(0, 0))
    out, lse = flash_attn_varlen_func(q, k, v, **args, return_lse=True, strict=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


# ---- out= / lse= buffers ----

def test_out_buffers_written_in_place(seed):
    q, k, v = qkv()
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, 9), float("nan"))
    got, got_lse = quiet(flash_attn_func, q, k, v, causal=True, return_lse=True, out=out, lse=lse)
    assert got is out and got_lse is lse
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out, quiet(flash_attn_func, q, k, v, causal=True))


# ---- autograd ----

def test_no_grad_inputs_give_plain_outputs(seed):
    out, lse = quiet(flash_attn_func, *qkv(), return_lse=True)
    assert not out.requires_grad and not lse.requires_grad and out.grad_fn is None


def test_gradients_are_the_reference_gradients(seed):
    """CPU tensors have no backward kernel: the gradient of the float32 reference, announced by
    a warning of its own (the forward's fallback warned already)."""
    q, k, v = (t.requires_grad_() for t in qkv())
    out, lse = quiet(flash_attn_func, q, k, v, causal=True, window_size=(3, -1), softcap=5.0,
                     return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    g = torch.randn_like(out)
    with pytest.warns(api.FallbackWarning, match="backward: no kernel for cpu tensors"):
        out.backward(g)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*leaves, causal=True, window_size=(3, -1), softcap=5.0)
    ref.backward(g.float())
    for got, want in zip((q.grad, k.grad, v.grad), leaves):
        assert got.dtype == want.dtype and torch.allclose(got, want.grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert not quiet(flash_attn_func, q, k, v).requires_grad


def test_strict_backward_raises(seed, monkeypatch):
    """Strict mode forbids the reference backward as it forbids the reference forward (strict=None
    in the call: the environment decides when the backward runs)."""
    q, k, v = (t.requires_grad_() for t in qkv())
    out = quiet(flash_attn_func, q, k, v)
    monkeypatch.setenv("CUTEATTN_STRICT", "1")
    with pytest.raises(RuntimeError, match="backward: no kernel for cpu tensors"):
        out.sum().backward()


def test_varlen_gradients_are_the_reference_gradients(seed):
    (q, k, v), args = packed()
    for t in (q, k, v):
        t.requires_grad_()
    out = quiet(flash_attn_varlen_func, q, k, v, **args)
    g = torch.randn_like(out)
    quiet(out.backward, g)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_varlen_ref(*leaves, args["cu_seqlens_q"], args["cu_seqlens_k"])
    ref.backward(g.float())
    for got, want in zip((q.grad, k.grad, v.grad), leaves):
        assert torch.allclose(got, want.grad, atol=1e-5, rtol=1e-5)


def test_out_buffers_refused_with_gradients(seed):
    q, k, v = (t.requires_grad_() for t in qkv())
    with pytest.raises(ValueError, match="out= / lse= buffers"):
        flash_attn_func(q, k, v, out=torch.empty_like(q))


# ---- mask normalisation and the spec ----

@pytest.mark.parametrize(
    "causal, window, expected",
    [
        (False, (-1, -1), (False, False, None, None)),
        (True, (-1, -1), (True, False, None, 0)),
        (False, (-1, 0), (True, False, None, 0)),
        (True, (-1, 7), (True, False, None, 0)),
        (True, (5, -1), (False, True, 5, 0)),
        (True, (5, 3), (False, True, 5, 0)),
        (False, (5, -1), (False, True, 5, None)),
        (False, (-1, 3), (False, True, None, 3)),
        (False, (0, 0), (False, True, 0, 0)),
        (False, (None, None), (False, False, None, None)),
        (False, (None, 0), (True, False, None, 0)),
        # FlashAttention-4's negative edges: below -1, or -1 beside a None side
        (False, (None, -1), (False, True, None, -1)),
        (False, (None, -5), (False, True, None, -5)),
        (False, (-3, None), (False, True, -3, None)),
        (False, (-1, None), (False, True, -1, None)),
        (False, (7, -4), (False, True, 7, -4)),
        (False, (-2, 2), (False, True, -2, 2)),
        (True, (2, None), (False, True, 2, 0)),
    ],
)
def test_normalize_mask(causal, window, expected):
    assert _checks.normalize_mask(causal, window) == expected


def spec(q, k, v, **kw):
    kw = dict(dict(softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0), **kw)
    return _checks.fixed_spec(q, k, v, **kw)


def test_causal_equals_window_minus_one_zero(seed):
    q, k, v = qkv()
    assert spec(q, k, v, causal=True) == spec(q, k, v, window_size=(-1, 0))
    out_c = quiet(flash_attn_func, q, k, v, causal=True)
    out_w = quiet(flash_attn_func, q, k, v, window_size=(-1, 0))
    assert torch.equal(out_c, out_w)


def test_spec_fields(seed):
    q, k, v = qkv(b=3, sq=5, sk=11, h=8, hk=2, d=128)
    s = spec(q, k, v, window_size=(16, 4), softcap=30.0)
    assert (s.dtype, s.head_dim, s.head_dim_v, s.causal, s.local, s.has_softcap) == (
        BF16, 128, 128, False, True, True)
    assert (s.batch, s.seqlen_q, s.seqlen_k, s.nheads, s.nheads_k, s.qhead_per_kvhead) == (3, 5, 11, 8, 2, 4)
    assert (s.window_left, s.window_right, s.softcap, s.device_index) == (16, 4, 30.0, -1)
    assert s.softmax_scale == pytest.approx(128 ** -0.5)
    assert not (s.varlen_q or s.varlen_k or s.has_seqused_q or s.has_seqused_k)


def test_compile_key_ignores_sizes(seed):
    base = spec(*qkv()).compile_key()
    assert spec(*qkv(b=5, sq=100, sk=3, h=8, hk=1)).compile_key() == base
    assert spec(*qkv(), softmax_scale=0.3).compile_key() == base
    local = spec(*qkv(), window_size=(8, 2)).compile_key()
    assert spec(*qkv(sq=70), window_size=(100, 0)).compile_key() == local
    assert spec(*qkv(), softcap=5.0).compile_key() == spec(*qkv(), softcap=50.0).compile_key()


def test_compile_key_separates_static_features(seed):
    keys = [
        spec(*qkv()).compile_key(),
        spec(*qkv(dtype=torch.float16)).compile_key(),
        spec(*qkv(d=128)).compile_key(),
        spec(*qkv(), causal=True).compile_key(),
        spec(*qkv(), window_size=(8, 2)).compile_key(),
        spec(*qkv(), softcap=5.0).compile_key(),
        spec(*qkv(), causal=True, softcap=5.0).compile_key(),
    ]
    (q, k, v), args = packed()
    vspec = lambda **kw: _checks.varlen_spec(
        q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], 7, 5, kw.get("sq"), kw.get("sk"),
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    )
    used = torch.zeros(3, dtype=torch.int32)
    keys += [vspec().compile_key(), vspec(sq=used).compile_key(), vspec(sk=used).compile_key()]
    assert len(set(keys)) == len(keys)


# ---- the dispatch contract, with a fake dispatch module ----

class FakeDispatch(types.SimpleNamespace):
    """Stands in for cuteattn.dispatch: records the launch and fills out/lse with sentinels."""

    def __init__(self):
        super().__init__(calls=[])

    def forward(self, spec, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                seqused_q=None, seqused_k=None, descales=None, learnable_sink=None):
        self.calls.append(dict(spec=spec, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
                               descales=descales, learnable_sink=learnable_sink))
        out.fill_(1.0)
        lse.fill_(2.0)

    def backward(self, spec, dout, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None):
        """(dq, dk, dv) sentinels: 3, 4, 5 (a backward kernel's contract)."""
        self.calls.append(dict(spec=spec, dout=dout, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q))
        return tuple(torch.full_like(t, c) for t, c in ((q, 3.0), (k, 4.0), (v, 5.0)))


@pytest.fixture
def fake_dispatch(monkeypatch):
    fake = FakeDispatch()
    fake.selections = 0

    def select(spec, device):  # api._select_kernel's contract: (launch, None)
        fake.selections += 1
        return functools.partial(fake.backward if spec.kind == "bwd" else fake.forward, spec), None

    monkeypatch.setattr(api, "_select_kernel", select)
    monkeypatch.setattr(api, "_launches", {})
    return fake


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_fixed_launch_contract(fake_dispatch, device):
    # on meta tensors any read of a value (.item(), a sync) would raise: the launch path reads none
    q, k, v = qkv(b=3, sq=5, sk=7, h=8, hk=2, device=device)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, strict=True)
    (call,) = fake_dispatch.calls
    assert call["q"] is q and call["k"] is k and call["v"] is v
    assert call["out"] is out and call["lse"] is lse
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (3, 8, 5) and lse.dtype == torch.float32
    assert call["spec"].causal and call["cu_seqlens_q"] is None
    if device == "cpu":
        assert torch.all(out == 1) and torch.all(lse == 2)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_varlen_launch_contract(fake_dispatch, device):
    (q, k, v), args = packed(h=8, hk=2, device=device)
    used = torch.tensor([1, 0, 7], dtype=torch.int32, device=device)
    out, lse = flash_attn_varlen_func(q, k, v, **args, seqused_k=used, window_size=(4, 0), return_lse=True)
    (call,) = fake_dispatch.calls
    assert call["cu_seqlens_q"] is args["cu_seqlens_q"] and call["cu_seqlens_k"] is args["cu_seqlens_k"]
    assert call["seqused_q"] is None and call["seqused_k"] is used
    assert out.shape == q.shape and lse.shape == (8, q.shape[0])
    s = call["spec"]
    assert s.varlen_q and s.varlen_k and s.has_seqused_k and not s.has_seqused_q
    assert (s.batch, s.seqlen_q, s.seqlen_k, s.local, s.window_left, s.window_right) == (3, 7, 5, True, 4, 0)


def test_repeated_fp8_call_returns_bf16(fake_dispatch):
    """The launch shortcut of a repeated fp8 call (no descales) allocates out in bf16, as the
    first call does, not in q's fp8."""
    q, k, v = (x.to(torch.float8_e4m3fn) for x in qkv(b=2, sq=9, sk=9, h=4, hk=4))
    first, second = flash_attn_func(q, k, v), flash_attn_func(q, k, v)
    assert first.dtype == second.dtype == torch.bfloat16 and fake_dispatch.selections == 1
    (qp, kp, vp), args = packed(h=8, hk=2)
    qp, kp, vp = (x.to(torch.float8_e4m3fn) for x in (qp, kp, vp))
    outs = [flash_attn_varlen_func(qp, kp, vp, **args) for _ in range(2)]
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16 and fake_dispatch.selections == 2


def test_repeated_call_skips_checks_and_selection(fake_dispatch):
    q, k, v = qkv(b=2, sq=9, sk=9, h=4, hk=4)
    first = flash_attn_func(q, k, v, causal=True, return_lse=True)
    second = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert fake_dispatch.selections == 1 and len(fake_dispatch.calls) == 2
    assert fake_dispatch.calls[1]["spec"] is fake_dispatch.calls[0]["spec"]
    assert second[0].shape == first[0].shape and second[1].shape == first[1].shape
    assert second[0] is not first[0]  # fresh outputs every call
    assert torch.all(second[0] == 1) and torch.all(second[1] == 2)


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "causal", "window", "scale", "softcap"])
def test_shortcut_misses_on_any_change(fake_dispatch, change):
    q, k, v = qkv(b=2, sq=9, sk=9, h=4, hk=4)
    kw = dict(causal=False, window_size=(-1, -1), softmax_scale=None, softcap=0.0)
    flash_attn_func(q, k, v, **kw)
    if change == "shape":
        q, k, v = qkv(b=2, sq=10, sk=9, h=4, hk=4)
    elif change == "stride":
        q = torch.randn(2, 4, 9, 64, dtype=q.dtype).transpose(1, 2)
    elif change == "dtype":
        q, k, v = (t.to(torch.float16) for t in (q, k, v))
    elif change == "causal":
        kw["causal"] = True
    elif change == "window":
        kw["window_size"] = (3, 0)
    elif change == "scale":
        kw["softmax_scale"] = 0.5
    else:
        kw["softcap"] = 5.0
    flash_attn_func(q, k, v, **kw)
    assert fake_dispatch.selections == 2  # the second call took the full path
    first, second = (c["spec"] for c in fake_dispatch.calls)
    assert (first == second) == (change == "stride")  # strides are not part of the spec


def test_shortcut_still_rejects_lookalike_arguments(fake_dispatch):
    """True == 1 and hashes alike, but a bool softmax_scale or window side is an error."""
    q, k, v = qkv(b=1, sq=5, sk=5, h=2, hk=2)
    flash_attn_func(q, k, v, softmax_scale=1, window_size=(1, 0))
    with pytest.raises(TypeError, match="softmax_scale"):
        flash_attn_func(q, k, v, softmax_scale=True, window_size=(1, 0))
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_func(q, k, v, softmax_scale=1, window_size=(True, 0))


def test_shortcut_not_taken_for_buffers_or_lists(fake_dispatch):
    q, k, v = qkv(b=1, sq=5, sk=5, h=2, hk=2)
    for _ in range(2):
        flash_attn_func(q, k, v, out=torch.empty_like(q))
    for _ in range(2):
        flash_attn_func(q, k, v, window_size=[-1, -1])
    assert fake_dispatch.selections == 4 and not api._launches


@pytest.mark.parametrize("packed_seqs", [False, True])
def test_shortcut_keeps_calls_with_a_sink_or_descales(fake_dispatch, packed_seqs):
    """A learnable sink (a plain tensor or an nn.Parameter) and fp8 descales are part of the
    signature by shape, dtype and device: a repeated call makes no new kernel choice and hands
    the launch this call's tensors; one of another shape takes the full path and its error."""
    if packed_seqs:
        (q, k, v), args = packed(h=4, hk=2)
        call = lambda *t, **kw: flash_attn_varlen_func(*t, **args, causal=True, **kw)
        batch = len(args["cu_seqlens_q"]) - 1
    else:
        q, k, v = qkv(b=2, sq=5, sk=7, h=4, hk=2)
        call = lambda *t, **kw: flash_attn_func(*t, causal=True, **kw)
        batch = 2
    for sink in (torch.zeros(4), torch.zeros(4), torch.nn.Parameter(torch.zeros(4), requires_grad=False)):
        call(q, k, v, learnable_sink=sink)
        assert fake_dispatch.selections == 1  # (a Parameter of the same shape: the same signature)
        assert fake_dispatch.calls[-1]["spec"].has_sink
        assert fake_dispatch.calls[-1]["learnable_sink"] is sink
    with pytest.raises(ValueError, match="learnable_sink"):
        call(q, k, v, learnable_sink=torch.zeros(3))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    before = fake_dispatch.selections
    for scale in (1.0, 2.0):
        descale = torch.full((batch, 2), scale)
        call(q8, k8, v8, q_descale=descale, k_descale=descale)
    assert fake_dispatch.selections == before + 1
    d_q, d_k, d_v = fake_dispatch.calls[-1]["descales"]
    assert torch.all(d_q == 2.0) and torch.all(d_k == 2.0) and d_v is None
    with pytest.raises(ValueError, match="q_descale"):
        call(q8, k8, v8, q_descale=torch.ones(batch, 3), k_descale=torch.ones(batch, 2))


@pytest.mark.parametrize("packed_seqs", [False, True])
def test_grad_calls_keep_their_launch(fake_dispatch, packed_seqs):
    """An eager call that records a gradient keeps its (spec, launch) as a plain call does:
    the next one of the same signature makes no new kernel choice, still records the graph,
    and its backward runs the backward kernel from the forward's spec (deterministic as asked),
    its gradients reaching q, k and v."""
    if packed_seqs:
        (q, k, v), args = packed(h=4, hk=2)
        call = lambda *t, **kw: flash_attn_varlen_func(*t, **args, causal=True, **kw)
    else:
        q, k, v = qkv(b=2, sq=5, sk=7, h=4, hk=2)
        call = lambda *t, **kw: flash_attn_func(*t, causal=True, **kw)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    call(*leaves)
    assert fake_dispatch.selections == 1 and len(api._launches) == 1
    out = call(*leaves, deterministic=True)
    assert fake_dispatch.selections == 1 and out.requires_grad and torch.all(out == 1)
    call(q, k, v)  # a plain call of the same signature takes the same launch
    assert fake_dispatch.selections == 1
    out.backward(torch.ones_like(out))
    bwd = fake_dispatch.calls[-1]
    assert bwd["spec"].kind == "bwd" and bwd["spec"].deterministic and bwd["spec"].causal
    assert (bwd["cu_seqlens_q"] is not None) == packed_seqs
    assert bwd["out"] is not None and bwd["lse"].dtype == torch.float32
    for leaf, value in zip(leaves, (3.0, 4.0, 5.0)):
        assert leaf.grad.dtype == leaf.dtype and torch.all(leaf.grad == value)


def test_varlen_repeated_call_skips_checks_and_selection(fake_dispatch):
    (q, k, v), args = packed()
    first = flash_attn_varlen_func(q, k, v, **args, causal=True, return_lse=True)
    cu_q = args["cu_seqlens_q"].clone()  # new index tensors of the same kind: still a hit
    second = flash_attn_varlen_func(q, k, v, **{**args, "cu_seqlens_q": cu_q}, causal=True,
                                    return_lse=True)
    assert fake_dispatch.selections == 1 and len(fake_dispatch.calls) == 2
    call = fake_dispatch.calls[1]
    assert call["spec"] is fake_dispatch.calls[0]["spec"] and call["cu_seqlens_q"] is cu_q
    assert second[0].shape == first[0].shape and second[1].shape == first[1].shape
    assert second[0] is not first[0] and torch.all(second[0] == 1) and torch.all(second[1] == 2)


@pytest.mark.parametrize("change", ["cu_dtype", "cu_length", "seqused", "max_seqlen", "validate",
                                    "max_seqlen_type"])
def test_varlen_shortcut_misses_or_checks_on_any_change(fake_dispatch, change):
    """A changed index tensor, max length or validate takes the full path (its checks run)."""
    (q, k, v), args = packed()
    flash_attn_varlen_func(q, k, v, **args)
    if change == "cu_dtype":
        with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
            flash_attn_varlen_func(q, k, v, **{**args, "cu_seqlens_q": args["cu_seqlens_q"].long()})
        return
    if change == "cu_length":
        with pytest.raises(ValueError, match="cu_seqlens_k"):
            flash_attn_varlen_func(q, k, v, **{**args, "cu_seqlens_k": args["cu_seqlens_k"][:-1]})
        return
    if change == "max_seqlen_type":
        with pytest.raises(TypeError, match="max_seqlen_q"):
            flash_attn_varlen_func(q, k, v, **{**args, "max_seqlen_q": float(args["max_seqlen_q"])})
        return
    if change == "seqused":
        flash_attn_varlen_func(q, k, v, **args, seqused_k=torch.zeros(3, dtype=torch.int32))
    elif change == "max_seqlen":
        flash_attn_varlen_func(q, k, v, **{**args, "max_seqlen_q": 9})
    else:
        flash_attn_varlen_func(q, k, v, **args, validate=True)
    assert fake_dispatch.selections == 2


def test_cpu_never_asks_dispatch(monkeypatch):
    """CPU tensors fall back without importing cuteattn.dispatch (which needs the DSL and a GPU)."""
    import builtins

    real_import = builtins.__import__

    def guarded(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "cuteattn.dispatch" or (name == "cuteattn" and fromlist and "dispatch" in fromlist):
            raise AssertionError("dispatch imported on the CPU path")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", guarded)
    q, k, v = qkv()
    quiet(flash_attn_func, q, k, v)
    with pytest.raises(AssertionError, match="dispatch imported"):  # the guard does work
        api._select_kernel(spec(q, k, v), torch.device("cuda"))


def test_deterministic_accepted(seed):
    q, k, v = qkv()
    a = quiet(flash_attn_func, q, k, v, deterministic=True)
    assert torch.equal(a, quiet(flash_attn_func, q, k, v))


# ---- FlashAttention-4's varlen forms: seqused only (batched q/k), one side packed ----

def per_sequence(q_rows, k_rows, v_rows, **kw):
    """attention_ref of one sequence (rows given as (len, h, d) tensors)."""
    o, l = attention_ref(q_rows[None], k_rows[None], v_rows[None], **kw)
    return o[0], l[0]


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_only_on_batched_tensors(seed, causal):
    b, sq, sk = 3, 7, 9
    q, k, v = (torch.randn(b, s, h, 64, dtype=BF16) for s, h in ((sq, 4), (sk, 2), (sk, 2)))
    used_q = torch.tensor([7, 0, 3], dtype=torch.int32)
    used_k = torch.tensor([9, 4, 1], dtype=torch.int32)
    out, lse = quiet(flash_attn_varlen_func, q, k, v, None, None, sq, sk, seqused_q=used_q,
                     seqused_k=used_k, causal=causal, return_lse=True, validate=True)
    assert out.shape == q.shape and lse.shape == (b, 4, sq)
    for i in range(b):
        nq, nk = int(used_q[i]), int(used_k[i])
        if nq:
            o, l = per_sequence(q[i, :nq], k[i, :nk], v[i, :nk], causal=causal)
            assert torch.allclose(out[i, :nq].float(), o, atol=2e-2) and torch.allclose(lse[i, :, :nq], l, atol=1e-4)
        assert torch.all(out[i, nq:] == 0) and torch.isneginf(lse[i, :, nq:]).all()


@pytest.mark.parametrize("packed_side", ["q", "k"])
def test_varlen_one_side_packed(seed, packed_side):
    lens = [5, 0, 8]
    cu = torch.tensor([0, 5, 5, 13], dtype=torch.int32)
    if packed_side == "q":
        q = torch.randn(13, 4, 64, dtype=BF16)
        k, v = torch.randn(3, 6, 2, 64, dtype=BF16), torch.randn(3, 6, 2, 64, dtype=BF16)
        args = (q, k, v, cu, None, 8, 6)
        rows = lambda i: (q[int(cu[i]):int(cu[i + 1])], k[i], v[i])
    else:
        q = torch.randn(3, 4, 4, 64, dtype=BF16)
        k, v = torch.randn(13, 2, 64, dtype=BF16), torch.randn(13, 2, 64, dtype=BF16)
        args = (q, k, v, None, cu, 4, 8)
        rows = lambda i: (q[i], k[int(cu[i]):int(cu[i + 1])], v[int(cu[i]):int(cu[i + 1])])
    out, lse = quiet(flash_attn_varlen_func, *args, causal=True, return_lse=True)
    assert out.shape == q.shape
    for i in range(3):
        qi, ki, vi = rows(i)
        if qi.shape[0] == 0:
            continue
        o, l = per_sequence(qi, ki, vi, causal=True)
        got_o = out[int(cu[i]):int(cu[i + 1])] if packed_side == "q" else out[i]
        got_l = lse[:, int(cu[i]):int(cu[i + 1])] if packed_side == "q" else lse[i]
        assert torch.allclose(got_o.float(), o, atol=2e-2) and torch.allclose(got_l, l, atol=1e-4)


def test_varlen_batched_form_gradients(seed):
    """Autograd through the seqused-only form: gradients shaped like the batched inputs, equal
    to the per-sequence reference's; rows past seqused get 0."""
    b, s = 2, 6
    q, k, v = (torch.randn(b, s, 2, 64, dtype=BF16, requires_grad=True) for _ in range(3))
    used = torch.tensor([6, 3], dtype=torch.int32)
    out = quiet(flash_attn_varlen_func, q, k, v, None, None, s, s, seqused_q=used, seqused_k=used,
                causal=True)
    g = torch.randn_like(out)
    grads = quiet(torch.autograd.grad, out, (q, k, v), g)
    for i, n in enumerate(used.tolist()):
        leaves = [t[i, :n].detach().float().requires_grad_() for t in (q, k, v)]
        o, _ = attention_ref(*(t[None] for t in leaves), causal=True)
        o.backward(g[i, :n][None].float())
        for got, leaf in zip(grads, leaves):
            assert torch.allclose(got[i, :n].float(), leaf.grad, atol=3e-2)
            assert torch.all(got[i, n:] == 0)


def test_varlen_batched_form_validate():
    q = torch.randn(2, 5, 2, 64, dtype=BF16)
    used = torch.tensor([5, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 6 must lie in \[0, 5\]"):
        flash_attn_varlen_func(q, q, q, None, None, 5, 5, seqused_k=used, validate=True)


# ---- learnable sinks ----

def test_sink_forward_fixed_and_varlen(seed):
    q, k, v = qkv(b=2, sq=5, sk=7, h=4, hk=2)
    sink = torch.randn(4)
    out, lse = quiet(flash_attn_func, q, k, v, causal=True, learnable_sink=sink, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True, learnable_sink=sink)
    assert torch.allclose(out.float(), ref, atol=2e-2) and torch.allclose(lse, ref_lse, atol=1e-5)
    plain = quiet(flash_attn_func, q, k, v, causal=True)
    assert not torch.allclose(out, plain)  # the sink takes probability mass
    (qp, kp, vp), args = packed(h=4, hk=2)
    out, lse = quiet(flash_attn_varlen_func, qp, kp, vp, **args, learnable_sink=sink, return_lse=True)
    ref, ref_lse = attention_varlen_ref(qp, kp, vp, args["cu_seqlens_q"], args["cu_seqlens_k"],
                                        learnable_sink=sink)
    assert torch.allclose(out.float(), ref, atol=2e-2) and torch.allclose(lse, ref_lse, atol=1e-5)


def test_sink_gradient_flows(seed):
    q, k, v = (t.requires_grad_() for t in qkv(b=2, sq=6, sk=6, h=4, hk=2))
    sink = torch.randn(4, requires_grad=True)
    out = quiet(flash_attn_func, q, k, v, causal=True, learnable_sink=sink)
    g = torch.randn_like(out)
    grads = quiet(torch.autograd.grad, out, (q, k, v, sink), g)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)] + [sink.detach().clone().requires_grad_()]
    ref, _ = attention_ref(*leaves[:3], causal=True, learnable_sink=leaves[3])
    ref.backward(g.float())
    for got, leaf in zip(grads, leaves):
        assert got.shape == leaf.shape and torch.allclose(got.float(), leaf.grad, atol=3e-2)
    assert grads[3].dtype == torch.float32 and grads[3].abs().sum() > 0


def test_sink_only_gradient_and_empty_keys(seed):
    """A sink that alone requires grad routes through autograd; with no keys the rows' lse is
    the sink (output 0)."""
    q, k, v = qkv(b=1, sq=3, sk=4, h=2, hk=2)
    sink = torch.zeros(2, requires_grad=True)
    out = quiet(flash_attn_func, q, k, v, learnable_sink=sink)
    (dsink,) = quiet(torch.autograd.grad, out.float().sum(), (sink,))
    assert dsink.shape == (2,) and torch.isfinite(dsink).all()
    q, k, v = qkv(b=1, sq=3, sk=0, h=2, hk=2)
    out, lse = quiet(flash_attn_func, q, k, v, learnable_sink=torch.tensor([0.5, -1.0]),
                     return_lse=True)
    assert torch.all(out == 0) and torch.equal(lse, torch.tensor([0.5, -1.0]).view(1, 2, 1).expand(1, 2, 3))


@pytest.mark.parametrize("sink,exc,match", [
    (torch.zeros(3), ValueError, r"shape \(nheads=4,\)"),
    (torch.zeros(4, dtype=torch.bfloat16), ValueError, "float32"),
    ([0.0] * 4, TypeError, "learnable_sink must be a torch.Tensor"),
])
def test_sink_checks(sink, exc, match):
    q, k, v = qkv(h=4, hk=4)
    with pytest.raises(exc, match=match):
        flash_attn_func(q, k, v, learnable_sink=sink)


# ---- fp8 (e4m3) inputs with FlashAttention-3's descales ----

def quantized(x, scale):
    """x / scale in e4m3 (what a user hands in) and its descale."""
    return (x / scale).to(torch.float8_e4m3fn)


def test_fp8_forward_dequantizes_with_per_head_descales(seed):
    b, s, h, hk = 2, 9, 4, 2
    q, k, v = qkv(b=b, sq=s, sk=s, h=h, hk=hk)
    dq, dk, dv = (torch.rand(b, hk) + 0.5 for _ in range(3))
    heads = torch.arange(h) // (h // hk)
    q8 = quantized(q.float(), dq[:, None, heads, None])
    k8, v8 = quantized(k.float(), dk[:, None, :, None]), quantized(v.float(), dv[:, None, :, None])
    out, lse = quiet(flash_attn_func, q8, k8, v8, causal=True, return_lse=True,
                     q_descale=dq, k_descale=dk, v_descale=dv)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref, ref_lse = attention_ref(q8.float() * dq[:, None, heads, None], k8.float() * dk[:, None, :, None],
                                 v8.float() * dv[:, None, :, None], causal=True)
    assert torch.allclose(out.float(), ref, atol=2e-2) and torch.allclose(lse, ref_lse, atol=1e-4)
    plain = quiet(flash_attn_func, q8, k8, v8, causal=True)  # no descales: 1.0
    ref1, _ = attention_ref(q8.float(), k8.float(), v8.float(), causal=True)
    assert torch.allclose(plain.float(), ref1, atol=2e-2)


def test_fp8_varlen_descales_follow_the_sequences(seed):
    lens, h = [3, 0, 6], 2
    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    q, k, v = (torch.randn(9, h, 64).to(torch.float8_e4m3fn) for _ in range(3))
    dq, dk, dv = (torch.rand(3, h) + 0.5 for _ in range(3))
    out = quiet(flash_attn_varlen_func, q, k, v, cu, cu, 6, 6, q_descale=dq, k_descale=dk,
                v_descale=dv, out=torch.empty(9, h, 64, dtype=torch.float16))
    assert out.dtype == torch.float16
    for i, (start, n) in enumerate(((0, 3), (3, 0), (3, 6))):
        if n == 0:
            continue
        rows = slice(start, start + n)
        ref, _ = attention_ref(*((x[rows].float() * d[i][None, :, None])[None]
                                 for x, d in ((q, dq), (k, dk), (v, dv))))
        assert torch.allclose(out[rows].float(), ref[0], atol=2e-2)


def test_fp8_refuses_gradients():
    q = torch.randn(1, 4, 2, 64).to(torch.float8_e4m3fn).requires_grad_()
    with pytest.raises(NotImplementedError, match="no gradients"):
        flash_attn_func(q, q.detach(), q.detach())


def test_fp8_with_mods_or_lists_applies_its_descales():
    """fp8 inputs with a mask_mod or block-sparse lists run on the reference (no fp8 kernel
    takes them), dequantized with their descales, output bf16: the same values as the plain
    fp8 call with the equivalent mask (the descales were dropped before)."""
    from cuteattn import sparse
    warnings.simplefilter("ignore", FallbackWarning)
    q, k, v = (x.to(torch.float8_e4m3fn) for x in qkv(b=2, sq=9, sk=9, h=4, hk=2))
    descales = {n: torch.rand(2, 2) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
    causal = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx
    want = flash_attn_func(q, k, v, causal=True, **descales)
    got = flash_attn_func(q, k, v, mask_mod=causal, **descales)
    assert got.dtype == BF16 and torch.equal(got, want)
    everything = sparse.from_block_mask(torch.ones(1, 1, 1, 1, dtype=torch.bool), 128, 128)
    assert torch.equal(flash_attn_func(q, k, v, block_sparse=everything, **descales),
                       flash_attn_func(q, k, v, **descales))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    qp, kp, vp = (x[0] for x in (q, k, v))
    want = flash_attn_varlen_func(qp, kp, vp, cu, cu, 5, 5, causal=True, **descales)
    got = flash_attn_varlen_func(qp, kp, vp, cu, cu, 5, 5, mask_mod=causal, **descales)
    assert got.dtype == BF16 and torch.equal(got, want)
    with pytest.raises(ValueError, match="q_descale applies to float8_e4m3fn inputs only"):
        flash_attn_func(*qkv(), mask_mod=causal, q_descale=descales["q_descale"])


def test_packed_call_with_mods_writes_the_callers_buffers():
    """flash_attn_varlen_func with a mask_mod (or lists) and out= / lse=: written in place and
    returned, as without mods (they were ignored before); wrong shapes are errors."""
    warnings.simplefilter("ignore", FallbackWarning)
    q = torch.randn(10, 2, 64, dtype=BF16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    causal = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx
    out, lse = torch.full_like(q, float("nan")), torch.full((2, 10), float("nan"))
    got = flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, mask_mod=causal, out=out, lse=lse,
                                 return_lse=True)
    assert got[0] is out and got[1] is lse
    want = flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, causal=True, return_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    with pytest.raises(ValueError, match="out must be"):
        flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, mask_mod=causal, out=torch.empty(3))
