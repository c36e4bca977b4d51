"""attn_implementation="cuteattn" in Hugging Face transformers, on the CPU (the reference path)
with tiny randomly initialised models (no download): Llama, Qwen2 and Mistral (sliding window)
configurations, GQA, padded batches and padding-free packed batches, against the same model on
transformers' own SDPA attention. The rule is FlashAttention's: the logits' error against the
model in float32 (eager attention) at most twice that of the bf16 SDPA model, plus a floor."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
import cuteattn  # noqa: E402
import cuteattn.integrations.transformers  # noqa: E402,F401  (registers "cuteattn")

FLOOR = 2e-3  # logits of order 1: float32 reductions in a different order


def tiny(kind: str):
    common = dict(vocab_size=97, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.MistralConfig(**common, sliding_window=7)


def models(kind: str):
    """(float32 eager, bf16 sdpa, bf16 cuteattn) with the same weights."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(tiny(kind), attn_implementation="eager")
    ref.eval()
    out = [ref]
    for impl in ("sdpa", "cuteattn"):
        m = transformers.AutoModelForCausalLM.from_config(tiny(kind), attn_implementation=impl)
        m.load_state_dict(ref.state_dict())
        out.append(m.to(torch.bfloat16).eval())
    return out


def logits(model, **inputs):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", cuteattn.FallbackWarning)
        return model(**inputs).logits.float()


@pytest.fixture
def calls(monkeypatch):
    """How often the integration called each cuteattn entry point (so a test cannot pass on
    transformers' own attention)."""
    import cuteattn.integrations.transformers as integ
    seen = {"flash_attn_func": 0, "flash_attn_varlen_func": 0}
    for name in seen:
        fn = getattr(integ, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            seen[_name] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(integ, name, counted)
    return seen


def check(ours, sdpa, ref, rows=None):
    if rows is not None:
        ours, sdpa, ref = ours[rows], sdpa[rows], ref[rows]
    err, base = (ours - ref).abs().max().item(), (sdpa - ref).abs().max().item()
    assert err <= 2 * base + FLOOR, (err, base)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_batch_without_padding(kind, calls):
    ref, sdpa, ours = models(kind)
    ids = torch.randint(0, 97, (2, 19))
    check(logits(ours, input_ids=ids), logits(sdpa, input_ids=ids), logits(ref, input_ids=ids))
    assert calls == {"flash_attn_func": 2, "flash_attn_varlen_func": 0}  # one call per layer


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_padded_batch(kind, calls):
    """Left padding (generation's) and right padding: the real tokens' logits."""
    ref, sdpa, ours = models(kind)
    ids = torch.randint(0, 97, (3, 16))
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[0, :5] = 0   # left padded
    mask[2, 11:] = 0  # right padded
    got, base, want = (logits(m, input_ids=ids, attention_mask=mask) for m in (ours, sdpa, ref))
    check(got, base, want, rows=mask.bool())
    assert calls == {"flash_attn_func": 0, "flash_attn_varlen_func": 2}


def test_padding_free_packed_batch_matches_separate_sequences(calls):
    """Two sequences concatenated in one row (position ids restart): each sequence's logits equal
    those of the sequence run alone, and the collator's cu_seq_lens route the same way."""
    ref, sdpa, ours = models("llama")
    a, b = torch.randint(0, 97, (1, 9)), torch.randint(0, 97, (1, 14))
    ids = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(9), torch.arange(14)])[None]
    alone = [torch.cat([logits(m, input_ids=a), logits(m, input_ids=b)], dim=1) for m in (sdpa, ref)]
    check(logits(ours, input_ids=ids, position_ids=pos), *alone)
    assert calls["flash_attn_varlen_func"] == 2
    cu = torch.tensor([0, 9, 23], dtype=torch.int32)
    got = logits(ours, input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                 max_length_q=14, max_length_k=14)
    check(got, *alone)
    assert calls == {"flash_attn_func": 0, "flash_attn_varlen_func": 4}


def test_training_step_gradients_flow():
    _, _, ours = models("qwen2")
    ours.train()
    ids = torch.randint(0, 97, (2, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cuteattn.FallbackWarning)
        loss = ours(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = [p.grad for p in ours.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)
    q_proj = ours.model.layers[0].self_attn.q_proj.weight.grad
    assert q_proj.abs().sum() > 0  # reached through the attention's backward


def test_generate_with_cache_matches_sdpa():
    """Greedy decoding with a KV cache (queries shorter than keys, bottom-right causal)."""
    _, sdpa, ours = models("llama")
    ids = torch.randint(0, 97, (1, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cuteattn.FallbackWarning)
        a = ours.generate(ids, max_new_tokens=5, do_sample=False)
        b = sdpa.generate(ids, max_new_tokens=5, do_sample=False)
    assert a.shape == b.shape == (1, 11)
    assert torch.equal(a[:, :6], ids)


def test_sinks_pass_through_as_learnable_sink(seed=0):
    """transformers' s_aux (gpt-oss's sinks) becomes cuteattn's learnable_sink."""
    from cuteattn.integrations.transformers import cuteattn_attention_forward
    from cuteattn.reference import attention_ref
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 64, dtype=torch.bfloat16) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    sink = torch.randn(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cuteattn.FallbackWarning)
        out, weights = cuteattn_attention_forward(module, q, k, v, None, s_aux=sink.to(torch.bfloat16))
    ref, _ = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), causal=True,
                           learnable_sink=sink.to(torch.bfloat16).float())
    assert weights is None and (out.float() - ref).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_gpu_kernels_serve_the_model(kind, calls, monkeypatch):
    """On the GPU in bf16, strict (a call the kernels do not serve fails): plain, padded and
    packed batches against the model on SDPA, and a training step."""
    monkeypatch.setenv("CUTEATTN_STRICT", "1")
    ref, sdpa, ours = (m.cuda() for m in models(kind))
    ids = torch.randint(0, 97, (3, 40), device="cuda")
    mask = torch.ones(3, 40, dtype=torch.long, device="cuda")
    mask[0, :13] = 0
    mask[2, 31:] = 0
    for inputs, rows in ((dict(input_ids=ids), None),
                         (dict(input_ids=ids, attention_mask=mask), mask.bool())):
        check(*(logits(m, **inputs) for m in (ours, sdpa, ref)), rows=rows)
    pos = torch.cat([torch.arange(25), torch.arange(15)])[None].cuda()
    packed = logits(ours, input_ids=ids[:1], position_ids=pos)
    alone = [torch.cat([logits(m, input_ids=ids[:1, :25]), logits(m, input_ids=ids[:1, 25:])], 1)
             for m in (sdpa, ref)]
    check(packed, *alone)
    assert calls["flash_attn_func"] > 0 and calls["flash_attn_varlen_func"] > 0
    ours.train()
    loss = ours(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and ours.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
