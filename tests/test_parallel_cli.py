"""glm5-lab train: bad meshes refused before any process group exists, one
process run, and a 2-process torchrun run writing metrics.jsonl."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from models.glm5 import GLM5ForCausalLM
from models.glm5.config import preset
from profiling import cli
from training.parallelize import ParallelDims
from training.pipeline import split_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_RUN = ["--preset", "tiny", "--steps", "2", "--seq", "32", "--batch", "4", "--corpus-mib", "0.1",
             "--eval-batches", "1", "--threads", "1", "--device", "cpu"]


@pytest.mark.parametrize("world,flags,message", [
    (4, ["--dp-shard", "2"], "must equal the world size 4"),
    (3, ["--tp", "3"], "tp=3 must divide num_attention_heads=4"),
    (4, ["--pp", "4"], "pp=4 must be at most the layer count num_hidden_layers=3"),
    (3, ["--ep", "3"], "ep=3 must divide n_routed_experts=8"),
    (2, ["--dp-shard", "2", "--batch", "3"], "--batch 3 must divide into dp_shard x ep = 2"),
    (2, ["--pp", "2", "--micro-batches", "1"], "--micro-batches 1 must be at least --pp 2"),
])
def test_bad_mesh_is_refused_before_any_work(monkeypatch, capsys, tmp_path, world, flags, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--out", str(tmp_path / "run"), *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def test_unknown_preset_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--preset", "huge", "--out", str(tmp_path)])
    assert e.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err


def test_parallel_dims_name_the_bad_argument():
    with pytest.raises(ValueError, match="ep must be a positive int, got 0"):
        ParallelDims(ep=0)
    with pytest.raises(ValueError, match="tp=8 must divide num_attention_heads=4"):
        ParallelDims(tp=8).validate(preset("tiny"), 8)


def test_split_layers_balances_and_refuses_shared_stage_starts():
    config = preset("tiny").replace(num_hidden_layers=5, indexer_types=["full", "shared", "full", "shared", "full"])
    assert split_layers(config, 1) == [range(0, 5)]
    assert split_layers(config, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(ValueError, match="starts stage 1 at layer 1, whose indexer is 'shared'"):
        split_layers(config, 5)


def _rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_one_process_run_writes_metrics(tmp_path, capsys):
    assert cli.main(["train", *SMALL_RUN, "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows[:2]] == [0, 1] and all(r["tokens_per_s"] > 0 for r in rows[:2])
    assert 0 < rows[2]["held_out_loss"] < 10
    assert "[train] step    1" in capsys.readouterr().out


def test_torchrun_two_processes_match_one(tmp_path):
    """dp_shard=2 under torchrun: rank 0 writes the metrics, FSDP2 reduce-scatters, and the
    losses, held-out loss and checkpoint are the one-process command's."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "profiling",
           "train", *SMALL_RUN, "--dp-shard", "2", "--out", str(tmp_path / "two")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    assert cli.main(["train", *SMALL_RUN, "--out", str(tmp_path / "one")]) == 0
    two, one = _rows(tmp_path / "two"), _rows(tmp_path / "one")
    assert two[0]["collectives"].get("reduce_scatter", 0) > 0
    for a, b in zip(two, one):
        got, want = a.get("loss", a.get("held_out_loss")), b.get("loss", b.get("held_out_loss"))
        assert abs(got - want) <= 1e-5 * abs(want), (two, one)
    # both checkpoints load, hold the same weights, and give the same logits
    models = [GLM5ForCausalLM.from_pretrained(str(tmp_path / run / "checkpoint"), verbose=False)
              for run in ("two", "one")]
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [m(ids) for m in models]
    assert (logits[0] - logits[1]).norm() <= 1e-5 * logits[1].norm()
