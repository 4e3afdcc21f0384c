"""Expert parallelism on torch.distributed: the routed experts sharded over
the ranks of a process group, tokens moved to their experts and back with
all_to_all_single (gloo on CPU, NCCL on GPUs). Applied from outside the
layer (torchtitan's rule): the single-device layer is glm5_ops.fused_moe.

    lo, hi = expert_range(E, rank, world)            # rank owns experts [lo, hi)
    out = ep_fused_moe(x, w_gate_up[lo:hi], w_down[lo:hi], weights, ids, num_experts=E)

Each rank passes its own tokens (x [T_r, D], weights/ids [T_r, k] with global
expert ids) and its shard of the weights; out [T_r, D] equals the rows of
fused_moe(x_all, w_gate_up, w_down, weights_all, ids_all) for those tokens.
Steps: group the rank's (token, slot) pairs by destination rank (a stable
argsort of ids // (E / world)); exchange the counts (all_to_all_single of one
int64 per rank), then the rows and their local expert ids with the counts as
split sizes (gloo has no list-form all_to_all); run fused_moe on the received
rows with unit weights (one slot per row: expert outputs, not yet mixed);
send the outputs back the same way reversed; moe_combine mixes them with the
weights at home, so dweights never crosses the network.

Autograd: _AllToAll is differentiable (its backward is the reverse exchange),
x reaches the send buffer through index_select, and fused_moe / moe_combine
have their own backward; the expert weight gradients stay on their rank.
torch.distributed.nn.functional.all_to_all_single also differentiates on
gloo (checked on torch 2.14 with uneven splits); the 10-line Function here
allocates its own output and does not depend on that module's behaviour
staying the same across the torch releases the lab supports (2.11-2.14).

Launch (one process per rank; MASTER_ADDR/PORT set by torchrun):
    torchrun --nproc_per_node=2 -m glm5_ops.expert_parallel     # self-check vs the single-process layer
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from . import moe


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """The experts [lo, hi) that `rank` owns: contiguous equal shards."""
    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the world size {world}")
    n = num_experts // world
    return rank * n, (rank + 1) * n


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with split sizes; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


def all_to_all(x, out_splits: list[int], in_splits: list[int], group=None):
    """Differentiable all_to_all_single: rows [sum(in_splits)] -> [sum(out_splits)]."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def ep_fused_moe(x, w_gate_up_local, w_down_local, weights, ids, *, num_experts: int, group=None):
    """fused_moe with the experts sharded over `group` (default: the world).

    x [T, D] this rank's tokens; w_gate_up_local [E/world, 2I, D] and
    w_down_local [E/world, D, I] this rank's experts (expert_range); weights
    [T, k]; ids [T, k] global expert ids in [0, num_experts). Returns [T, D].
    Every rank must call it (a collective), even with T = 0."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lo, hi = expert_range(num_experts, rank, world)
    if w_gate_up_local.dim() != 3 or w_gate_up_local.shape[0] != hi - lo:
        raise ValueError(f"w_gate_up_local must hold this rank's {hi - lo} experts [E/world,2I,D], "
                         f"got shape {tuple(w_gate_up_local.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"ids and weights must have shape [T={x.shape[0]},k], got {tuple(ids.shape)} "
                         f"and {tuple(weights.shape)}")
    moe._ids_in_range(ids, num_experts, "ids", f"global expert ids of num_experts={num_experts}")
    T, k = ids.shape
    per_rank = hi - lo
    flat = ids.reshape(-1).long()
    dest = flat // per_rank
    order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank, (token, slot) order inside
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()

    local_ids = (flat[order] - dest[order] * per_rank).to(torch.int32)
    ids_recv = local_ids.new_empty(sum(recv))
    dist.all_to_all_single(ids_recv, local_ids, recv, send, group=group)
    x_recv = all_to_all(x.index_select(0, order // k), recv, send, group)

    # The experts' outputs for the received rows, unmixed (unit weight, one slot per row).
    ones = torch.ones(len(ids_recv), 1, dtype=torch.float32, device=x.device)
    y_recv = moe.fused_moe(x_recv, w_gate_up_local, w_down_local, ones, ids_recv[:, None])
    y_back = all_to_all(y_recv, send, recv, group)  # row i: the output for pair order[i]

    token_slot = torch.empty_like(order)
    token_slot[order] = torch.arange(T * k, device=order.device)
    return moe.moe_combine(y_back, token_slot.reshape(T, k).to(torch.int32), weights)


# ------------------------------------------------ torchrun self-check --

def _check(x, wgu, wd, weights, ids, dout, group=None) -> float:
    """Max relative error of this rank's out, dx, dweights and expert-weight
    grads against the single-process layer on the whole batch (inputs: the
    whole batch, identical on every rank)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    E = wgu.shape[0]
    lo, hi = expert_range(E, rank, world)
    t0, t1 = rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world  # uneven token shards

    full = [t.clone().requires_grad_() for t in (x, wgu, wd, weights)]
    moe.fused_moe(*full, ids).backward(dout)
    ref = [full[0].grad[t0:t1], full[1].grad[lo:hi], full[2].grad[lo:hi], full[3].grad[t0:t1]]

    mine = [x[t0:t1].clone().requires_grad_(), wgu[lo:hi].clone().requires_grad_(),
            wd[lo:hi].clone().requires_grad_(), weights[t0:t1].clone().requires_grad_()]
    out = ep_fused_moe(mine[0], mine[1], mine[2], mine[3], ids[t0:t1], num_experts=E, group=group)
    out.backward(dout[t0:t1])
    with torch.no_grad():
        want_out = moe.fused_moe(x, wgu, wd, weights, ids)[t0:t1]
    errs = [(out.detach(), want_out)] + list(zip([m.grad for m in mine], ref))
    return max(float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.numel() else 0.0 for a, b in errs)


def main() -> int:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if backend == "nccl" else "cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    worst = 0.0
    # (T, D, I, E, k, kind): odd sizes and uneven shards; "home": every token picks rank 0's
    # experts only, so the other ranks receive no row and their expert grads are zero.
    for T, D, I, E, k, kind in [(37, 24, 10, 8, 3, "random"), (16, 16, 8, 4 * world, 2, "home"),
                                (5, 12, 6, 2 * world, 4, "random")]:
        g = torch.Generator().manual_seed(T * 131 + E)
        x = torch.randn(T, D, generator=g)
        wgu = torch.randn(E, 2 * I, D, generator=g) * D ** -0.5
        wd = torch.randn(E, D, I, generator=g) * I ** -0.5
        weights = torch.rand(T, k, generator=g)
        hi = E // world if kind == "home" else E
        ids = torch.randint(0, hi, (T, k), generator=g, dtype=torch.int32)
        dout = torch.randn(T, D, generator=g)
        args = [t.to(device) for t in (x, wgu, wd, weights, ids, dout)]
        worst = max(worst, _check(*args))
    verdict = torch.tensor([worst], device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"expert_parallel self-check: {world} ranks ({backend}), max rel err {float(verdict):.2e}")
    dist.destroy_process_group()
    return 0 if float(verdict) <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
