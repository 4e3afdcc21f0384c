"""Activation compression: quantize_groupwise / dequantize on every backend
against the reference (round trip, packing, stochastic unbiasedness,
bad input) and compressed_activations on a real training step (gradients,
checkpoint, what is left alone)."""
import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import glm5_ops
from glm5_ops import reference
from glm5_ops.compress import SavedTensorMeter, compressed_activations, dequantize, quantize_groupwise
from conftest import DEVICE, INTERPRETED, fresh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from training.byte_lm import ByteLM, ByteLMConfig  # noqa: E402
from training.memory_policy import MemoryPolicy, apply_memory_policy  # noqa: E402

ops = torch.ops.glm5
GROUPS = [32, 64, 96, 128, 256]


def codes(packed, bits):
    """Unpacked codes, element order (the layout of reference.py)."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
    return ((packed.reshape(-1, 1) >> shifts) & ((1 << bits) - 1)).reshape(-1).long()


def tol(dtype):
    """fp32: 1-2 ulp (the kernels may fuse zero + q*scale into an FMA); fp16/bf16: the
    dtype's default tolerance (that ulp can flip the final rounding)."""
    return dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else {}


def dtypes(backend):
    return [torch.float32, torch.float16] + ([] if backend == "triton" and INTERPRETED else [torch.bfloat16])


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group_size", GROUPS)
def test_round_trip_matches_reference(backend, poisoned, bits, group_size):
    for dtype in dtypes(backend):
        x = fresh(3, 5, 2 * 384 if group_size == 256 else 384, dtype=dtype, scale=3.0)
        x[0, 0, :group_size] = 1.5                       # a constant group: scale 0, codes 0
        packed, scale, zero = quantize_groupwise(x, bits, group_size)
        G = x.numel() // group_size
        assert packed.shape == (x.numel() * bits // 8,) and packed.dtype == torch.uint8
        assert scale.shape == zero.shape == (G,) and scale.dtype == zero.dtype == torch.float32
        rp, rs, rz = reference.quantize_groupwise(x, bits, group_size)
        torch.testing.assert_close(scale, rs, rtol=0, atol=0)
        torch.testing.assert_close(zero, rz, rtol=0, atol=0)
        diff = (codes(packed, bits) - codes(rp, bits)).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3   # only at .5 ties
        y = dequantize(packed, scale, zero, bits, group_size, x.shape, dtype=x.dtype)
        assert y.shape == x.shape and y.dtype == x.dtype and not y.isnan().any()
        # within half a quantisation step of each group (plus the output dtype's rounding)
        err = (y.float() - x.float()).reshape(G, group_size).abs().amax(1)
        out_ulp = y.float().reshape(G, group_size).abs().amax(1) * (2 ** -8 if dtype != torch.float32 else 2 ** -22)
        assert (err <= scale / 2 * (1 + 1e-5) + out_ulp + 1e-7).all()
        ry = reference.dequantize(rp, rs, rz, bits, group_size, x.shape, dtype)
        if torch.equal(packed, rp):
            torch.testing.assert_close(y, ry, **tol(dtype))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dequantize_any_dtype(backend, poisoned, bits):
    x = fresh(4, 256)
    packed, scale, zero = quantize_groupwise(x, bits, 64)
    ref32 = reference.dequantize(packed, scale, zero, bits, 64, x.shape)
    for dtype in dtypes(backend):
        y = dequantize(packed, scale, zero, bits, 64, (4, 256), dtype)
        assert y.dtype == dtype
        torch.testing.assert_close(y, ref32.to(dtype), **tol(dtype))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_stochastic_rounding_unbiased(backend, bits):
    x = fresh(16 if backend == "triton" and INTERPRETED else 64, 1024, seed=7)
    draws = 64 if backend == "triton" and INTERPRETED else 256
    total = torch.zeros_like(x, dtype=torch.float64)
    for s in range(draws):
        p, sc, z = quantize_groupwise(x, bits, 128, stochastic=True, seed=1000 + s)
        total += dequantize(p, sc, z, bits, 128, x.shape).double() - x.double()
    per_element = total / draws
    assert abs(per_element.mean().item()) < 1e-3
    # each element's mean error shrinks like scale/sqrt(draws): no systematic bias anywhere
    _, scale, _ = quantize_groupwise(x, bits, 128)
    bound = 6 * scale.double().repeat_interleave(128).reshape(x.shape) / (2 * draws ** 0.5)
    assert (per_element.abs() <= bound + 1e-6).all()


def test_stochastic_reproducible_across_threads_and_backends():
    x = fresh(8, 512, seed=3)
    a = quantize_groupwise(x, 4, 128, stochastic=True, seed=42)
    b = quantize_groupwise(x, 4, 128, stochastic=True, seed=42)
    c = quantize_groupwise(x, 4, 128, stochastic=True, seed=43)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    if DEVICE.type == "cpu":
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            d = quantize_groupwise(x, 4, 128, stochastic=True, seed=42)
        finally:
            torch.set_num_threads(old)
        assert torch.equal(a[0], d[0])
    from conftest import BACKENDS
    if "triton" in BACKENDS:
        with glm5_ops.use_backend("triton"):
            t = quantize_groupwise(x, 4, 128, stochastic=True, seed=42)
        assert torch.equal(a[0], t[0])     # same counter-based hash in C++ and Triton


@pytest.mark.parametrize("call,exc,match", [
    (lambda x: quantize_groupwise(x, 3), ValueError, r"bits must be one of \(8, 4, 2\), got 3"),
    (lambda x: quantize_groupwise(x, 16), ValueError, r"bits must be one of"),
    (lambda x: quantize_groupwise(x, 8, 100), ValueError,
     r"group_size must divide the last dimension of x \(shape \(4, 256\)\), got 100"),
    (lambda x: quantize_groupwise(x, 2, 30), ValueError, r"group_size must be .* multiple of 4"),
    (lambda x: quantize_groupwise(x, 8, 0), ValueError, r"group_size must be a positive int"),
    (lambda x: quantize_groupwise(x.int(), 8), TypeError, r"x must have dtype in"),
    (lambda x: quantize_groupwise(x[0, 0], 8), ValueError, r"x must have shape \[..., C\]"),
    (lambda x: quantize_groupwise(x, 8, stochastic=True, seed=1.5), ValueError, r"seed must be"),
    (lambda x: dequantize(*quantize_groupwise(x, 8), 4, 128, x.shape), ValueError, r"packed must have shape"),
    (lambda x: dequantize(*quantize_groupwise(x, 8), 8, 128, (4, 100)), ValueError,
     r"group_size must divide the last dimension of shape \(4, 100\), got 128"),
    (lambda x: dequantize(*quantize_groupwise(x, 8), 8, 128, x.shape, torch.int32), TypeError, r"dtype must be"),
    (lambda x: dequantize(quantize_groupwise(x, 8)[0].int(), *quantize_groupwise(x, 8)[1:], 8, 128, x.shape),
     TypeError, r"packed must have dtype"),
])
def test_bad_input(backend, call, exc, match):
    with pytest.raises(exc, match=match):
        call(fresh(4, 256))


def test_cpp_guards_direct_calls():
    x = fresh(4, 256)
    with pytest.raises(ValueError, match=r"bits must be one of"):
        ops.quantize_groupwise(x, 5, 128, False, 0)
    with pytest.raises(ValueError, match=r"must divide the last dimension of x"):
        ops.quantize_groupwise(x, 8, 96, False, 0)
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor"):
        ops.quantize_groupwise(x.int(), 8, 128, False, 0)
    p, s, z = ops.quantize_groupwise(x, 8, 128, False, 0)
    with pytest.raises(ValueError, match=r"packed must hold"):
        ops.dequantize(p[:-1], s, z, 8, 128, [4, 256], torch.float32)


# --------------------------------------------------------------------------
# compressed_activations
# --------------------------------------------------------------------------

def tiny_lm():
    torch.manual_seed(0)
    cfg = ByteLMConfig(dim=64, n_layers=2, n_heads=2, ffn=128, seq_len=64)
    return ByteLM(cfg).to(DEVICE), torch.randint(0, 256, (4, 65), device=DEVICE)


def step_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    return [(n, p.grad.clone()) for n, p in model.named_parameters()]   # wrapping keeps the order


def cosines(a, b):
    return {n: F.cosine_similarity(ga.flatten().double(), gb.flatten().double(), dim=0).item()
            for (n, ga), (_, gb) in zip(a, b)}


@pytest.mark.parametrize("policy", ["compress8", "full"])
def test_training_step_gradients_8bit(policy):
    model, tokens = tiny_lm()
    ref = step_grads(model, tokens)
    meter = SavedTensorMeter(params=model)
    compressed = apply_memory_policy(copy.deepcopy(model), MemoryPolicy.preset(policy, 2, group_size=64), meter)
    with meter:
        loss = compressed(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert sum(e["compressed"] for e in meter.by_op().values()) > 10
    cos = cosines(ref, step_grads(compressed, tokens))
    assert min(cos.values()) >= 0.99, cos
    assert min(cos.values()) < 1 - 1e-9       # compression did change something


def test_composes_with_checkpoint():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).to(DEVICE)
    x = torch.randn(64, 128, device=DEVICE, requires_grad=True)

    def run(ctx, ck):
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        with ctx:
            y = checkpoint(mlp, x, use_reentrant=False) if ck else mlp(x)
            y = torch.tanh(y)
        y.pow(2).sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]

    ref = run(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), False)
    meter = SavedTensorMeter(params=mlp)
    with meter:
        got = run(compressed_activations(8, 64, min_numel=1024, params=mlp, meter=meter), True)
    by_op = meter.by_op()
    assert by_op["(checkpoint inputs)"]["compressed"] == 1   # x, kept by checkpoint, compressed
    assert not {"linear", "gelu"} & set(by_op)              # nothing inside the checkpoint saved
    for r, g in zip(ref, got):
        assert F.cosine_similarity(r.flatten(), g.flatten(), dim=0) > 0.99


def test_parameters_ints_and_small_tensors_left_alone():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(256, 256, device=DEVICE))
    x = torch.randn(64, 256, device=DEVICE, requires_grad=True)
    idx = torch.randint(0, 256, (64, 256), device=DEVICE)
    small = torch.randn(8, 8, device=DEVICE, requires_grad=True)
    seen = []
    ctx = compressed_activations(8, 128, min_numel=1024, params=[w])
    pack = ctx._pack
    ctx.pack_hook = lambda t: seen.append((t, pack(t))) or seen[-1][1]
    with torch.autograd.graph.saved_tensors_hooks(ctx.pack_hook, ctx.unpack_hook):
        y = (x @ w.t()).gather(1, idx).sum() + (small * small).sum()
    y.backward()
    kinds = {}
    for t, stored in seen:
        kinds.setdefault(("int" if not t.is_floating_point() else "param" if t.untyped_storage().data_ptr()
                          == w.untyped_storage().data_ptr() else "small" if t.numel() < 1024 else "act"),
                         set()).add(stored is t)
    assert kinds["param"] == {True} and kinds["int"] == {True} and kinds["small"] == {True}
    assert kinds["act"] == {False}                  # x compressed
    counts = torch.zeros(64, 256, device=DEVICE).scatter_add_(1, idx, torch.ones(64, 256, device=DEVICE))
    assert F.cosine_similarity(w.grad.flatten(), (counts.t() @ x.detach()).flatten(), dim=0) > 0.999


def test_meter_counts_storage_once():
    a = torch.randn(64, 256, device=DEVICE, requires_grad=True)
    with SavedTensorMeter() as m:
        b = a.exp()                 # saves its output b
        c = (b * b).sum()           # saves b twice: one storage
    assert m.saved_bytes == b.numel() * 4
    assert m.logical_bytes == 3 * b.numel() * 4
    c.backward()
