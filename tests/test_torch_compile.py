"""cuteattn under torch.compile and autograd, on the CPU (the calls run on the reference path;
the custom ops, fake shapes and autograd formulas are the same ones a GPU call uses).

A small transformer block is compiled with fullgraph=True (a graph break raises), run forward
and backward, and compared with eager; with dynamic shapes a new sequence length recompiles
nothing.
"""
import warnings

import pytest
import torch

from cuteattn import FallbackWarning, flash_attn_func, flash_attn_varlen_func


class Block(torch.nn.Module):
    """Pre-norm attention block with GQA and a causal mask, the shape of a Llama layer."""

    def __init__(self, dim=256, heads=4, kv_heads=2, deterministic=False):
        super().__init__()
        self.deterministic = deterministic
        self.heads, self.kv_heads, self.d = heads, kv_heads, dim // heads
        self.norm = torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, heads * self.d, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.d, bias=False)
        self.o = torch.nn.Linear(heads * self.d, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, s, self.heads, self.d)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.d).unbind(2)
        a = flash_attn_func(q, k, v, causal=True, softmax_scale=self.d ** -0.5,
                            deterministic=self.deterministic)
        return x + self.o(a.reshape(b, s, -1))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        yield
    torch._dynamo.reset()


def counting_backend():
    """aot_eager (dynamo + AOTAutograd tracing, forward and backward graphs, no codegen) that
    counts how many graphs were compiled."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    counts = {"fw": 0}

    def compiler(gm, example_inputs):
        counts["fw"] += 1
        return make_boxed_func(gm.forward)
    return aot_autograd(fw_compiler=compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward)), counts


def test_block_compiles_fullgraph_forward_and_backward():
    torch.manual_seed(0)
    block = Block().to(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 37, 256, dtype=torch.bfloat16, requires_grad=True)
    y_eager = block(x)
    y_eager.square().mean().backward()
    grads_eager = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    y = compiled(x)
    assert torch.equal(y, y_eager)  # the same ops on the same inputs: bitwise
    y.square().mean().backward()
    for got, want in zip([p.grad for p in block.parameters()] + [x.grad], grads_eager):
        assert torch.equal(got, want)


def test_new_sequence_lengths_do_not_recompile():
    torch.manual_seed(0)
    block = Block().to(torch.bfloat16)
    backend, counts = counting_backend()
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=backend)
    with torch.no_grad():
        for s in (17, 40, 113, 64):
            x = torch.randn(3, s, 256, dtype=torch.bfloat16)
            assert torch.equal(compiled(x), block(x))
    assert counts["fw"] == 1, f"{counts['fw']} graphs compiled for 4 sequence lengths"


def test_varlen_under_compile():
    torch.manual_seed(0)
    q = torch.randn(20, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(20, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(20, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32)

    def f(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, 13, 13, causal=True, softcap=4.0)

    eager = f(q, k, v)
    eager.sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(got, eager)
    got.sum().backward()
    for t, w in zip((q, k, v), want):
        assert torch.equal(t.grad, w)


def test_bad_arguments_raise_at_the_call_under_compile():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    f = torch.compile(lambda q: flash_attn_func(q, q, q, window_size=(-3, 1)), backend="aot_eager")
    with pytest.raises(Exception, match=r"left \+ right must be >= 0"):
        f(q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_block_compiles_on_the_gpu_kernel():
    """On the GPU the compiled graph calls the kernels (no reference fallback, forward or
    backward), equal to eager bitwise (the backward in deterministic mode)."""
    torch.manual_seed(0)
    block = Block(dim=512, heads=4, kv_heads=2, deterministic=True).to("cuda", torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        for s in (300, 1023):
            x = torch.randn(2, s, 512, device="cuda", dtype=torch.bfloat16)
            with warnings.catch_warnings():
                warnings.simplefilter("error", FallbackWarning)  # the forward must be the kernel's
                assert torch.equal(compiled(x), block(x))
    x = torch.randn(2, 129, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # the backward must be the kernel's too
        block(x).float().square().mean().backward()
        want = x.grad.clone()
        x.grad = None
        compiled(x).float().square().mean().backward()
    assert torch.equal(x.grad, want)


def test_negative_window_edges_compile():
    """A window side of None (FlashAttention-4's unbounded) travels through the custom op's
    optional ints: compiled equals eager."""
    torch.manual_seed(0)
    q = torch.randn(1, 9, 2, 64, dtype=torch.bfloat16)
    f = lambda q: flash_attn_func(q, q, q, window_size=(None, -2))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q), f(q))
    assert torch.all(f(q)[:, :2] == 0)  # the first two rows have no key two places back


def test_return_attn_probs_compiles():
    """FlashAttention-2's (out, lse, None) triple traces without a graph break."""
    torch.manual_seed(0)
    q = torch.randn(1, 9, 2, 64, dtype=torch.bfloat16)
    f = lambda q: flash_attn_func(q, q, q, causal=True, return_attn_probs=True)
    got, want = torch.compile(f, fullgraph=True, backend="aot_eager")(q), f(q)
    assert got[2] is None and want[2] is None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_learnable_sink_compiles_with_its_gradient():
    torch.manual_seed(0)
    q = torch.randn(1, 9, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    sink = torch.randn(2, requires_grad=True)
    f = lambda q, sink: flash_attn_func(q, q, q, causal=True, learnable_sink=sink)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, sink), f(q, sink)
    assert torch.equal(got, want)
    g_got = torch.autograd.grad(got.float().sum(), (q, sink))
    g_want = torch.autograd.grad(want.float().sum(), (q, sink))
    assert all(torch.equal(a, b) for a, b in zip(g_got, g_want))


def test_fp8_inference_compiles():
    """fp8 inputs with their descales under torch.compile (inference): equal to eager, bf16 out."""
    torch.manual_seed(0)
    q = torch.randn(2, 9, 2, 64).to(torch.float8_e4m3fn)
    d = torch.rand(2, 2) + 0.5
    f = lambda q, d: flash_attn_func(q, q, q, causal=True, q_descale=d, k_descale=d, v_descale=d)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(q, d)
    assert got.dtype == torch.bfloat16 and torch.equal(got, f(q, d))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_cache_compiles(cache_dtype):
    """flash_attn_with_kvcache over an fp8 cache with descales, appending new tokens, under
    torch.compile(fullgraph=True): the same output and the same caches as eager."""
    from cuteattn import flash_attn_with_kvcache
    torch.manual_seed(0)
    q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16)
    kc = (torch.randn(2, 16, 2, 64) * 3).to(cache_dtype)
    vc = (torch.randn(2, 16, 2, 64) * 3).to(cache_dtype)
    k, v = torch.randn(2, 1, 2, 64, dtype=torch.bfloat16), torch.randn(2, 1, 2, 64, dtype=torch.bfloat16)
    kd, vd = torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5
    lens = torch.tensor([3, 9], dtype=torch.int32)
    f = lambda q, kc, vc, k, v, lens, kd, vd: flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=lens, k_descale=kd, v_descale=vd, causal=True)
    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, *caches[0], k, v, lens, kd, vd)
    want = f(q, *caches[1], k, v, lens, kd, vd)
    assert torch.equal(got, want)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(caches[0], caches[1]))


def test_modifiers_and_block_lists_compile_fullgraph():
    """FlexAttention's modifiers (computed on the reference, differentiated by autograd) trace
    with fullgraph=True: equal to eager, gradients too (a score_mod's own tensor included)."""
    from cuteattn import sparse
    torch.manual_seed(0)
    q = torch.randn(1, 40, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    blocks = sparse.from_block_mask(torch.tensor([[[[True, False], [True, True]]]]), 32, 32,
                                    partial=torch.ones(1, 1, 2, 2, dtype=torch.bool))

    def f(q, slopes):
        return flash_attn_func(q, q, q, block_sparse=blocks, mask_mod=lambda b, h, i, j: i >= j,
                               score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j).abs())

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, slopes), f(q, slopes)
    assert torch.equal(got, want)
    g_got = torch.autograd.grad(got.float().sum(), (q, slopes))
    g_want = torch.autograd.grad(want.float().sum(), (q, slopes))
    assert all(torch.allclose(a, b, atol=1e-3) for a, b in zip(g_got, g_want))


def graph_recording_backend():
    """aot_eager that keeps the targets of every op call in the forward and backward graphs."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    seen = {"fw": set(), "bw": set()}

    def recorder(kind):
        def compiler(gm, example_inputs):
            seen[kind] |= {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            return make_boxed_func(gm.forward)
        return compiler
    return aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw")), seen


@pytest.mark.parametrize("causal", [False, True])
def test_block_lists_compile_into_one_op_with_its_backward(causal):
    """Block-sparse lists alone (no mods) under torch.compile(fullgraph=True): the call is one
    opaque op (cuteattn::fwd_sparse, its backward cuteattn::bwd_sparse), not the reference
    traced into the graph, so the kernels can run inside compiled models; on the CPU the op
    runs the reference: the same output as eager, gradients by the written-out backward
    within float32 rounding of autograd's. GQA, odd lengths, rows with no listed block."""
    from cuteattn import sparse
    torch.manual_seed(0)
    b, s, h, hk, d = 2, 77, 4, 2, 64
    q = torch.randn(b, s, h, d, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, s, hk, d, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, s, hk, d, dtype=torch.bfloat16, requires_grad=True)
    chosen = torch.rand(b, h, 3, 3) < 0.6
    chosen[0, 0, 1] = False  # a query block with nothing listed: out 0, lse -inf, gradient 0
    blocks = sparse.from_block_mask(chosen, 32, 32, partial=torch.rand(b, h, 3, 3) < 0.3)

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=causal, block_sparse=blocks, return_lse=True)

    backend, seen = graph_recording_backend()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    (got, got_lse), (want, want_lse) = compiled(q, k, v), f(q, k, v)
    assert "cuteattn.fwd_sparse.default" in seen["fw"]
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    assert torch.isneginf(got_lse[0, 0, 32:64]).all() and (got[0, 32:64, 0] == 0).all()
    dout = torch.randn_like(got)
    g_got = torch.autograd.grad(got, (q, k, v), dout)
    assert "cuteattn.bwd_sparse.default" in seen["bw"]
    g_want = torch.autograd.grad(want, (q, k, v), dout)
    for a, w in zip(g_got, g_want):
        assert a.dtype == w.dtype and a.shape == w.shape
        assert (a.float() - w.float()).abs().max() <= 1e-2 * w.float().abs().max() + 1e-3
    assert (g_got[0][0, 32:64, 0] == 0).all()


def test_block_lists_rules_raise_at_the_call_under_compile():
    """The lists' shape rules are checked before the op, so a bad mask raises at the call in
    compiled code as in eager."""
    from cuteattn import sparse
    q = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16)
    blocks = sparse.from_block_mask(torch.ones(1, 2, 1, 1, dtype=torch.bool), 32, 32)  # 1x1: too few
    f = torch.compile(lambda q: flash_attn_func(q, q, q, block_sparse=blocks), backend="aot_eager")
    with pytest.raises(Exception, match="block_sparse.full_count must have shape"):
        f(q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_block_lists_compile_on_the_gpu_kernels():
    """On the GPU the compiled call runs the block-sparse kernels, forward and backward (no
    fallback), equal to eager bitwise (the backward in deterministic mode); lists of 256x256
    logical blocks (expanded inside the op) too."""
    from cuteattn import sparse
    torch.manual_seed(0)
    b, s, h, hk, d = 2, 1000, 4, 2, 128
    make = lambda heads: torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16,
                                     requires_grad=True)
    q, k, v = make(h), make(hk), make(hk)
    for block in (128, 256):
        n = -(-s // block)
        blocks = sparse.from_block_mask(torch.rand(b, h, n, n, device="cuda") < 0.5, block, block)
        f = lambda q, k, v: flash_attn_func(q, k, v, causal=True, block_sparse=blocks,
                                            deterministic=True)
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            got, want = compiled(q, k, v), f(q, k, v)
            assert torch.equal(got, want)
            dout = torch.randn_like(got)
            g_got = torch.autograd.grad(got, (q, k, v), dout)
            g_want = torch.autograd.grad(want, (q, k, v), dout)
        assert all(torch.equal(a, w) for a, w in zip(g_got, g_want))
