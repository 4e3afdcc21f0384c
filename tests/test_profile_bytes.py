"""The profile's bytes column counts what a step must read: the chosen experts'
weights, the selected cache rows, the gathered embedding rows (not whole tensors);
and the step's bound line."""
import pytest
import torch

import glm5_ops
from glm5_ops import nvtx
from profiling import measure, profile_report
from profiling.flops import OpCounter

F32 = 4


@pytest.fixture
def counter():
    c = OpCounter(capture_layer=None)
    with torch.inference_mode(), nvtx.recording(), c:
        yield c


def test_fused_moe_counts_only_the_chosen_experts(counter):
    E, D, I, T = 8, 16, 8, 4
    x, weights = torch.randn(T, D), torch.full((T, 2), 0.5)
    w_gate_up, w_down = torch.randn(E, 2 * I, D), torch.randn(E, D, I)
    two = torch.tensor([[1, 5], [5, 1], [1, 5], [1, 5]], dtype=torch.int32)   # experts 1 and 5 only
    every = torch.arange(E, dtype=torch.int32).view(T, 2)                    # all 8, same shape
    charged = []
    for ids in (two, every):
        counter.bytes.clear()
        with nvtx.nvtx_range("layer1/moe/experts"):
            glm5_ops.fused_moe(x, w_gate_up, w_down, weights, ids)
        charged.append(counter.bytes["experts"])
    per_expert = (2 * I * D + D * I) * F32
    assert charged[1] - charged[0] == 6 * per_expert        # the six experts nobody chose cost nothing
    assert 2 * per_expert < charged[0] < 3 * per_expert     # two experts' weights plus a few activations


def test_embedding_counts_the_gathered_rows(counter):
    table = torch.randn(1000, 32)
    ids = torch.tensor([[3, 7]])
    with nvtx.nvtx_range("embed"):
        torch.nn.functional.embedding(ids, table)
    assert counter.bytes["embedding"] == ids.numel() * 8 + 2 * (2 * 32 * F32)


def test_sparse_attention_counts_the_selected_rows(counter):
    T, H, D, C = 64, 2, 24, 16
    pool = torch.randn(1, T, 1, D)                         # latent cache: v is a view of k's first C columns
    q = torch.randn(1, 1, H, D)
    charged = []
    for rows in ([4, 9, 9, -1, 30], [4, 9, 12, 13, 30]):   # 3 distinct rows and an empty slot; 5 rows
        counter.bytes.clear()
        with nvtx.nvtx_range("layer0/attn/core"):
            glm5_ops.sparse_attention(q, pool, pool[..., :C], torch.tensor([[rows]], dtype=torch.int32),
                                      scale=0.1, causal=False)
        charged.append(counter.bytes["core attention"])
    assert charged[1] - charged[0] == 2 * D * F32            # one row of the latent per selected key
    assert charged[0] < pool.numel() * F32 / 4                # far from the whole cache


def test_breakdown_time_outside_operators():
    """A step of 100 us: a component range holding two ops (30 + 20 us, one nesting
    another op), the rest Python: 50 us outside every operator call."""
    class Ev:
        def __init__(self, name, start, end, children=()):
            self.name, self.cpu_children = name, list(children)
            self.time_range = type("R", (), {"start": start, "end": end})()
            self.sequence_nr, self.thread, self.self_device_time_total = -1, 0, 0
    inner = Ev("aten::addmm", 12, 18)
    step = Ev("glm5-lab/step0", 0, 100, [Ev("layer0/attn/proj", 5, 60, [Ev("aten::linear", 10, 40, [inner]),
                                                                       Ev("glm5::sparse_attention_fwd", 40, 60)])])
    from profiling.components import breakdown
    bd = breakdown([step])
    assert bd.step_us == 100 and bd.ops_us == 50 and bd.outside_ops_us == 50


def test_bound_sentence_and_read_bandwidth():
    rows = [dict(component="experts", bytes=2e9, ms=30.0, share=0.75),
            dict(component="other", bytes=0, ms=10.0, share=0.25)]
    text = profile_report.bound_sentence(rows, step_us=40_000, read_gbs=50.0)
    assert "2.00 GB per step" in text and "= 40.00 ms" in text and "1.0x the bound" in text
    assert "Framework overhead (step time outside every component range): 10.00 ms, 25.0%" in text
    assert "outside every operator call" not in text
    text = profile_report.bound_sentence(rows, step_us=40_000, read_gbs=50.0, outside_ops_us=6_000)
    assert "Time outside every operator call (Python, module calls, dispatch around the ops): 6.00 ms, 15.0%" in text
    assert 0.1 < measure.read_bandwidth_gbs("cpu", mib=8, repeat=2) < 10_000
    with pytest.raises(ValueError, match="mib"):
        measure.read_bandwidth_gbs("cpu", mib=0)
