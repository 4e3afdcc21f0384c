"""DSA's dense warm-up of GLM-5's lightning indexer, the sparse training stage
after it, and a byte-level GLM-5 to run them on.

The LM loss never trains the indexer: its top-k is not differentiable (and
transformers runs it under no_grad). DeepSeek-V3.2, whose DSA GLM-5 adopts,
trains it first in a dense warm-up: the model attends to every key, all its
weights are frozen, and each layer's indexer learns to match the main
attention by the KL divergence from the attention distribution (summed over
heads, L1-normalised) to the softmax of the indexer's scores. Only after
that is its top-k a selection worth using.

    model = byte_glm5(seq_len=1024)
    pretrain(model, data, steps=400, seq_len=1024)         # dense attention, LM loss
    warm_up_indexer(model, data, steps=100, seq_len=1024)  # indexer only, KL loss
    sparse_train(model, data, steps=100, seq_len=1024, density=0.05)  # the rest, under DSA

bench/attention_recall.py --source glm5 measures how much attention the
indexer's selection keeps before and after the warm-up, and the held-out loss
of each stage with dense, block-sparse and DSA attention.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from models.glm5 import GLM5ForCausalLM
from models.glm5.attention_modes import BASELINE_ATTENTION
from models.glm5.config import preset
from training.train import batch


def byte_glm5(seq_len: int, seed: int = 0) -> GLM5ForCausalLM:
    """A GLM-5-architecture byte LM (MLA, DSA indexer, MoE after one dense
    layer): the tiny preset widened to 128 and given 256 byte tokens."""
    torch.manual_seed(seed)
    config = preset("tiny").replace(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, index_n_heads=4, index_head_dim=32, index_topk=seq_len,
        max_position_embeddings=max(seq_len, 4096))
    return GLM5ForCausalLM(config, attn=BASELINE_ATTENTION)


def _train(name: str, params, loss_of, data: torch.Tensor, *, steps: int, seq_len: int, batch_size: int,
           lr: float, seed: int) -> list[float]:
    """AdamW on params over `steps` random batches; loss_of(x, y) -> scalar. Returns the losses."""
    opt = torch.optim.AdamW(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses, t0 = [], time.time()
    for step in range(steps):
        loss = loss_of(*batch(data, batch_size, seq_len, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"  {name} step {step:4d}  loss {losses[-1]:.3f}  ({time.time() - t0:.0f} s)", flush=True)
    return losses


def _train_lm(name: str, model: GLM5ForCausalLM, data: torch.Tensor, **kw) -> list[float]:
    """Next-byte LM loss on every parameter but the indexers' (the LM loss never reaches them)."""
    model.train()
    params = [p for n, p in model.named_parameters() if ".indexer." not in n]
    return _train(name, params, lambda x, y: F.cross_entropy(model(x).flatten(0, 1), y.flatten()), data, **kw)


def pretrain(model: GLM5ForCausalLM, data: torch.Tensor, *, steps: int, seq_len: int, batch_size: int = 4,
             lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Next-byte LM training with dense attention; returns the losses."""
    with model.attention(BASELINE_ATTENTION):
        return _train_lm("pretrain", model, data, steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr,
                         seed=seed)


def sparse_train(model: GLM5ForCausalLM, data: torch.Tensor, *, steps: int, seq_len: int, density: float,
                 batch_size: int = 4, lr: float = 1e-3, seed: int = 2) -> list[float]:
    """DSA's second stage, simplified: the model trains under its own sparse
    attention, each query attending to the index_topk = density x seq_len keys
    its indexer chooses (gradients through the sparse_attention kernels), with
    the indexer frozen (DeepSeek-V3.2 keeps training it by KL over the chosen
    keys). Leaves the model's index_topk at that density (its attention mode
    comes back: run it `with model.attention("dsa")`)."""
    model.config.index_topk = max(1, round(density * seq_len))
    with model.attention("dsa"):
        return _train_lm("sparse training (dsa)", model, data, steps=steps, seq_len=seq_len,
                         batch_size=batch_size, lr=lr, seed=seed)


@torch.no_grad()
def attention_inputs(model: GLM5ForCausalLM, ids: torch.Tensor) -> list[tuple]:
    """(attention module, x, cos, sin) for every layer: what each MLA attention
    received in a dense forward of ids."""
    captured = []

    def hook(module, args, _out):
        x, ctx, _ = args
        captured.append((module, x, ctx.cos, ctx.sin))

    handles = [layer.self_attn.register_forward_hook(hook) for layer in model.model.layers]
    try:
        with model.attention(BASELINE_ATTENTION):
            model.eval()(ids)
    finally:
        for h in handles:
            h.remove()
    return captured


@torch.no_grad()
def held_out_loss(model: GLM5ForCausalLM, rows: torch.Tensor, attn: str, density: float | None = None) -> float:
    """Next-byte loss (nats) over rows [B, S+1] with the model attending in mode
    `attn`; for "dsa" and "block_sparse", to `density` of the S keys (index_topk;
    block_sparse in 16-token blocks: sink + local + chosen ~ index_topk keys)."""
    S = rows.shape[1] - 1
    saved = model.config.index_topk, model.block_size
    if density is not None:
        model.config.index_topk, model.block_size = max(1, round(density * S)), 16
    try:
        with model.attention(attn):
            logits = model.eval()(rows[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    finally:
        model.config.index_topk, model.block_size = saved


def head_qkv(attn, x, cos, sin):
    """The layer's per-head q [B,S,H,nope+rope], k, v and its q_resid."""
    q_nope, q_rot, q_resid, kv = attn.project(x, cos, sin)
    return (*attn.expand(q_nope, q_rot, kv), q_resid)


def causal_log_probs(scores: torch.Tensor) -> torch.Tensor:
    """log softmax over keys of [..., S, T] scores with future keys masked."""
    S, T = scores.shape[-2:]
    future = torch.ones(S, T, dtype=torch.bool, device=scores.device).triu(T - S + 1)
    return scores.masked_fill(future, float("-inf")).log_softmax(-1)


def attention_distribution(q, k, scale: float) -> torch.Tensor:
    """[B,S,T]: the main attention's probabilities summed over heads, L1-normalised."""
    p = causal_log_probs(torch.einsum("bshd,bthd->bhst", q, k) * scale).exp()
    return p.mean(1)


def indexer_log_probs(attn, x, q_resid, cos, sin) -> torch.Tensor:
    """[B,S,T] log softmax of the indexer's scores sum_h w_h relu(q_h . k)
    (differentiable: the training form of what indexer_topk ranks)."""
    qi, wi = attn.indexer.query(x, q_resid, cos, sin)
    ki = attn.indexer.key(x, cos, sin)
    scores = torch.einsum("bsh,bsht->bst", wi, torch.einsum("bshd,btd->bsht", qi, ki).relu())
    return causal_log_probs(scores)


def indexer_kl(attn, x, cos, sin) -> torch.Tensor:
    """KL(attention || indexer), averaged over queries: DSA's warm-up loss."""
    with torch.no_grad():
        q, k, _, q_resid = head_qkv(attn, x, cos, sin)
        target = attention_distribution(q, k, attn.scale)
    logp = indexer_log_probs(attn, x, q_resid, cos, sin)
    # 0 * log 0 = 0 and logp = -inf only where target = 0 (future keys)
    return (target * (target.clamp_min(1e-30).log() - logp.clamp_min(-1e30))).sum(-1).mean()


def warm_up_indexer(model: GLM5ForCausalLM, data: torch.Tensor, *, steps: int, seq_len: int, batch_size: int = 4,
                    lr: float = 1e-3, seed: int = 1) -> list[float]:
    """Trains every layer's indexer (only) by indexer_kl; returns the mean KL per step."""
    indexers = [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]
    if not indexers:
        raise ValueError("the model has no indexer to warm up (every layer is 'shared')")
    params = [p for ix in indexers for p in ix.parameters()]

    def mean_kl(x, _):
        layers = [c for c in attention_inputs(model, x) if c[0].indexer is not None]
        return sum(indexer_kl(attn, h, cos, sin) for attn, h, cos, sin in layers) / len(layers)

    return _train("indexer warm-up (KL)", params, mean_kl, data, steps=steps, seq_len=seq_len,
                  batch_size=batch_size, lr=lr, seed=seed)
