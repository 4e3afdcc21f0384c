"""The packed row layout of int8 expert weights (glm5_ops/reference.py, pack_rows):
the layout itself, fused_moe_int8(packed=True) against packed=False on every path
of the kernel, and Int8Experts keeping its weights packed where the CPU decode
kernel reads them fastest while state_dict and checkpoints hold plain rows."""
import copy

import pytest
import torch

import glm5_ops
from glm5_ops import reference as ref
from glm5_ops.int8 import pack_rows, packed_experts_pay, unpack_rows
from models.glm5 import GLM5ForCausalLM, preset, quantize, save_quantized
from models.glm5.quantization import Int8Experts
from conftest import BACKENDS, DEVICE, fresh


def _int8(*shape, seed=0):
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


def _packed_offset(N, K, n, k):
    """The byte of w[n, k] in the packed layout, as csrc/cpu/int8_vnni.h's packed_offset says:
    groups of 16 rows, 4 bytes of each row in turn, then the rows' K % 4 tails; the rows
    after the last group plain."""
    if n >= N // 16 * 16:
        return n * K + k
    g, j, kc = n // 16 * 16, n % 16, K // 4 * 4
    return g * K + (k // 4 * 64 + j * 4 + k % 4 if k < kc else kc * 16 + j * (K - kc) + (k - kc))


@pytest.mark.parametrize("N,K", [(16, 128), (17, 100), (33, 64), (15, 30), (40, 203), (1, 1), (16, 3), (32, 65)])
def test_layout_is_the_one_the_kernel_reads(N, K):
    w = _int8(N, K, seed=N * K)
    flat = pack_rows(w).flatten()
    for n in range(N):
        for k in range(K):
            assert flat[_packed_offset(N, K, n, k)] == w[n, k], (n, k)


@pytest.mark.parametrize("shape", [(3, 16, 128), (2, 37, 101), (5, 3), (0, 64), (9, 0), (16, 0), (4, 1, 64),
                                   (6, 33, 202)])
def test_pack_roundtrip_keeps_shape_and_bytes(shape):
    w = _int8(*shape)
    p = pack_rows(w)
    assert p.shape == w.shape and p.dtype == torch.int8
    assert torch.equal(unpack_rows(p), w)
    assert torch.equal(p.flatten().sort().values, w.flatten().sort().values)   # a permutation


def _moe(T, D, I, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE, torch.int32)
    wgu, sgu = glm5_ops.quantize_int8(fresh(E, 2 * I, D, scale=D ** -0.5))
    wd, sd = glm5_ops.quantize_int8(fresh(E, D, I, scale=I ** -0.5))
    return fresh(T, D), wgu, sgu, wd, sd, fresh(T, k).abs(), ids


# T <= 16 with experts of few rows: the decode kernel (VNNI digits where the CPU has
# them; T = 16 over 8 experts: 9-16 rows an expert, more than one pass of 8 over a group);
# T = 40, 70: experts with more than 16 rows (the GEMM paths, unpacked per expert).
# Odd D and I: plain rows after the last group of 16, and rows with a tail of 1-3 bytes.
@pytest.mark.parametrize("T,D,I,E,k", [(1, 1024, 256, 16, 6), (3, 100, 37, 5, 2), (16, 64, 50, 4, 3),
                                       (16, 96, 42, 8, 6),
                                       (2, 7, 3, 3, 2), (5, 200, 129, 7, 3), (40, 130, 66, 6, 2), (70, 33, 17, 3, 3)])
@pytest.mark.parametrize("w8a8", [False, True])
def test_packed_equals_plain_bit_for_bit(T, D, I, E, k, w8a8):
    x, wgu, sgu, wd, sd, weights, ids = _moe(T, D, I, E, k, seed=T + D)
    plain = glm5_ops.fused_moe_int8(x, wgu, sgu, wd, sd, weights, ids, w8a8=w8a8)
    packed = glm5_ops.fused_moe_int8(x, pack_rows(wgu), sgu, pack_rows(wd), sd, weights, ids, w8a8=w8a8,
                                     packed=True)
    assert torch.equal(packed, plain)
    torch.testing.assert_close(packed, ref.fused_moe_int8(x, wgu, sgu, wd, sd, weights, ids, w8a8=w8a8).float(),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU decode kernel's thread split")
@pytest.mark.parametrize("T", [1, 16])
def test_decode_threads_meeting_in_the_middle_give_the_same_bits(T):
    """At the small preset's sizes the decode pass's threads take the tiles around each split
    from both ends (csrc/cpu/int8.cpp, MeetPass), several chunks a zone, up and down (on VNNI a
    zone's expert rows get their digits as they are taken; elsewhere the fp32 tiles meet alike). 1 to 4 threads (3 and 4: a thread between
    two zones) give the same bits, packed or plain, as each token alone."""
    x, wgu, sgu, wd, sd, weights, ids = _moe(T, 1024, 256, 64, 6, seed=5 + T)
    pgu, pd = pack_rows(wgu), pack_rows(wd)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            outs.append(glm5_ops.fused_moe_int8(x, wgu, sgu, wd, sd, weights, ids))
            outs.append(glm5_ops.fused_moe_int8(x, pgu, sgu, pd, sd, weights, ids, packed=True))
        torch.set_num_threads(2)
        alone = torch.cat([glm5_ops.fused_moe_int8(x[t:t + 1], pgu, sgu, pd, sd, weights[t:t + 1], ids[t:t + 1],
                                                   packed=True) for t in range(T)])
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert torch.equal(alone, outs[0])
    torch.testing.assert_close(outs[0], ref.fused_moe_int8(x, wgu, sgu, wd, sd, weights, ids, w8a8=False).float(),
                               rtol=1e-3, atol=1e-3)


def test_packed_non_finite_rows_as_plain():
    """A row with a NaN or an infinity takes the kernel's float64 path, which reads packed rows too."""
    x, wgu, sgu, wd, sd, weights, ids = _moe(4, 100, 37, 5, 2, seed=7)
    x[1, 3], x[2, 0] = float("nan"), float("inf")
    plain = glm5_ops.fused_moe_int8(x, wgu, sgu, wd, sd, weights, ids)
    packed = glm5_ops.fused_moe_int8(x, pack_rows(wgu), sgu, pack_rows(wd), sd, weights, ids, packed=True)
    assert torch.equal(packed.isnan(), plain.isnan())
    assert torch.equal(packed.nan_to_num(), plain.nan_to_num())


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_other_backends_read_packed_weights(backend):
    if backend not in BACKENDS:
        pytest.skip(f"{backend} is not available here")
    x, wgu, sgu, wd, sd, weights, ids = _moe(3, 40, 24, 4, 2, seed=3)
    with glm5_ops.use_backend(backend):
        plain = glm5_ops.fused_moe_int8(x, wgu, sgu, wd, sd, weights, ids)
        packed = glm5_ops.fused_moe_int8(x, pack_rows(wgu), sgu, pack_rows(wd), sd, weights, ids, packed=True)
    assert torch.equal(packed, plain)


def test_packed_must_be_a_bool():
    x, wgu, sgu, wd, sd, weights, ids = _moe(1, 16, 8, 4, 2, seed=1)
    with pytest.raises(TypeError, match="packed must be a bool"):
        glm5_ops.fused_moe_int8(x, wgu, sgu, wd, sd, weights, ids, packed=1)


def _quantized(seed=0):
    torch.manual_seed(seed)
    return quantize(GLM5ForCausalLM(preset("tiny"), attn="dense").eval(), "int8_weight_only")


def _experts(model):
    return [m for m in model.modules() if isinstance(m, Int8Experts)]


@pytest.mark.skipif(DEVICE.type != "cpu" or not packed_experts_pay(torch.device("cpu"), 64, 32),
                    reason="the CPU's decode kernel reads plain rows here (no VNNI)")
def test_int8_experts_packed_on_cpu_state_dict_plain(tmp_path, monkeypatch):
    torch.manual_seed(0)
    fp = GLM5ForCausalLM(preset("tiny"), attn="dense").eval()
    plain_q = {n: glm5_ops.quantize_int8(m.gate_up_proj.detach())[0] for n, m in fp.named_modules()
               if type(m).__name__ == "Experts"}
    model = quantize(copy.deepcopy(fp), "int8_weight_only")
    experts = dict((n, m) for n, m in model.named_modules() if isinstance(m, Int8Experts))
    assert experts and all(m.packed for m in experts.values())
    for n, m in experts.items():
        assert torch.equal(m.gate_up_q, pack_rows(plain_q[n]))              # held packed
        assert torch.equal(model.state_dict()[f"{n}.gate_up_q"], plain_q[n])  # saved plain
        torch.testing.assert_close(m.gate_up_proj, ref.int8_dequantize_rows(plain_q[n], m.gate_up_scale))

    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids)
        monkeypatch.setattr("models.glm5.quantization.packed_experts_pay", lambda *a: False)
        unpacked = quantize(copy.deepcopy(fp), "int8_weight_only")
        assert not any(m.packed for m in _experts(unpacked))
        assert torch.equal(got, unpacked(ids))                                # the layout moves no bit
        monkeypatch.undo()

        save_quantized(model, str(tmp_path))
        loaded = GLM5ForCausalLM.from_pretrained(str(tmp_path), attn="dense")
        assert all(m.packed for m in _experts(loaded))
        assert torch.equal(loaded(ids), got)
        again = _quantized(seed=5)
        again.load_state_dict(model.state_dict())                          # plain rows in, packed kept
        assert all(m.packed for m in _experts(again)) and torch.equal(again(ids), got)
        twin = copy.deepcopy(model)
        assert all(m.packed for m in _experts(twin)) and torch.equal(twin(ids), got)

    on_meta = copy.deepcopy(model).to("meta")                                # the layout follows the device
    assert not any(m.packed for m in _experts(on_meta))
