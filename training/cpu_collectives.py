"""FSDP2's all-gather and reduce-scatter on gloo (CPU processes), built from
broadcasts and reduces that work in place.

gloo's own all_gather_into_tensor and reduce_scatter_tensor stage the whole
unsharded buffer in a temporary of their own: one more copy of an FSDP unit
per collective (a `small` preset MoE layer: +216 MB each), and slower (4
processes, 216 MiB, quiet machine: reduce-scatter 581 ms, all-gather 386 ms,
against 288 ms and 163 ms here; bench/gloo_collectives.py). Here:

- all-gather: every rank broadcasts its shard straight into its row of the
  flat output (FSDP2's copy-in already put it there): no temporary; async
  (FSDP2's prefetch) returns one Work that waits for the broadcasts.
- reduce-scatter: a reduce of row r (each rank's gradient for rank r's shard)
  to rank r, for every r, in place; this rank's row is then the reduced
  shard. The rows are scratch for gloo (the input is FSDP2's copy of the
  gradients, never read again), and once the reduces are done the input's
  memory is released at once: FSDP2 keeps a reference to it until the next
  unit's reduce-scatter, for CUDA streams; on CPU the collective has returned.

    use_inplace_gloo_collectives(model, "cpu")    # after fully_shard, on a CPU mesh

The sums are the same (fp32, each element summed over the ranks by gloo); the
order of the additions may differ from gloo's reduce_scatter's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class _Works(dist.Work):
    """Several async collectives' Works as one (FSDP2 waits for one Work per all-gather)."""

    def __init__(self, works: list):
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


def _rows(flat: torch.Tensor, group) -> tuple[torch.Tensor, list[int]]:
    ranks = dist.get_process_group_ranks(group)
    if flat.numel() % len(ranks):
        raise ValueError(f"a flat buffer of {flat.numel()} elements does not split over {len(ranks)} ranks")
    return flat.view(len(ranks), -1), ranks


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """output [world * n] = every rank's input [n], in rank order, without a staging copy."""
    rows, ranks = _rows(output, group)
    mine = rows[dist.get_rank(group)]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input)
    works = [dist.broadcast(rows[i], src=src, group=group, async_op=True) for i, src in enumerate(ranks)]
    work = _Works(works)
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group, op) -> None:
    """output [n] = the sum (or mean, op AVG) over ranks of row `rank` of input [world * n].
    Overwrites input (gloo's scratch)."""
    rows, ranks = _rows(input, group)
    average = op == dist.ReduceOp.AVG
    reduce_op = dist.ReduceOp.SUM if average else op
    works = [dist.reduce(rows[i], dst=dst, op=reduce_op, group=group, async_op=True) for i, dst in enumerate(ranks)]
    for w in works:
        w.wait()
    mine = rows[dist.get_rank(group)]
    if average:
        torch.div(mine, len(ranks), out=output)
    else:
        output.copy_(mine)


class InplaceAllGather(AllGather):
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return all_gather_into(output_tensor, input_tensor, group, async_op)


class InplaceReduceScatter(ReduceScatter):
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if async_op:
            raise ValueError("InplaceReduceScatter runs synchronously (async_op must be False)")
        reduce_scatter_into(output_tensor, input_tensor, group, op)
        input_tensor.untyped_storage().resize_(0)   # done with; FSDP2 would hold it until the next unit's
        return None


def use_inplace_gloo_collectives(model: torch.nn.Module, device_type: str) -> None:
    """Every FSDP2 unit of `model` gathers and reduces with the collectives above (CPU processes only)."""
    if device_type != "cpu":
        raise ValueError(f"use_inplace_gloo_collectives is for CPU (gloo) meshes, got device_type={device_type!r}: "
                         "its reduce-scatter frees its input when the call returns, before a GPU stream has run it")
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_custom_all_gather(InplaceAllGather())
            unit.set_custom_reduce_scatter(InplaceReduceScatter())
