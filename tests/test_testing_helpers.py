"""The FA-rule helpers accept a correct low-precision result and reject subtly wrong ones."""
import pytest
import torch

from cuteattn.reference import attention_ref
from cuteattn.testing import assert_close_fa, assert_lse_close


@pytest.fixture
def problem(seed):
    q, k, v = (torch.randn(2, 40, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    kw = dict(causal=True)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    lowprec, _ = attention_ref(q, k, v, **kw, upcast=False)
    return q, k, v, kw, ref, ref_lse, lowprec


def test_correctly_rounded_result_passes(problem):
    *_, ref, ref_lse, lowprec = problem
    assert_close_fa(ref.bfloat16(), ref, lowprec)
    assert_lse_close(ref_lse.clone(), ref_lse)


def test_nan_fails(problem):
    *_, ref, ref_lse, lowprec = problem
    out = ref.bfloat16()
    out[1, 3, 2, 5] = float("nan")
    with pytest.raises(AssertionError, match="nan"):
        assert_close_fa(out, ref, lowprec)
    lse = ref_lse.clone()
    lse[0, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize(
    "wrong", [dict(causal=False), dict(window_size=(38, 0)), dict(softmax_scale=0.13), dict(causal=True, softcap=3.0)]
)
def test_subtly_wrong_semantics_fail(problem, wrong):
    q, k, v, _, ref, ref_lse, lowprec = problem
    out, lse = attention_ref(q, k, v, **wrong)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_fa(out.bfloat16(), ref, lowprec)


def test_lse_minus_inf_pattern_must_match():
    ref = torch.tensor([[0.5, float("-inf")]])
    with pytest.raises(AssertionError, match="-inf pattern"):
        assert_lse_close(torch.tensor([[0.5, 0.0]]), ref)
    with pytest.raises(AssertionError, match="max error"):
        assert_lse_close(torch.tensor([[0.51, float("-inf")]]), ref)
    assert_lse_close(torch.tensor([[0.5005, float("-inf")]]), ref)


def test_config_overrides_set_a_candidate_and_reject_unknown_names(monkeypatch):
    """The GPU runs' candidate switches (config_overrides.py) reach the config module, typed as
    the constant is, and a misspelt name fails instead of running the default silently."""
    import config_overrides
    from cuteattn.kernels.sm80 import config as sm80_config
    # (a boolean switch as a candidate adds one; the config has none between candidates)
    monkeypatch.setattr(sm80_config, "CANDIDATE_SWITCH", False, raising=False)
    monkeypatch.setattr(sm80_config, "FOLD_MAX_STEPS", 16)
    monkeypatch.setenv("CUTEATTN_TEST_SM80_CONFIG", "CANDIDATE_SWITCH=True,FOLD_MAX_STEPS=3")
    monkeypatch.delenv("CUTEATTN_TEST_SM90_CONFIG", raising=False)
    done = config_overrides.apply()
    assert sm80_config.CANDIDATE_SWITCH is True and sm80_config.FOLD_MAX_STEPS == 3
    assert [name for _, name, _ in done] == ["CANDIDATE_SWITCH", "FOLD_MAX_STEPS"]
    monkeypatch.setenv("CUTEATTN_TEST_SM80_CONFIG", "FOLD_MAX_STEP=3")
    with pytest.raises(AttributeError, match="FOLD_MAX_STEP"):
        config_overrides.apply()
