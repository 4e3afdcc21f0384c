"""Pipeline parallelism for GLM-5 with torch.distributed.pipelining, and the
training forward every process runs (one stage of the pipeline, or the
whole model when pp = 1).

A stage is the GLM5ForCausalLM itself with what it does not run removed, as
torchtitan does: the decoder layers move from the nn.ModuleList to an
nn.ModuleDict keyed by their global index ("0", "1", ...), which is exactly
the name a ModuleList gives them, so every parameter keeps its checkpoint
name (model.layers.2.mlp.experts.down_proj on whichever stage holds layer 2)
and state dicts of the stages merge by plain union. Deleting entries from
the ModuleList instead would renumber them (stage 1's first layer would
become model.layers.0) and need a name map on every save and load. The
first stage keeps the embedding, the last the final norm and the LM head;
the MTP head is not trained here and is dropped.

The model's own forward iterates the ModuleList, so the stage gets its own
(`stage_forward`, set as the instance's forward): input ids or the previous
stage's hidden states in, hidden states or logits out. A layer whose indexer
is "shared" reuses the previous layer's selection, which does not cross a
stage boundary: split_layers refuses to start a stage on one.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from glm5_ops.nvtx import nvtx_range
from models.glm5.config import GLM5Config
from models.glm5.model import ForwardContext, Segment


def split_layers(config: GLM5Config, pp: int) -> list[range]:
    """The layers of each stage: contiguous, sizes differing by at most one (earlier stages larger)."""
    L = config.num_hidden_layers
    if not isinstance(pp, int) or not 1 <= pp <= L:
        raise ValueError(f"pp must be an int in [1, num_hidden_layers={L}], got {pp!r}")
    base, extra = divmod(L, pp)
    stages, start = [], 0
    for s in range(pp):
        n = base + (s < extra)
        stages.append(range(start, start + n))
        start += n
    for s, r in enumerate(stages[1:], 1):
        if config.indexer_types[r.start] == "shared":
            raise ValueError(f"pp={pp} starts stage {s} at layer {r.start}, whose indexer is 'shared' (it reuses "
                             "the previous layer's selection): choose a pp whose stages start on 'full' layers")
    return stages


def keep_layers(model: nn.Module, layers: range, *, first: bool, last: bool) -> nn.Module:
    """Turns `model` (GLM5ForCausalLM) into the stage that runs `layers`, in place."""
    inner = model.model
    inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layers})
    inner.mtp = nn.ModuleList()
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = None
        model.lm_head = None
    model.forward = types.MethodType(stage_forward, model)
    return model


def stage_forward(model, inputs: torch.Tensor) -> torch.Tensor:
    """Input ids [B,S] (first stage) or hidden states [B,S,D] -> hidden states, or logits [B,S,V] (last stage)."""
    inner = model.model
    if inner.embed_tokens is not None:
        model._check_ids(inputs, 0)
        with nvtx_range("embed"):
            x = inner.embed_tokens(inputs)
    else:
        x = inputs
    B, S = x.shape[:2]
    positions = torch.arange(S, device=x.device)[None].expand(B, S)
    ctx = ForwardContext(model, positions, [Segment(B, S)], x.dtype)
    selection = None
    for layer in inner.layers.values():
        x, selection = layer(x, ctx, selection)
    if model.lm_head is None:
        return x
    with nvtx_range("norm"):
        x = inner.norm(x)
    return model.logits(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


SCHEDULES = ("gpipe", "1f1b")


def build_schedule(model: nn.Module, stage_index: int, num_stages: int, *, micro_batches: int, schedule: str,
                   example: torch.Tensor, hidden_size: int, dtype, device, group):
    """A PipelineStage around this process's stage and its schedule (gpipe | 1f1b).
    `example`: one micro-batch of input ids, so no process infers shapes by running."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    b, S = example.shape
    # requires_grad: tells the stages that a gradient travels back across the boundary
    hidden = torch.empty(b, S, hidden_size, dtype=dtype, device="meta", requires_grad=True)
    inputs = example.to("meta") if stage_index == 0 else hidden
    last = stage_index == num_stages - 1
    outputs = torch.empty(b, S, model.config.vocab_size, dtype=dtype, device="meta") if last else hidden
    stage = PipelineStage(model, stage_index, num_stages, device, input_args=(inputs,), output_args=(outputs,),
                          group=group)
    return kinds[schedule](stage, n_microbatches=micro_batches, loss_fn=lm_loss)
