"""DSA's dense warm-up of the lightning indexer (training/indexer_warmup.py)."""
import torch

import glm5_ops
from training.indexer_warmup import (attention_inputs, byte_glm5, head_qkv, held_out_loss, indexer_kl,
                                     indexer_log_probs, pretrain, sparse_train, warm_up_indexer)
from training.train import load_corpus

SEQ = 64


def _trained_model():
    data = load_corpus(1 << 20)
    model = byte_glm5(SEQ)
    pretrain(model, data, steps=40, seq_len=SEQ)          # enough for attention to be peaked
    return model, data


def test_training_scores_rank_keys_as_indexer_topk():
    """The differentiable scores the warm-up trains order the keys exactly as
    the indexer_topk kernel the model selects with."""
    model, data = _trained_model()
    ids = data[None, :SEQ].long()
    for attn, x, cos, sin in attention_inputs(model, ids):
        q_resid = head_qkv(attn, x, cos, sin)[3]
        with torch.no_grad():
            logp = indexer_log_probs(attn, x, q_resid, cos, sin)
            qi, wi = attn.indexer.query(x, q_resid, cos, sin)
            chosen = glm5_ops.indexer_topk(qi, wi, attn.indexer.key(x, cos, sin), 8)
        for s in range(8, SEQ):   # queries that see more keys than they keep
            keys = chosen[0, s].long()
            # keys tied at the k-th score (relu zeros) may be chosen either way
            kth = logp[0, s].topk(8).values[-1]
            assert len(set(keys.tolist())) == 8 and (keys <= s).all(), (attn.layer_idx, s)
            assert (logp[0, s, keys] >= kth - 1e-5).all(), (attn.layer_idx, s)


def test_warm_up_lowers_the_kl_and_trains_only_the_indexer():
    model, data = _trained_model()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".indexer." not in n}
    ids = data[None, -SEQ:].long()                        # not a training window's start

    def kl():
        with torch.no_grad():
            layers = attention_inputs(model, ids)
            return sum(indexer_kl(attn, x, cos, sin).item() for attn, x, cos, sin in layers) / len(layers)

    before = kl()
    losses = warm_up_indexer(model, data, steps=60, seq_len=SEQ, lr=1e-2)
    after = kl()
    assert after < 0.5 * before, (before, after, losses[::10])   # measured: 0.144 -> 0.017
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"{n} changed during the indexer warm-up"


def test_held_out_loss_switches_attention_and_restores_the_model():
    """DSA that keeps every key is dense attention; keeping 8 of 64 changes the
    loss; the model's mode, index_topk and block size come back afterwards."""
    model, data = _trained_model()
    rows = data[:2 * (SEQ + 1)].long().view(2, SEQ + 1)
    saved = model.attention_mode, model.config.index_topk, model.block_size
    dense = held_out_loss(model, rows, "dense")
    assert abs(held_out_loss(model, rows, "dsa", 1.0) - dense) < 1e-5
    assert abs(held_out_loss(model, rows, "dsa", 0.125) - dense) > 1e-4
    assert (model.attention_mode, model.config.index_topk, model.block_size) == saved


def test_sparse_training_reaches_attention_through_the_sparse_kernels():
    """DSA's second stage: under dsa attention (8 of 64 keys) the LM gradient
    reaches every layer's q and kv projections, whose only path to the loss is
    sparse_attention's backward; the indexer stays as it was."""
    model, data = _trained_model()
    indexer = {n: p.detach().clone() for n, p in model.named_parameters() if ".indexer." in n}
    sparse_train(model, data, steps=3, seq_len=SEQ, density=0.125)
    assert model.attn == "dense" and model.config.index_topk == 8     # the mode came back, the density stays
    for n, p in model.named_parameters():
        if n in indexer:
            assert torch.equal(p, indexer[n]), f"{n} trained in the sparse stage"
    x = data[None, :SEQ].long()
    with model.attention("dsa"):
        torch.nn.functional.cross_entropy(model(x)[0, :-1], x[0, 1:]).backward()
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_a_proj, layer.self_attn.kv_a_proj_with_mqa):
            assert proj.weight.grad is not None and proj.weight.grad.abs().sum() > 0, layer.self_attn.layer_idx
