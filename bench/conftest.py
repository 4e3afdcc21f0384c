"""pytest-benchmark set-up: ceilings in the machine info, and the lab's table
(ours vs baseline, ratios, fraction of ceiling) printed at the end."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import ceilings  # noqa: E402
import report  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def machine_ceilings() -> dict:
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    return {"device": DEVICE, "threads": torch.get_num_threads(),
            "matmul_gflops": round(ceilings.matmul_gflops(DEVICE, dtype), 1),
            "bandwidth_gbs": round(ceilings.bandwidth_gbs(DEVICE), 2)}


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["glm5_ceilings"] = machine_ceilings()


@pytest.fixture(scope="session")
def machine():
    return machine_ceilings()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    rows = [dict(group=b.group, name=b.name, fullname=b.fullname, median=b.stats.median, **b.extra_info)
            for b in session.benchmarks if b.stats is not None]
    terminalreporter.write_line("")
    terminalreporter.write_line(f"glm5 benchmark tables ({DEVICE}, ceilings: {machine_ceilings()})")
    terminalreporter.write_line(report.family_tables(rows, machine_ceilings()))
