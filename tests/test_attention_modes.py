"""The model's seams: attention modes as registered classes, and the form
choice (glm5_ops/plan.py) reading the CPU kernel's own lane threshold."""
import math

import pytest
import torch

import glm5_ops
from conftest import DEVICE
from glm5_ops import plan
from models.glm5 import GLM5ForCausalLM, preset
from models.glm5.attention_modes import (ATTENTION_MODES, AttentionMode, attend_selected, attention_mode,
                                         register_attention_mode)


class SlidingWindow(AttentionMode):
    """The toy mode: each query attends to its `window` most recent keys (itself included)."""

    def __init__(self, window: int = 8):
        self.window = window

    def select(self, attn, step, prev_selection, ctx):
        B, S = step.x.shape[:2]
        pos = ctx.q_start + torch.arange(S, device=step.x.device)
        keys = pos[:, None] - torch.arange(self.window, device=step.x.device)
        return torch.where(keys >= 0, keys, -1).to(torch.int32)[None].expand(B, S, self.window)

    def attend(self, attn, step, selection, ctx):
        return attend_selected(attn, step, selection, ctx)


@pytest.fixture
def sliding_window():
    """SlidingWindow registered as "sliding_window" for the test (the seam: one class, one registration)."""
    register_attention_mode("sliding_window")(SlidingWindow)
    yield "sliding_window"
    ATTENTION_MODES.pop("sliding_window")


def _model(attn="dsa", seed=0):
    """The tiny preset with weights of std 1/sqrt(fan_in), so attention is not uniform."""
    torch.manual_seed(seed)
    model = GLM5ForCausalLM(preset("tiny"), attn=attn).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def _ids(model, S, seed=1):
    return torch.randint(0, model.config.vocab_size, (2, S), generator=torch.Generator().manual_seed(seed))


def _layer_calls(model, ids):
    """(attention module, x, cos, sin, its output) for every MLA layer of one forward of ids."""
    calls = []
    hooks = [layer.self_attn.register_forward_hook(
        lambda m, args, out: calls.append((m, args[0], args[1].cos, args[1].sin, out[0])))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return calls


def _masked_attention(attn, x, cos, sin, window):
    """MLA by hand in the per-head form: softmax over keys t with s - window < t <= s."""
    q_nope, q_rot, _, kv = attn.project(x, cos, sin)
    q, k, v = attn.expand(q_nope, q_rot, kv)
    S = x.shape[1]
    s, t = torch.arange(S)[:, None], torch.arange(S)[None, :]
    visible = (t <= s) & (t > s - window)
    scores = torch.einsum("bshd,bthd->bhst", q.double(), k.double()) * attn.scale
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    out = torch.einsum("bhst,bthd->bshd", p, v.double()).to(x.dtype)
    return attn.o_proj(out.reshape(*x.shape[:2], -1))


def test_a_registered_toy_mode_runs_the_model(sliding_window):
    model = _model(attn=sliding_window)
    assert model.attn == sliding_window and sliding_window in ATTENTION_MODES
    ids = _ids(model, 40)
    calls = _layer_calls(model, ids)
    assert len(calls) == model.config.num_hidden_layers
    for attn, x, cos, sin, out in calls:
        with torch.no_grad():
            windowed, causal = _masked_attention(attn, x, cos, sin, 8), _masked_attention(attn, x, cos, sin, 10**9)
        scale = windowed.abs().max()
        assert (out - windowed).abs().max() <= 1e-4 * scale, attn.layer_idx
        assert (windowed - causal).abs().max() > 1e-2 * scale, attn.layer_idx     # the window matters


def test_a_window_over_every_key_is_dense_attention(sliding_window):
    model = _model(attn="dense")
    ids = _ids(model, 40)
    with torch.no_grad():
        dense = model(ids)
        with model.attention(SlidingWindow(window=40)):
            covering = model(ids)
        with model.attention(sliding_window):
            windowed = model(ids)
    torch.testing.assert_close(covering, dense, rtol=0, atol=1e-5 * dense.abs().max().item())
    assert (windowed - dense).abs().max() > 1e-2 * dense.abs().max()


def test_the_toy_mode_decodes_through_the_paged_cache(sliding_window):
    model = _model(attn=sliding_window)
    ids = _ids(model, 24)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 24, page_size=4)
        steps = [model(ids[:, :10], cache)] + [model(ids[:, t:t + 1], cache) for t in range(10, 24)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5 * full.abs().max().item())


def test_attention_block_restores_the_mode_even_on_exception():
    model = GLM5ForCausalLM(preset("tiny"), attn="dsa")
    with pytest.raises(RuntimeError, match="inside"):
        with model.attention("dense"):
            assert model.attn == "dense"
            with model.attention("block_sparse"):
                assert model.attn == "block_sparse"
            assert model.attn == "dense"
            raise RuntimeError("raised inside the block")
    assert model.attn == "dsa"


def test_unknown_modes_name_the_registered_ones():
    model = GLM5ForCausalLM(preset("tiny"), attn="block_sparse")
    for make in (lambda: GLM5ForCausalLM(preset("tiny"), attn="flash"), lambda: model.attention("flash").__enter__(),
                 lambda: attention_mode("flash")):
        with pytest.raises(ValueError, match="must be one of the registered attention modes") as err:
            make()
        assert all(name in str(err.value) for name in ("block_sparse", "dense", "dsa", "'flash'"))
    assert model.attn == "block_sparse"


def test_registration_refuses_non_modes_and_taken_names():
    with pytest.raises(TypeError, match="AttentionMode subclass"):
        register_attention_mode("window")(object)
    with pytest.raises(ValueError, match="'dense' is already registered"):
        register_attention_mode("dense")(SlidingWindow)
    assert ATTENTION_MODES["dense"].__name__ == "DenseAttention"


def test_the_cli_offers_the_registered_modes(sliding_window):
    cli = pytest.importorskip("profiling.cli", reason="the CLI's optional dependencies")
    args = cli.build_parser().parse_args(["profile", "--attn", sliding_window])
    assert args.attn == sliding_window


# ------------------------------------------------- the form choice and the CPU kernel

def _lane_test_inputs(G, n, T=128, S=64, seed=0):
    """q/k/v of one kv head read by G query heads, and S = 64 queries (one lane
    block) each choosing n of T keys, non-causal: the block's span is all T
    keys, so it selected n / T of its span's pairs."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, S if i == 0 else T, G if i == 0 else 1, 32, generator=g) for i in range(3))
    rows = [torch.randperm(T, generator=g)[:n] for _ in range(S)]
    rows[0] = torch.cat([torch.tensor([0, T - 1]), 1 + torch.randperm(T - 2, generator=g)[:n - 2]])   # spans all T
    return q, k, v, torch.stack(rows)[None].to(torch.int32)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU kernel's lane threshold")
@pytest.mark.parametrize("G", [1, 2, 3, 4, 8, 12, 16, 32])
def test_plan_reads_the_lane_threshold_the_kernel_applies(monkeypatch, G):
    """A query block that selected just above plan's threshold for its head
    group runs on lane tiles (bitwise the forced lane output), just below it
    gathers (bitwise the forced gathered output): plan and kernel agree."""
    _, min_density = plan.cpu_lane_costs(G, 64)
    assert 0 < min_density < 1
    T = 128
    for n, path in ((math.floor(min_density * T) + 1, "always"), (math.ceil(min_density * T) - 1, "never")):
        q, k, v, idx = _lane_test_inputs(G, n, T)
        out = {}
        for mode in ("auto", "always", "never"):
            monkeypatch.setenv("GLM5_SPARSE_LANE_BLOCKS", mode)
            with glm5_ops.use_backend("cpp"):
                out[mode] = glm5_ops.sparse_attention(q, k, v, idx, causal=False)[0]
        assert not torch.equal(out["always"], out["never"])      # the two paths are told apart
        assert torch.equal(out["auto"], out[path]), (G, n / T, min_density, path)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU kernel's cost model")
def test_dsa_form_choice_follows_the_kernels_lane_threshold(monkeypatch):
    """The expanded DSA form pays off only on lane tiles: where its pair count
    alone says expanded, plan takes it exactly while the selection's density
    reaches the kernel's threshold for one head per kv head."""
    dims = dict(kv_lora=4096, nope=8, rope=8, v_dim=8)     # expanding is almost free: only the density decides
    cpu = torch.device("cpu")
    _, min_density = plan.cpu_lane_costs(1, 256)
    S, q_start = 256, 100_000                              # visible ~ selected / density
    for density, expect in ((min_density * 1.05, True), (min_density * 0.95, False)):
        topk = round(density * (q_start + S / 2))
        assert plan.dsa_expanded_is_cheaper(cpu, S, q_start, topk, **dims) is expect, density
        monkeypatch.setenv("GLM5_SPARSE_LANE_BLOCKS", "never")
        assert not plan.dsa_expanded_is_cheaper(cpu, S, q_start, topk, **dims)
        monkeypatch.setenv("GLM5_SPARSE_LANE_BLOCKS", "always")
        assert plan.dsa_expanded_is_cheaper(cpu, S, q_start, topk, **dims)
        monkeypatch.delenv("GLM5_SPARSE_LANE_BLOCKS")
    with glm5_ops.use_backend("reference"):                 # not the C++ kernel: absorbed, as on other devices
        assert not plan.dsa_expanded_is_cheaper(cpu, S, q_start, round(0.9 * q_start), **dims)


def test_cpu_lane_costs_refuses_bad_arguments():
    with pytest.raises(ValueError, match="group must be >= 1"):
        plan.cpu_lane_costs(0, 64)
    with pytest.raises(ValueError, match="queries must be >= 1"):
        plan.cpu_lane_costs(1, 0)
