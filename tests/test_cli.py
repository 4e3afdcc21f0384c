"""glm5-lab: argument errors, bench --compare, NVTX fallback, component
attribution, and a tiny end-to-end profile run (trace, report, plots)."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from glm5_ops import nvtx
from profiling import components, measure
from profiling.flops import OpCounter, causal_pairs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_main():
    pytest.importorskip("profiling.inspect", reason="profiling/inspect.py lands from its own branch")
    from profiling.cli import main
    return main


# ---------------------------------------------------------------- argument errors

@pytest.mark.parametrize("argv, message", [
    ([], "required"),
    (["profile", "--seq", "0"], "argument --seq: expected a positive integer"),
    (["profile", "--seq", "abc"], "argument --seq"),
    (["profile", "--mode", "sample"], "argument --mode: invalid choice"),
    (["profile", "--attn", "flash"], "argument --attn: invalid choice"),
    (["profile", "--preset", "huge"], "argument --preset: invalid choice"),
    (["profile", "--sweep", "512"], "argument --sweep: expected at least two"),
    (["profile", "--sweep", "1024,512"], "argument --sweep"),
    (["profile", "--preset", "tiny", "--checkpoint", "x"], "not allowed with argument"),
    (["profile", "--preset", "tiny", "--seq", "100000"], "exceed the model's max_position_embeddings"),
    (["profile", "--checkpoint", "/nonexistent/ckpt"], "--checkpoint /nonexistent/ckpt: no config.json"),
    (["bench", "--threshold", "-0.1"], "argument --threshold: expected a positive number"),
    (["bench", "--compare", "/nonexistent.json"], "--compare: no such file"),
    (["bench", "--gpu-suite", "--filter", "moe"], "--filter applies to the pytest suite"),
    (["bench", "--suite-args=--quick"], "--suite-args only goes with --gpu-suite"),
])
def test_argument_errors_print_usage_and_exit_2(capsys, argv, message):
    main = cli_main()
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: glm5-lab"), err
    assert message in err
    assert "Traceback" not in err


def test_gpu_suite_without_cuda_says_so(capsys, monkeypatch):
    main = cli_main()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--gpu-suite"])
    assert e.value.code == 2
    assert "--gpu-suite: no CUDA device" in capsys.readouterr().err


def test_module_entry_point_gives_usage_not_traceback():
    cli_main()
    r = subprocess.run([sys.executable, "-m", "profiling", "profile", "--steps", "-1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "usage: glm5-lab profile" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- bench --compare

def _run_json(path, medians):
    data = {"machine_info": {"glm5_ceilings": {"matmul_gflops": 100.0, "bandwidth_gbs": 10.0}},
            "benchmarks": [{"group": group, "name": f"test_x[{impl}]",
                            "fullname": f"bench/test_bench_moe.py::test_x[{impl}]",
                            "stats": {"median": m}, "extra_info": {"role": impl, "impl": f"{impl} impl", "flops": 1e9,
                                                                   "ceiling": "matmul"}}
                           for (group, impl), m in medians.items()]}
    with open(path, "w") as f:
        json.dump(data, f)
    return str(path)


MEDIANS = {("moe_route T=4096 E=256", "ours"): 0.010, ("moe_route T=4096 E=256", "baseline"): 0.030,
           ("fused_moe fwd T=256", "ours"): 0.050, ("fused_moe fwd T=256", "baseline"): 0.080}


def test_bench_compare_flags_injected_20pct_slowdown(tmp_path, capsys):
    main = cli_main()
    old = _run_json(tmp_path / "old.json", MEDIANS)
    slowed = dict(MEDIANS)
    slowed[("fused_moe fwd T=256", "ours")] *= 1.2          # the injected regression
    slowed[("moe_route T=4096 E=256", "baseline")] *= 1.05  # within the 10% threshold
    new = _run_json(tmp_path / "new.json", slowed)
    assert main(["bench", "--load", new, "--compare", old]) == 1
    out = capsys.readouterr().out
    flagged = [line for line in out.splitlines() if line.startswith("REGRESSION")]
    assert len(flagged) == 1 and "fused_moe fwd T=256 / ours impl" in flagged[0] and "+20%" in flagged[0]
    assert "1 of 4 benchmarks regressed" in out
    # the family table: one row per group, ratio = baseline / ours
    assert "### moe" in out
    assert re.search(r"\| moe_route \| T=4096 E=256 \| 10\.000 \| 31\.500 \| 3\.15x \|", out), out
    # a 20% slowdown passes a 25% threshold; the same run compares clean
    assert main(["bench", "--load", new, "--compare", old, "--threshold", "0.25"]) == 0
    assert main(["bench", "--load", old, "--compare", old]) == 0


# ---------------------------------------------------------------- NVTX

@pytest.fixture
def fresh_nvtx(monkeypatch):
    monkeypatch.setattr(nvtx, "_backend", None)  # re-resolve the backend in the test
    yield nvtx
    nvtx.enable(False)
    nvtx._backend = None


def _profiled_range_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


def _work():
    with nvtx.nvtx_range("layer0/attn/core"):
        with nvtx.nvtx_range("layer0/attn/topk"):
            torch.ones(8).sum()
        assert nvtx.current_ranges() == ("layer0/attn/core",)


def test_nvtx_fallback_without_package_or_cuda(fresh_nvtx, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # `import nvtx` raises ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert nvtx.backend_name() == "none"
    with nvtx.recording():
        names = _profiled_range_names(_work)
    assert "layer0/attn/core" in names and "layer0/attn/topk" in names  # still record_function events
    assert not nvtx.is_enabled()


def test_nvtx_package_backend(fresh_nvtx):
    pytest.importorskip("nvtx")
    assert nvtx.backend_name() == "nvtx"
    with nvtx.recording():
        names = _profiled_range_names(_work)  # pushes and pops in domain "glm5" (a no-op without Nsight)
    assert "layer0/attn/core" in names


def test_nvtx_disabled_is_a_shared_noop(fresh_nvtx):
    nvtx.enable(False)
    assert nvtx.nvtx_range("a") is nvtx.nvtx_range("b")  # no object per call: one flag check
    names = _profiled_range_names(lambda: [nvtx.nvtx_range("layer0/mlp").__enter__(), torch.ones(2).sum()])
    assert "layer0/mlp" not in names
    assert nvtx.current_ranges() == ()


# ---------------------------------------------------------------- attribution and counting

def test_component_names_map_by_suffix():
    assert components.component_of("layer12/attn/indexer") == "indexer"
    assert components.component_of("mtp") == "MTP"
    assert components.component_of("layer3/mlp_norm") == "norms"
    assert components.component_of("norm") == "norms"
    assert components.component_of("layer3/mlp") == "dense MLP"
    assert components.component_of("layer3") is None
    assert components.innermost_component(("mtp", "layer9", "layer9/moe/experts")) == "experts"


def test_breakdown_self_time_and_backward(fresh_nvtx):
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(256, 64)

    def step():
        with torch.profiler.record_function(components.STEP_RANGE + "0"):
            with nvtx.nvtx_range("layer0/attn/core"):
                h = (x @ w).relu()
                with nvtx.nvtx_range("layer0/attn/topk"):
                    h = h @ w
            (h * 2).sum().backward()

    with nvtx.recording():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
    events = prof.events()
    bd = components.breakdown(events)
    step_ev = next(e for e in events if e.name.startswith(components.STEP_RANGE))
    core = next(e for e in events if e.name == "layer0/attn/core")
    topk = next(e for e in events if e.name == "layer0/attn/topk")
    dur = lambda e: e.time_range.end - e.time_range.start  # noqa: E731
    assert bd.step_us == pytest.approx(dur(step_ev))
    shares = sum(bd.share(n) for n in components.NAMES)
    assert shares == pytest.approx(1.0, abs=1e-9)
    # core's own time excludes the nested top-k range
    assert bd.forward_us["core attention"] == pytest.approx(dur(core) - dur(topk))
    assert bd.forward_us["top-k"] == pytest.approx(dur(topk))
    # the matmuls' backward ran outside every range, yet lands on their components
    assert bd.backward_us.get("core attention", 0) > 0 and bd.backward_us.get("top-k", 0) > 0


class _Ev:
    """A stand-in for torch.profiler's FunctionEvent (the fields breakdown reads)."""

    def __init__(self, name, start, end, *, thread=1, seq=-1, fwd_thread=0, device_us=0.0, children=()):
        self.name, self.thread, self.sequence_nr, self.fwd_thread = name, thread, seq, fwd_thread
        self.time_range = type("R", (), {"start": start, "end": end})()
        self.self_device_time_total = device_us
        self.cpu_children, self.cpu_parent = list(children), None
        for c in self.cpu_children:
            c.cpu_parent = self


def test_breakdown_device_time_includes_the_autograd_thread():
    # forward on thread 1 inside the step; CUDA backward on autograd's device thread 2
    mm = _Ev("aten::mm", 2, 3, seq=7, device_us=40.0)
    core = _Ev("layer0/attn/core", 1, 4, children=[mm])
    loose = _Ev("aten::add", 5, 6, device_us=5.0)
    step = _Ev(components.STEP_RANGE + "0", 0, 10, children=[core, loose])
    bwd_mm = _Ev("aten::mm", 8, 9, thread=2, device_us=80.0)
    bwd = _Ev("autograd::engine::evaluate_function: MmBackward0", 7, 9.5, thread=2, seq=7, fwd_thread=1,
              children=[bwd_mm])
    outside = _Ev("aten::mul", 20, 21, thread=2, device_us=1000.0)  # after the step: not counted
    bd = components.breakdown([step, core, mm, loose, bwd, bwd_mm, outside], device_time=True)
    assert bd.clock == "cuda kernel time"
    assert bd.step_us == 125.0
    assert bd.forward_us["core attention"] == 40.0 and bd.backward_us["core attention"] == 80.0
    assert bd.forward_us["other"] == 5.0


def test_op_counter_charges_flops_to_the_open_range(fresh_nvtx):
    a, b = torch.randn(32, 48), torch.randn(48, 16, requires_grad=True)
    counter = OpCounter(capture_layer=None)
    with nvtx.recording(), counter:
        with nvtx.nvtx_range("layer1/moe/experts"):
            y = torch.nn.functional.linear(a, b.T)
        with nvtx.nvtx_range("lm_head"):
            z = y.sum()
        z.backward()
    assert counter.flops["experts"] == 2 * 32 * 48 * 16 * 2  # forward + the weight gradient (a^T @ grad)
    assert counter.bytes["experts"] >= (32 * 48 + 48 * 16 + 32 * 16) * 4
    assert counter.flops.get("other", 0) == 0


def test_causal_pairs_and_crossover():
    assert causal_pairs(4, 4) == 10 and causal_pairs(2, 5) == 4 + 5
    assert causal_pairs(3, 1) == 1  # queries before the first key see none
    text, x = measure.crossover([512, 1024, 2048, 4096], [1, 2, 4, 8], [2, 3, 3, 4])  # dense, dsa
    assert "between 1024 and 2048" in text and 1024 < x < 2048
    assert measure.crossover([1, 2], [5, 6], [1, 2])[1] is None          # ahead everywhere
    assert "behind at every" in measure.crossover([1, 2], [1, 2], [5, 6])[0]


# ---------------------------------------------------------------- end to end

def _component_rows(report: str) -> dict:
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in components.NAMES:
            rows[cells[0]] = cells
    return rows


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_profile_tiny_end_to_end(tmp_path, capsys):
    main = cli_main()
    out = tmp_path / "tiny"
    assert main(["profile", "--preset", "tiny", "--seq", "64", "--steps", "1", "--warmup", "1", "--out", str(out),
                 "--sweep", "64,128"]) == 0
    printed = capsys.readouterr().out
    assert "step 1/1" in printed and "crossover (time)" in printed
    with open(out / "trace.json") as f:
        trace = json.load(f)  # valid Chrome trace JSON (what Perfetto loads)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"layer0/attn/indexer", "layer0/attn/core", "layer1/moe/experts", "lm_head"} <= names
    report = (out / "report.md").read_text()
    rows = _component_rows(report)
    assert set(rows) == set(components.NAMES)
    shares = [float(r[3].rstrip("%")) for r in rows.values()]
    assert sum(shares) == pytest.approx(100, abs=1)
    assert rows["indexer"][2] != "0.000" and rows["core attention"][2] != "0.000"
    assert "fused into indexer" in rows["top-k"][-1] and "fused into experts" in rows["dispatch"][-1]
    assert "MaxVio" in report and "mean recall" in report and "## Sweep: dsa vs dense" in report
    for png in ("components.png", "expert_load.png", "sweep_time.png", "sweep_memory.png"):
        assert _is_png(out / png), png
    data = json.loads((out / "report.json").read_text())
    assert data["flops"]["core attention"] > 0 and data["num_experts"] == 8


def test_profile_compiled_decode_keeps_the_components(tmp_path, capsys):
    """--compile: the measured steps run compile_decode()'s graph, whose component ranges
    survive compilation; the FLOP/byte count runs eager (a dispatch mode sees no compiled op)."""
    main = cli_main()
    out = tmp_path / "compiled"
    assert main(["profile", "--preset", "tiny", "--mode", "decode", "--seq", "32", "--steps", "1", "--warmup", "3",
                 "--compile", "--out", str(out)]) == 0
    assert "compile_decode()" in capsys.readouterr().out
    rows = _component_rows((out / "report.md").read_text())
    for name in ("indexer", "core attention", "experts", "LM head"):
        assert float(rows[name][2]) > 0, name
    data = json.loads((out / "report.json").read_text())
    assert data["flops"]["experts"] > 0 and data["flops"]["core attention"] > 0
    with pytest.raises(SystemExit) as exit_:
        main(["profile", "--preset", "tiny", "--mode", "prefill", "--compile", "--out", str(out)])
    assert exit_.value.code == 2 and "--compile: --mode decode only" in capsys.readouterr().err


def test_profile_train_unfused_rows(tmp_path):
    main = cli_main()
    out = tmp_path / "train"
    assert main(["profile", "--preset", "tiny", "--seq", "32", "--steps", "1", "--warmup", "0", "--mode", "train",
                 "--unfused", "--out", str(out)]) == 0
    rows = _component_rows((out / "report.md").read_text())
    assert sum(float(r[3].rstrip("%")) for r in rows.values()) == pytest.approx(100, abs=1)
    for name in ("top-k", "dispatch", "combine"):  # their own ranges when unfused
        assert float(rows[name][1]) > 0, name
    assert float(rows["experts"][4]) > 0  # backward time of the expert GEMMs, linked by sequence number


def test_inspect_is_registered(capsys):
    main = cli_main()
    with pytest.raises(SystemExit) as e:
        main(["inspect", "--help"])
    assert e.value.code == 0
    assert "usage: glm5-lab inspect" in capsys.readouterr().out
