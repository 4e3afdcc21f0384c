"""models.glm5.quantize on the tiny preset: what it replaces, what DEFAULT_SKIP
keeps, outputs close to fp32, weight bytes, save/load through from_pretrained."""
import copy

import pytest
import torch
from torch import nn

import glm5_ops
from models.glm5 import GLM5ForCausalLM, DEFAULT_SKIP, preset, quantize, save_quantized
from models.glm5.moe import Experts, Router
from models.glm5.quantization import Int8Embedding, Int8Experts, Int8Linear, weight_bytes


def _model(seed=0):
    torch.manual_seed(seed)
    return GLM5ForCausalLM(preset("tiny"), attn="dense").eval()


def _ids(S=24, seed=1):
    return torch.randint(0, 512, (2, S), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("mode", ["int8_weight_only", "w8a8"])
def test_default_skip_keeps_key_layers_and_quantises_the_rest(mode):
    model = _model()
    ids = _ids()
    with torch.no_grad():
        expect = model(ids)
        router_w = model.model.layers[1].mlp.gate.weight.clone()
        assert quantize(model, mode) is model
        got = model(ids)
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.model.embed_tokens, nn.Embedding)
    for layer in model.model.layers:
        attn = layer.self_attn
        assert isinstance(attn.q_a_proj, Int8Linear) and isinstance(attn.o_proj, Int8Linear)
        assert isinstance(attn.kv_b_proj, Int8Linear)     # MLA reads it through int8_linear_heads
        if attn.indexer is not None:
            assert isinstance(attn.indexer.weights_proj, nn.Linear) and isinstance(attn.indexer.wk, Int8Linear)
    moe = model.model.layers[1].mlp
    assert isinstance(moe.experts, Int8Experts) and isinstance(moe.shared_experts.down_proj, Int8Linear)
    assert torch.equal(moe.gate.weight, router_w)            # the router untouched
    assert model.quantization["mode"] == mode and model.quantization["skip"] == list(DEFAULT_SKIP)
    assert _rel(got, expect) < 0.05


def test_empty_skip_quantises_everything():
    model = _model()
    ids = _ids()
    with torch.no_grad():
        expect = model(ids)
        router_w = model.model.layers[1].mlp.gate.weight.clone()
        quantize(model, "int8_weight_only", skip=())
        got = model(ids)
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.model.embed_tokens, Int8Embedding)
    assert isinstance(model.model.layers[0].self_attn.kv_b_proj, Int8Linear)
    gate = model.model.layers[1].mlp.gate
    assert not torch.equal(gate.weight, router_w)             # rounded through int8
    q, s = glm5_ops.quantize_int8(router_w)
    torch.testing.assert_close(gate.weight, q.float() * s[:, None])
    assert not any(isinstance(m, (Experts, nn.Linear, nn.Embedding)) for m in model.modules())
    assert _rel(got, expect) < 0.05


def test_skip_patterns_and_bad_arguments():
    model = quantize(_model(), skip=["*.self_attn.*", "lm_head"])
    assert isinstance(model.model.layers[0].self_attn.q_a_proj, nn.Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int8Linear)
    assert isinstance(model.model.embed_tokens, Int8Embedding)
    with pytest.raises(ValueError, match="mode must be one of"):
        quantize(_model(), mode="int4")
    with pytest.raises(TypeError, match="skip must"):
        quantize(_model(), skip=[3])
    with pytest.raises(TypeError, match="skip must"):
        quantize(_model(), skip=5)


def test_w8a8_uses_int8_activations_only_above_the_row_threshold(monkeypatch):
    model = quantize(_model(), "w8a8")
    calls = []
    real = glm5_ops.w8a8_linear
    monkeypatch.setattr(glm5_ops, "w8a8_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        model(_ids(S=4)[:1])             # 4 rows: weight-only
        assert not calls
        model(_ids(S=24))                # 48 rows: dynamic int8 activations
        assert calls


def test_weight_bytes_quarter_for_quantised_layers():
    model = _model()
    before = weight_bytes(model)["total"]
    quantize(model, skip=())
    b = weight_bytes(model)
    assert b["other"] < 0.01 * before   # norms, router, biases
    assert 0.25 < b["int8_modules"] / before < 0.27   # int8 + one fp32 scale per row


class _Wrapped(torch.Tensor):
    """A wrapper tensor subclass like torchao's Int8Tensor: no storage of its own."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=torch.float32)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"_Wrapped: {func}")


def test_weight_bytes_counts_what_a_tensor_subclass_holds():
    """bench/int8_torchao.py and int8_bench.py size torchao's models with it."""
    m = torch.nn.Linear(4, 3)
    m.register_buffer("packed", _Wrapped(torch.ones(3, 40, dtype=torch.int8)))
    assert weight_bytes(m)["total"] == 3 * 4 * 4 + 3 * 4 + 3 * 40   # weight, bias, the int8 inner tensor


def test_save_and_from_pretrained_roundtrip(tmp_path):
    model = quantize(_model(), "w8a8")
    ids = _ids()
    save_quantized(model, str(tmp_path))
    loaded = GLM5ForCausalLM.from_pretrained(str(tmp_path), attn="dense")
    assert isinstance(loaded.model.layers[1].mlp.experts, Int8Experts)
    assert loaded.model.layers[1].mlp.experts.gate_up_q.dtype == torch.int8
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match="quantised first"):
        save_quantized(_model(), str(tmp_path / "x"))


def test_decode_with_cache_matches_full_forward():
    """Prefill (w8a8 GEMMs) then decode steps (weight-only GEMVs) track the model's own full forward."""
    model = quantize(_model(), "int8_weight_only")
    ids = _ids(S=20)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 32)
        steps = [model(ids[:, :17], cache)[:, -1]] + [model(ids[:, s:s + 1], cache)[:, -1] for s in range(17, 20)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 16:], rtol=1e-4, atol=1e-4)


def test_int8_kv_b_proj_decodes_as_its_dequantised_weight(monkeypatch):
    """MLA reads an int8 kv_b_proj through int8_linear_heads at decode (W_UK^T with kv_b's row
    scales folded into the query, W_UV as int8 views) and dequantises it for prefill: the logits
    equal those of the same model whose kv_b_proj is an fp32 Linear holding the dequantised weight."""
    torch.manual_seed(5)
    model = quantize(_model(), "int8_weight_only")
    plain = copy.deepcopy(model)
    for layer in plain.model.layers:
        attn = layer.self_attn
        assert isinstance(attn.kv_b_proj, Int8Linear)
        linear = nn.Linear(attn.kv_b_proj.in_features, attn.kv_b_proj.out_features, bias=False)
        with torch.no_grad():
            linear.weight.copy_(attn.kv_b_proj.weight)
        attn.kv_b_proj = linear
    ids = _ids()

    def run(m):
        cache = m.new_cache(ids.shape[0], ids.shape[1] + 6)
        with torch.inference_mode():
            logits, _ = m.prefill(ids, cache)
            out, nxt = [logits], logits.argmax(-1)[:, None]
            for _ in range(5):
                logits = m(nxt, cache)[:, -1]
                out.append(logits)
                nxt = logits.argmax(-1)[:, None]
        return torch.stack(out)

    calls = []
    heads = glm5_ops.int8_linear_heads
    monkeypatch.setattr(glm5_ops, "int8_linear_heads", lambda *a: calls.append(1) or heads(*a))
    got = run(model)
    assert len(calls) >= 2 * 5 * model.config.num_hidden_layers    # W_UK and W_UV of every decode step
    expect = run(plain)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
