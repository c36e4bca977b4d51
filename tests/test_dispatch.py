"""The kernel registry on the CPU: which family serves a spec on a (pretended) device, the reasons
given when none does (quoted by the API's fallback warning and strict error), and lookups of
unknown (arch, kind) pairs answering with a reason rather than an exception."""
import pytest
import torch

from cuteattn import api, dispatch
from cuteattn.spec import AttentionSpec

CUDA = torch.device("cuda", 0)


def make_spec(**kw):
    fields = dict(dtype=torch.bfloat16, head_dim=128, head_dim_v=128, causal=False, local=False,
                  has_softcap=False, varlen_q=False, varlen_k=False, batch=2, seqlen_q=64,
                  seqlen_k=64, nheads=4, nheads_k=4, softmax_scale=0.1, device_index=0)
    return AttentionSpec(**{**fields, **kw})


@pytest.fixture
def gpu(monkeypatch):
    """Pretends to have a CUDA device; set `gpu.capability` to pick its architecture."""
    class Device:
        capability = (9, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: Device.capability)
    return Device


@pytest.fixture
def registry(monkeypatch):
    """A registry of its own, so that registering test families leaves the real one alone."""
    monkeypatch.setattr(dispatch, "_families", dict(dispatch._families))
    monkeypatch.setattr(dispatch, "_import_errors", {})
    return dispatch


class FakeFamily:
    def __init__(self, reason=None):
        self.reason, self.launched = reason, []

    def can_implement(self, spec):
        return self.reason

    def launch(self, spec):
        self.launched.append(spec)
        return lambda *args, **kw: None


def test_spec_kind_defaults_to_forward_and_is_in_the_key():
    spec = make_spec()
    assert spec.kind == "fwd"
    assert make_spec(kind="bwd").compile_key() != spec.compile_key()
    with pytest.raises(ValueError, match="kind"):
        make_spec(kind="sideways")


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (6, 1)])
def test_other_architectures_give_a_reason(gpu, capability, monkeypatch):
    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    gpu.capability = capability
    reason = dispatch.can_implement(make_spec(), CUDA)
    assert reason.startswith(f"no kernel for sm_{capability[0]}{capability[1]} (")
    assert "sm80" in reason and "sm90" in reason


@pytest.mark.parametrize("capability,arch", [((8, 0), "sm80"), ((8, 6), "sm80"), ((8, 9), "sm80"),
                                             ((12, 0), "sm80"), ((12, 1), "sm80"), ((9, 0), "sm90"),
                                             # Blackwell B200/B300 and Thor: the mma.sync path
                                             ((10, 0), "sm80"), ((10, 3), "sm80"), ((11, 0), "sm80")])
def test_each_architecture_has_its_path(gpu, capability, arch, monkeypatch):
    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    assert dispatch.arch_name(*capability) == (arch, None)


def test_the_path_can_be_chosen(monkeypatch):
    """CUTEATTN_PATH=sm80 takes any sm_80-or-later device to the mma.sync path (how it is tested
    on Hopper); a wrong name or an older device is a reason, not a crash."""
    monkeypatch.setenv(dispatch.PATH_ENV, "sm80")
    assert dispatch.arch_name(9, 0) == ("sm80", None)
    assert dispatch.arch_name(10, 0) == ("sm80", None)
    arch, reason = dispatch.arch_name(7, 5)
    assert arch is None and "needs sm_80 or later" in reason
    monkeypatch.setenv(dispatch.PATH_ENV, "sm70")
    arch, reason = dispatch.arch_name(9, 0)
    assert arch is None and "names no kernel path" in reason and "sm80" in reason


def test_target_names_parse_to_capabilities():
    assert [dispatch.target_capability(t) for t in ("sm_80", "sm_86", "sm_90a", "sm_100a", "sm_120a")] == [
        (8, 0), (8, 6), (9, 0), (10, 0), (12, 0)]
    for bad in ("sm90", "hopper", "sm_9", "sm_90ab"):
        with pytest.raises(ValueError, match="expected an arch like"):
            dispatch.target_capability(bad)


def test_non_cuda_devices_give_a_reason():
    assert "cpu" in dispatch.can_implement(make_spec(), torch.device("cpu"))


def test_unknown_arch_or_kind_is_a_reason_not_an_exception(registry):
    family, reason = dispatch.lookup("sm75", "fwd")
    assert family is None and reason == "no fwd kernel for sm75"
    family, reason = dispatch.lookup("sm90", "nonsense")
    assert family is None and "nonsense" in reason and "sm90" in reason


def test_kind_without_a_family_gives_a_reason(gpu, registry):
    pytest.importorskip("cutlass")
    assert dispatch.can_implement(make_spec(kind="combine"), CUDA) == "no combine kernel for sm90"


def test_sm90_decodes_with_the_portable_decode_kernel(gpu, registry):
    """Hopper's decode family is the mma.sync decode kernel, registered under sm90."""
    pytest.importorskip("cutlass")
    from cuteattn.kernels.sm80.launch import Sm80Decode
    family, reason = dispatch.lookup("sm90", "decode")
    assert reason is None and isinstance(family, Sm80Decode) and family.arch == "sm90"


def test_sm90_serves_the_backward(gpu, registry):
    pytest.importorskip("cutlass")
    assert dispatch.can_implement(make_spec(kind="bwd"), CUDA) is None
    for fields, reason in ((dict(head_dim=96, head_dim_v=128), "head_dim_v 128"),
                           (dict(head_dim=256, head_dim_v=256, sparse_q_block=128,
                                 sparse_kv_block=128), "lists or mods at head_dim 256")):
        assert reason in dispatch.can_implement(make_spec(kind="bwd", **fields), CUDA)
    for fields in (dict(local=True, window_left=None, window_right=-2),
                   dict(head_dim=192, head_dim_v=192), dict(head_dim=256, head_dim_v=256),
                   dict(head_dim=136, head_dim_v=136), dict(head_dim=192, head_dim_v=128),
                   dict(head_dim=128, head_dim_v=64), dict(head_dim=128, head_dim_v=96),
                   dict(head_dim=80, head_dim_v=40),
                   dict(has_seqused_q=True, has_seqused_k=True), dict(varlen_q=True),
                   dict(varlen_k=True, has_seqused_k=True)):
        assert dispatch.can_implement(make_spec(kind="bwd", **fields), CUDA) is None


def test_sm90_backward_pads_head_dims_between_widths(gpu, registry):
    """A head dim up to 96 runs at its width rounded up to 16 columns, a wider one between the
    compiled widths on the next width's kernel (the same compiled kernel as that width: TMA
    zero-fills the columns past the tensors' head dim), with gradient buffers of that width
    that the postprocess cuts back."""
    pytest.importorskip("cutlass")
    from cuteattn.kernels.sm90 import launch_bwd
    for d, width in ((8, 16), (40, 48), (72, 80), (80, 80), (88, 96), (112, 128), (120, 128),
                     (136, 192)):
        spec = make_spec(kind="bwd", head_dim=d, head_dim_v=d)
        assert dispatch.can_implement(spec, CUDA) is None
        cfg = launch_bwd.bwd_config(spec)
        assert cfg == launch_bwd.bwd_config(make_spec(kind="bwd", head_dim=width, head_dim_v=width))


def test_backward_buffers_at_the_kernel_width_and_cut_back():
    """BackwardLaunch's dQ accumulator and bwd_buffers' dK/dV have the kernel's width;
    dq_from_accumulator and bwd_postprocess return contiguous gradients at the tensors' head
    dim (GQA sums taken first)."""
    from cuteattn.kernels.launch_common import BackwardLaunch, bwd_buffers, bwd_postprocess
    q = torch.randn(2, 5, 4, 80)
    k = torch.randn(2, 7, 2, 80)
    spec = make_spec(kind="bwd", head_dim=80, head_dim_v=80, nheads=4, nheads_k=2)
    launch = BackwardLaunch.__new__(BackwardLaunch)  # (its dQ methods need no kernel)
    dq_acc, dq_arg = launch.dq_accumulator(q, 96)
    dk, dv = bwd_buffers(spec, q, k, 96)
    assert dq_acc.shape == dq_arg.shape == (2, 5, 4, 96) and dk.shape == dv.shape == (2, 7, 4, 96)
    dq_acc.copy_(torch.randn_like(dq_acc))
    dk.copy_(torch.randn_like(dk))
    dv.copy_(torch.randn_like(dv))
    dq = launch.dq_from_accumulator(dq_acc, q)
    assert dq.dtype == q.dtype and dq.is_contiguous() and torch.equal(dq, dq_acc[..., :80])
    dq, dk2, dv2 = bwd_postprocess(dq, dk, dv, q, k, k, ratio=2)
    assert dq.shape == q.shape and dk2.shape == dv2.shape == k.shape
    assert all(t.is_contiguous() for t in (dq, dk2, dv2))
    assert torch.equal(dk2, dk.view(2, 7, 2, 2, 96).sum(-2)[..., :80])
    assert torch.equal(dv2, dv.view(2, 7, 2, 2, 96).sum(-2)[..., :80])
    # v narrower than q (head_dim_v 48): dV cut to v's head dim, dK to q's
    v = torch.randn(2, 7, 2, 48)
    dq, dk2, dv2 = bwd_postprocess(dq, dk, dv, q, k, v, ratio=2)
    assert dk2.shape == k.shape and dv2.shape == v.shape and dv2.is_contiguous()
    assert torch.equal(dv2, dv.view(2, 7, 2, 2, 96).sum(-2)[..., :48])


def test_registered_family_serves_its_kind(gpu, registry):
    fake = FakeFamily()
    dispatch.register(arch="sm90", kind="decode", family=fake)
    spec = make_spec(kind="decode")
    assert dispatch.can_implement(spec, CUDA) is None
    assert callable(dispatch.launch(spec, CUDA)) and fake.launched == [spec]
    dispatch.register(arch="sm90", kind="decode", family=FakeFamily("no decode today"))
    assert dispatch.can_implement(spec, CUDA) == "no decode today"


def test_family_that_cannot_be_imported_gives_a_reason(gpu, registry, monkeypatch):
    monkeypatch.setattr(dispatch, "_families", {})
    monkeypatch.setattr(dispatch, "FAMILY_MODULES", {"sm90": "cuteattn.kernels.no_such_arch"})
    reason = dispatch.can_implement(make_spec(), CUDA)
    assert reason.startswith("the sm90 kernels could not be imported (ModuleNotFoundError")
    with pytest.raises(RuntimeError, match="could not be imported"):
        dispatch.launch(make_spec(), CUDA)


# ---- the sm90 forward's reasons ----

SM90_REASONS = [
    (dict(head_dim=264, head_dim_v=264), "head_dim 264 is wider than the sm90 forward's widest (256)"),
    (dict(head_dim=64, head_dim_v=128),
     "head_dim_v 128 > head_dim 64 is not supported by the sm90 forward (head_dim_v <= head_dim)"),
    (dict(dtype=torch.float32), "dtype torch.float32 is not supported by the sm90 forward"),
    (dict(has_sink=True, dtype=torch.float8_e4m3fn), "learnable attention sinks: no sm90 forward takes them yet"),
    (dict(dtype=torch.float8_e4m3fn, head_dim=80, head_dim_v=80), "fp8 at head_dim 80"),
]


@pytest.mark.parametrize("fields,reason", SM90_REASONS, ids=[r[:24] for _, r in SM90_REASONS])
def test_sm90_forward_reasons(gpu, fields, reason):
    pytest.importorskip("cutlass")
    assert dispatch.can_implement(make_spec(**fields), CUDA).startswith(reason)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_sm90_forward_serves_supported_problems(gpu, d):
    pytest.importorskip("cutlass")
    for fields in (dict(), dict(causal=True), dict(varlen_q=True, varlen_k=True, has_seqused_k=True),
                   dict(local=True, window_left=8, window_right=0, dtype=torch.float16),
                   # FlashAttention-4's forms: one side packed, seqused on batched q/k, negative edges
                   dict(varlen_q=True), dict(varlen_k=True, has_seqused_q=True),
                   dict(has_seqused_q=True, has_seqused_k=True),
                   dict(local=True, window_left=None, window_right=-1),
                   dict(local=True, window_left=-4, window_right=9),
                   dict(has_sink=True), dict(has_sink=True, varlen_q=True, varlen_k=True)):
        assert dispatch.can_implement(make_spec(head_dim=d, head_dim_v=d, **fields), CUDA) is None


@pytest.mark.parametrize("d,dv", [(88, 88), (8, 8), (200, 200), (192, 128), (128, 64), (72, 40),
                                  (256, 8), (80, 80), (112, 112), (160, 144)])
def test_sm90_forward_pads_other_head_dims(gpu, d, dv):
    """Any head dim up to 256 (a multiple of 8) and any head_dim_v up to it run at their width
    rounded up to 16 columns, on the tiles of the next tile anchor (64, 80, 96, 128, 192, 256);
    the O store leaves out the padded columns exactly when v's is padded."""
    pytest.importorskip("cutlass")
    from cuteattn.kernels.sm90 import config
    from cuteattn.kernels.sm90 import launch as sm90_launch
    spec = make_spec(head_dim=d, head_dim_v=dv)
    assert dispatch.can_implement(spec, CUDA) is None
    cfg = sm90_launch.sm90_config(spec)
    assert (cfg.head_dim, cfg.head_dim_v) == (-(-d // 16) * 16, -(-dv // 16) * 16)
    assert cfg.clip_o == (dv % 16 != 0)
    assert config.tile_anchor(cfg.head_dim) == min(w for w in (64, 80, 96, 128, 192, 256) if w >= d)
    assert cfg.smem_bytes() <= 227 * 1024


def test_api_quotes_the_reason(gpu):
    """The API falls back (or raises in strict mode) with the family's reason."""
    pytest.importorskip("cutlass")
    launch, reason = api._select_kernel(make_spec(head_dim=64, head_dim_v=128), CUDA)
    assert launch is None and reason.startswith("head_dim_v 128 > head_dim 64 is not supported")
    with pytest.raises(RuntimeError, match="head_dim_v 128 > head_dim 64 is not supported"):
        api._fall_back(reason, strict=True)


def test_kernel_modules_do_not_import_torch():
    """Kernels take cute tensors: only the launch modules (the host side: each arch's launch.py
    and launch_bwd.py, and kernels/launch_common.py) import torch."""
    import ast
    from pathlib import Path
    import cuteattn
    kernels = Path(cuteattn.__file__).parent / "kernels"
    for path in kernels.rglob("*.py"):
        if path.name.startswith("launch"):
            continue
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in imported if m.split(".")[0] == "torch"}, path
