"""bench/device_run.py's test phase, on the CPU: the per-backend shards of a file
partition its tests (none lost, none run twice), and the results plugin reports
every outcome, a collection error included, so the summary misses nothing; and
bench/triton_compile_check.py, the pre-flight check, finds a kernel that does not compile."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)
from device_pytest import shard_results, shards  # noqa: E402


def _pytest(args, results=None, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (BENCH, os.environ.get("PYTHONPATH")) if p))
    env.pop("GLM5_PYTEST_RESULTS", None)
    if results:
        env["GLM5_PYTEST_RESULTS"] = results
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _collected(args):
    out = _pytest(["--collect-only", "-q", *args])
    assert out.returncode in (0, 5), out.stdout[-2000:] + out.stderr[-2000:]
    return {ln for ln in out.stdout.splitlines() if "::" in ln}


def test_backend_shards_partition_a_file(tmp_path):
    jobs = shards("tests/test_topk.py", str(tmp_path), 60, [])
    assert [j.name for j in jobs] == ["test_topk[cpp]", "test_topk[triton]", "test_topk[other]"]
    everything = _collected(["tests/test_topk.py"])
    parts = [_collected(["tests/test_topk.py", "-k", j.cmd[j.cmd.index("-k") + 1]]) for j in jobs]
    assert set.union(*parts) == everything and sum(map(len, parts)) == len(everything)
    assert all(parts[:2]), "the cpp and triton shards must not be empty"
    assert jobs[0].needs_build and not jobs[1].needs_build   # the Triton shard starts during the build


PROBE = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup broke")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

def test_skips():
    pytest.skip("not here")

def test_setup_error(broken):
    pass
'''


def test_results_plugin_reports_every_outcome(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "test_unimportable.py").write_text("import no_such_module_glm5\n")
    results = str(tmp_path / "results.jsonl")
    for name in ("test_probe.py", "test_unimportable.py"):   # a collection error stops the whole run: one each
        _pytest(["-p", "pytest_results", name], results, cwd=str(tmp_path))
    with open(results) as f:
        got = {r["nodeid"].split("::")[-1]: r for r in map(json.loads, f)}
    assert {k: r["outcome"] for k, r in got.items()} == {
        "test_passes": "passed", "test_fails": "failed", "test_skips": "skipped", "test_setup_error": "error",
        "test_unimportable.py": "error"}
    assert "one is not two" in got["test_fails"]["message"]
    assert got["test_unimportable.py"]["when"] == "collect"


@pytest.mark.parametrize("end,want_failures", [("ok", 0), ("exit 5", 0), ("time limit", 2), ("exit 1", 1)])
def test_shard_summary_flags_unfinished_shards(tmp_path, end, want_failures):
    job = shards("tests/test_build.py", str(tmp_path), 60, [])[0]
    with open(job.results, "w") as f:
        f.write(json.dumps({"nodeid": "t.py::a", "outcome": "passed", "when": "call", "seconds": 1, "message": ""})
                + "\n")
        if end in ("time limit", "exit 1"):
            f.write(json.dumps({"nodeid": "t.py::b", "outcome": "failed", "when": "call", "seconds": 1,
                                "message": "boom"}) + "\n")
    job.end, job.wall = end, 3.0
    r = shard_results(job)
    assert r["passed"] == 1 and len(r["failures"]) == want_failures
    if end == "time limit":
        assert "the tests after its last result are missing" in r["failures"][-1]


KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def doubles(x_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) * 2, mask=offs < N)


@triton.jit
def reshapes_a_carried_value(x_ptr, N, BLOCK: tl.constexpr):
    v = tl.zeros([BLOCK], tl.float32)
    for i in range(0, N):
        if i >= 0:   # the interpreter lets a loop-carried value change shape; the compiler does not
            v = tl.zeros([2 * BLOCK], tl.float32)
    tl.store(x_ptr + tl.arange(0, 2 * BLOCK), v)
'''

LAUNCHES = '''
import torch
import probe_kernels


def test_launch():
    x = torch.ones(64)
    probe_kernels.doubles[(1,)](x, 40, BLOCK=64)
    probe_kernels.reshapes_a_carried_value[(1,)](x, 2, BLOCK=16)
'''


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_compile_check_finds_a_kernel_the_interpreter_runs(tmp_path):
    """bench/triton_compile_check.py: both probe kernels run under the interpreter;
    compiled for sm_90 (no GPU), the one whose loop-carried value changes shape fails."""
    (tmp_path / "probe_kernels.py").write_text(KERNELS)
    (tmp_path / "test_probe_launches.py").write_text(LAUNCHES)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    env.pop("TRITON_INTERPRET", None)
    launches = str(tmp_path / "launches.jsonl")
    tool = os.path.join(BENCH, "triton_compile_check.py")
    rec = subprocess.run([sys.executable, tool, "record", launches, str(tmp_path / "test_probe_launches.py")],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert rec.returncode == 0 and "recorded 2 distinct launches" in rec.stdout, rec.stdout[-2000:] + rec.stderr[-2000:]
    out = subprocess.run([sys.executable, tool, "compile", launches], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "1 of 2 launches compiled for sm_90" in out.stdout
    assert "FAIL reshapes_a_carried_value" in out.stdout and "FAIL doubles" not in out.stdout


def test_server_tests_left_out_without_their_packages(monkeypatch, tmp_path):
    import device_run
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openai" else real(name, *a))
    skip = device_run.server_tests_to_skip()
    assert skip == device_run.SERVER_TESTS
    names = {j.name for j in shards("tests/test_server_api.py,tests/test_int8_serving.py,tests/test_build.py",
                                    str(tmp_path), 60, [], exclude=skip)}
    assert names == {"test_build"}
    monkeypatch.setattr(importlib.util, "find_spec", real)
    present = all(real(m) is not None for m in device_run.SERVER_PACKAGES)
    assert device_run.server_tests_to_skip() == ([] if present else device_run.SERVER_TESTS)
