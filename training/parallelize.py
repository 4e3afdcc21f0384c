"""GLM-5 across processes, applied from outside the single-device model in
torchtitan's order: tensor parallelism, then expert parallelism, then FSDP2.
Pipeline parallelism (which layers a process holds) is training/pipeline.py.

    dims = ParallelDims(dp_shard=2, tp=2, pp=1, ep=1)
    dims.validate(config, world_size)              # before any process does work
    mesh = dims.build_mesh("cpu")                  # dims ("pp", "dp_shard", "ep", "tp"); "dp" = dp_shard x ep
    parallelize(model, mesh, dims)

The mesh: every rank holds one stage (pp), one slice of the batch ("dp",
dp_shard x ep flattened: expert parallelism borrows data-parallel ranks, as
in torchtitan) and one slice of the heads (tp).
- TP (DTensor, `parallelize_module`): per MLA layer q_b_proj and kv_b_proj
  colwise (whole heads: tp must divide the heads), o_proj rowwise; the dense
  MLP and the shared expert colwise (gate, up) then rowwise (down). MLA runs
  absorbed: it reads kv_b_proj's weight directly (W_UK, W_UV) instead of
  calling the module, so that weight is read as the process's local heads,
  and the layer's head count becomes H/tp. The latent keys feed every head,
  so their gradient is summed over tp (Megatron's "f" on kv_a_proj_with_mqa's
  output). The indexer, router and routed experts stay replicated over tp.
- EP: each MoE layer keeps E/ep routed experts (plain tensors, this rank's
  shard) and runs glm5_ops.expert_parallel.ep_fused_moe over the "ep" group.
- FSDP2 (`fully_shard`, MixedPrecisionPolicy): the embedding, each decoder
  layer, the LM head, then the root, sharded over "dp" (on CPU with
  training/cpu_collectives.py's in-place all-gather and reduce-scatter); the
  routed experts of each MoE layer form a unit of their own inside the
  layer's, over "dp_shard" (they differ across ep; with ep > 1 their
  gradient is divided by the whole data-parallel size, as it already sums
  the ep ranks' tokens). Overlap (set_prefetch): each unit's all-gather is
  issued asynchronously ahead of its use, at most one experts unit gathered
  at a time; with it off each is issued when the unit is reached and waited
  for at once (the same units either way).
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from glm5_ops.expert_parallel import ep_fused_moe, expert_range
from models.glm5.config import GLM5Config
from models.glm5.moe import Experts, MoE
from training.cpu_collectives import use_inplace_gloo_collectives

MESH_DIMS = ("pp", "dp_shard", "ep", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data-parallel sharding, tensor, pipeline and expert parallelism."""
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("dp_shard", "tp", "pp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.dp_shard * self.tp * self.pp * self.ep

    @property
    def data_parallel(self) -> int:
        """Processes that see different samples: dp_shard x ep."""
        return self.dp_shard * self.ep

    def validate(self, config: GLM5Config, world_size: int) -> None:
        """Raises ValueError for a mesh this model and world cannot use (call before any work)."""
        if self.world_size != world_size:
            raise ValueError(f"dp_shard x tp x pp x ep = {self.dp_shard} x {self.tp} x {self.pp} x {self.ep} = "
                             f"{self.world_size} must equal the world size {world_size}")
        c = config
        if c.num_attention_heads % self.tp:
            raise ValueError(f"tp={self.tp} must divide num_attention_heads={c.num_attention_heads} "
                             "(tensor parallelism splits whole heads)")
        for name, width in (("intermediate_size", c.intermediate_size),
                            ("moe_intermediate_size x n_shared_experts", c.moe_intermediate_size * c.n_shared_experts)):
            if width % self.tp:
                raise ValueError(f"tp={self.tp} must divide {name}={width} (the dense MLP and shared expert split "
                                 "their hidden width)")
        if c.n_routed_experts % self.ep:
            raise ValueError(f"ep={self.ep} must divide n_routed_experts={c.n_routed_experts}")
        if self.pp > c.num_hidden_layers:
            raise ValueError(f"pp={self.pp} must be at most the layer count num_hidden_layers={c.num_hidden_layers}")

    def build_mesh(self, device_type: str) -> "ParallelMesh":
        """The world as a (pp, dp_shard, ep, tp) mesh, with "dp" = dp_shard x ep flattened."""
        mesh = init_device_mesh(device_type, (self.pp, self.dp_shard, self.ep, self.tp), mesh_dim_names=MESH_DIMS)
        return ParallelMesh(mesh, mesh["dp_shard", "ep"]._flatten("dp"))


class ParallelMesh:
    """The (pp, dp_shard, ep, tp) DeviceMesh, indexed by dim name, plus the
    flattened "dp" (torch wants a flattened dim kept, not sliced from the root again)."""

    def __init__(self, root: DeviceMesh, dp: DeviceMesh):
        self.root, self.dp = root, dp

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.dp if name == "dp" else self.root[name]


def data_rank(mesh: ParallelMesh) -> int:
    """Which slice of the batch this process reads (its coordinate on "dp")."""
    return mesh["dp"].get_local_rank()


# ------------------------------------------------------------------ TP --

class _LocalHeadsLinear(nn.Linear):
    """kv_b_proj under TP. MLA multiplies by its weight directly (W_UK, W_UV
    of the absorbed form) instead of calling the module, so while the layer's
    forward runs `.weight` reads as this process's heads (a differentiable
    to_local). Outside it (FSDP2 and everything else) `.weight` is the
    parameter: a DTensor sharded by head."""
    _local = False

    @property
    def weight(self):
        w = self._parameters["weight"]
        return w.to_local() if self._local and isinstance(w, DTensor) else w


def _read_local_heads(attn: nn.Module) -> None:
    proj = attn.kv_b_proj
    proj.__class__ = _LocalHeadsLinear

    def enter(_module, _inputs):
        proj._local = True

    def leave(_module, _inputs, _out):
        proj._local = False
    attn.register_forward_pre_hook(enter)
    attn.register_forward_hook(leave, always_call=True)


class SumGradOverTP(ParallelStyle):
    """Identity forward; backward sums the gradient of the output's channels
    [start:] over the tp group (Megatron's "f"): a replicated activation that
    each process's heads read only in part."""

    def __init__(self, start: int = 0):
        super().__init__()
        self.start = start

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def f(t):
            return DTensor.from_local(t, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])

        def hook(_module, _inputs, out):
            if self.start == 0:
                return f(out)
            return torch.cat([out[..., :self.start], f(out[..., self.start:])], dim=-1)
        module.register_forward_hook(hook)
        return module


def _mlp_plan(prefix: str) -> dict:
    return {f"{prefix}.gate_proj": ColwiseParallel(), f"{prefix}.up_proj": ColwiseParallel(),
            f"{prefix}.down_proj": RowwiseParallel()}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    tp = tp_mesh.size()
    for layer in model.model.layers.values():
        attn = layer.self_attn
        plan = {"self_attn.q_b_proj": ColwiseParallel(), "self_attn.kv_b_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(),
                # The keys every head reads: the normed latent, then k_rot (kv_a_proj's last channels).
                "self_attn.kv_a_layernorm": SumGradOverTP(),
                "self_attn.kv_a_proj_with_mqa": SumGradOverTP(start=attn.kv_lora)}
        plan.update(_mlp_plan("mlp.shared_experts" if isinstance(layer.mlp, MoE) else "mlp"))
        parallelize_module(layer, tp_mesh, plan)
        _read_local_heads(attn)
        attn.n_heads //= tp


# ------------------------------------------------------------------ EP --

class ExpertParallelMoE(MoE):
    """MoE whose routed experts are this rank's E/ep shard: MoE.forward calls
    the experts module (so FSDP2 gathers it like any unit), whose forward
    apply_ep replaces with ep_fused_moe, which moves tokens to their experts'
    ranks and back. The unfused path would run only the local shard's experts."""

    def _unfused(self, h, weights, ids):
        return self.experts(h, weights, ids)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, scale: float):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _ep_experts_forward(experts, h, weights, ids):
    # An expert's gradient sums the tokens of all ep ranks (each loss a mean
    # over its own tokens), and data parallelism then averages over dp_shard
    # only: 1/ep makes it the mean over the whole batch, like every other
    # parameter's. (FSDP2's set_gradient_divide_factor would say this, but
    # its PREMUL_SUM reduction does not exist on gloo.)
    scale = 1.0 / dist.get_world_size(experts.ep_group)
    w_gate_up, w_down = (_ScaleGrad.apply(w, scale) for w in (experts.gate_up_proj, experts.down_proj))
    return ep_fused_moe(h, w_gate_up, w_down, weights, ids, num_experts=experts.num_experts, group=experts.ep_group)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    group, rank, ep = ep_mesh.get_group(), ep_mesh.get_local_rank(), ep_mesh.size()
    for layer in model.model.layers.values():
        if not isinstance(layer.mlp, MoE):
            continue
        experts = layer.mlp.experts
        E = experts.gate_up_proj.shape[0]
        lo, hi = expert_range(E, rank, ep)
        experts.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[lo:hi].clone())
        experts.down_proj = nn.Parameter(experts.down_proj.detach()[lo:hi].clone())
        experts.num_experts, experts.ep_group, experts.ep_range = E, group, (lo, hi)
        experts.forward = types.MethodType(_ep_experts_forward, experts)
        layer.mlp.__class__ = ExpertParallelMoE


# ---------------------------------------------------------------- FSDP --

def apply_fsdp(model: nn.Module, mesh: "ParallelMesh", dims: ParallelDims, *, param_dtype=None,
               reduce_dtype=torch.float32, overlap: bool = True) -> None:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Several pipeline micro-batches run forward before any backward: keep the
    # layers gathered between them rather than gathering each one K times.
    reshard = dims.pp == 1
    layers = list(model.model.layers.values())
    embed, head = model.model.embed_tokens, model.lm_head
    # The embedding and the LM head are units of their own (not the root's):
    # gathered, they are 2 x vocab x hidden, which the root would hold from
    # the first layer's forward to the end of backward. The head stays
    # gathered after forward: backward starts with it. A tied head shares
    # the embedding's parameter, so both stay in the root then.
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None and not tied:
        fully_shard(embed, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    # A MoE layer's routed experts are a unit of their own inside the layer's
    # (they are ~93% of a `small` MoE layer): their gradients are reduced and
    # their gathered weights freed as soon as their backward ends, before the
    # attention's, and the unit gathered ahead of them is the next layer's
    # small rest, not a whole layer. Over "dp_shard": they differ across ep.
    # The unfused path (model.fused False, no ep) indexes the experts' weights
    # without calling the module, which FSDP2 must see to gather them: those
    # experts stay in the layer's unit.
    split_experts = dims.ep > 1 or getattr(model, "fused", True)
    for layer in layers:
        if split_experts and isinstance(layer.mlp, MoE):
            layer.mlp.experts._is_routed_experts = True
            fully_shard(layer.mlp.experts, mesh=mesh["dp_shard"], mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    if head is not None and not tied:
        fully_shard(head, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    if mesh["dp"].device_type == "cpu":
        use_inplace_gloo_collectives(model, "cpu")
    if reshard:
        set_prefetch(model, overlap)


def _units(root) -> list[nn.Module]:
    """root's FSDP units below it in the order forward reaches them: the
    embedding, each layer followed by its experts unit (entered inside the
    layer's forward), the LM head."""
    inner = root.model
    units = [inner.embed_tokens]
    for layer in inner.layers.values():
        units += [layer, getattr(layer.mlp, "experts", None)]
    units.append(root.lm_head)
    return [u for u in units if isinstance(u, FSDPModule)]


def _is_experts(unit) -> bool:
    """A MoE layer's routed experts (an Experts, or what replaced it: a quantised model swaps the module)."""
    return isinstance(unit, Experts) or getattr(unit, "_is_routed_experts", False)


def _backward_order(units: list[nn.Module]) -> list[nn.Module]:
    """The order backward reaches the units' pre-backward hooks: a layer's
    (on its output) fires before its experts' (on theirs, inside it), so
    each (layer, experts) pair keeps its forward order while the layers reverse."""
    groups: list[list[nn.Module]] = []
    for u in units:
        if _is_experts(u) and groups:
            groups[-1].append(u)
        else:
            groups.append([u])
    return [u for g in reversed(groups) for u in g]


def _gather_after_backward(experts: FSDPModule):
    """A forward pre-hook for a MoE layer: when the gradient of its input is
    complete (its experts' backward and reduce-scatter done), start gathering
    `experts` (the previous MoE layer's), which then overlaps the attention's
    backward. FSDP2 waits for it in the experts' pre-backward. In a recompute
    (memory policy) the hook lands on a tensor whose gradient never comes: harmless."""
    def gather(_grad):
        experts.unshard(async_op=True)   # FSDP2 keeps the pending gather; the handle is not needed

    def pre_hook(_mlp, args):
        x = args[0]
        if torch.is_grad_enabled() and x.requires_grad:
            x.register_hook(gather)
    return pre_hook


def set_prefetch(root, on: bool) -> None:
    """on: a unit's all-gather is issued asynchronously ahead of its use and
    waited for only when the unit runs (async_op collectives: on gloo in
    gloo's own threads, on NCCL on FSDP2's streams). off: each unit is
    gathered when it is reached and the process waits (on CUDA FSDP2's
    implicit prefetch still overlaps it; on CPU its streams are no-ops).

    Forward: a layer's pre-forward gathers its experts (needed after its
    attention) and the next layer's rest; experts units prefetch nothing, so
    a recompute in backward (memory policy), which reruns their forward
    hooks, gathers no other unit. Backward: each unit gathers the next one
    backward reaches (the head the last layer, a layer its experts, experts
    the previous layer's rest), and a MoE layer's experts are gathered once
    the next MoE layer's MLP backward is done (its experts reduced and
    freed), during that layer's attention backward. So no experts unit is
    gathered while another computes: the backward peak holds one MoE
    layer's gathered experts and their unsharded gradients (2 x 201 MiB at
    `small`), not a prefetched whole layer besides. Gathering the previous
    experts during the current experts' backward would hide more of it, for
    201 MiB of peak. FSDP2 issues the reduce-scatters blocking: on CUDA on a
    stream of their own, which overlaps; on gloo the backward waits for
    each. Can be switched between steps (the benchmark alternates)."""
    units = _units(root)
    root.set_modules_to_forward_prefetch(units[:1] if on else [])
    for i, unit in enumerate(units):
        ahead: list[nn.Module] = []
        if on and not _is_experts(unit):
            for nxt in units[i + 1:]:
                ahead.append(nxt)
                if not _is_experts(nxt):
                    break
        unit.set_modules_to_forward_prefetch(ahead)
    backward = _backward_order(units)
    root.set_modules_to_backward_prefetch(backward[:1] if on else [])
    for i, unit in enumerate(backward):
        unit.set_modules_to_backward_prefetch(backward[i + 1:i + 2] if on else [])
    for handle in getattr(root, "_experts_prefetch_hooks", []):
        handle.remove()
    root._experts_prefetch_hooks = []
    if on:
        moe = [layer.mlp for layer in root.model.layers.values()
               if isinstance(getattr(layer.mlp, "experts", None), FSDPModule)]
        root._experts_prefetch_hooks = [later.register_forward_pre_hook(_gather_after_backward(earlier.experts))
                                        for earlier, later in zip(moe, moe[1:])]
    root._set_unshard_async_op(on)   # every FSDP unit under root


def parallelize(model: nn.Module, mesh: "ParallelMesh", dims: ParallelDims, *, param_dtype=None,
                overlap: bool = True) -> nn.Module:
    """Applies TP, EP, then FSDP2 (where data parallelism is > 1) to `model` in
    place: a GLM5ForCausalLM whose layers are a ModuleDict (training/pipeline.py)."""
    if not isinstance(model.model.layers, nn.ModuleDict):
        raise TypeError("parallelize needs model.model.layers as a ModuleDict (training.pipeline.keep_layers)")
    if dims.tp > 1:
        apply_tp(model, mesh["tp"])
    if dims.ep > 1:
        apply_ep(model, mesh["ep"])
    if dims.data_parallel > 1:
        apply_fsdp(model, mesh, dims, param_dtype=param_dtype, overlap=overlap)
    return model
