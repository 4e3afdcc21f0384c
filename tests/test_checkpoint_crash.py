"""Crash and resume through glm5-lab train (scripts/crash_resume.py, the
CI-sized run): 2 gloo processes under torchrun, SIGKILLed once inside an
asynchronous save and once at a random moment, each resumed with --resume
to losses bit-identical to an uninterrupted run. The full 10 trials on 4
processes: python scripts/crash_resume.py --trials 10 --nproc 4."""
from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist

from profiling import cli

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import crash_resume  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def test_killed_runs_resume_bit_identically(tmp_path):
    out = tmp_path / "results.json"
    assert crash_resume.main(["--trials", "2", "--nproc", "2", "--steps", "6", "--json", str(out),
                              "--workdir", str(tmp_path)]) == 0


@pytest.mark.parametrize("flags,message", [
    (["--lora-router"], "--lora-router needs --lora RANK"),
    (["--async-save"], "--async-save needs --checkpoint-every N"),
    (["--resume", "nowhere"], "--resume: 'nowhere' holds no ckpt/ directory"),
])
def test_checkpoint_flags_are_checked(capsys, tmp_path, flags, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--out", str(tmp_path / "run"), *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
