"""LoRA (training/lora.py) on the tiny GLM-5: a fresh adapter leaves the
logits bit-identical, merge then unmerge restores the weights within 1e-6,
the trainable fraction, an adapter on the router changes which experts are
chosen, the peft file layout, and bad configs named."""
from __future__ import annotations

import json
import os
import sysconfig

import pytest
import torch
from safetensors.torch import load_file

from models.glm5 import GLM5ForCausalLM
from models.glm5.config import preset
from training.distributed_train import Trainer
from training.lora import LoraConfig, apply_lora, merge, merged_tensors, save_adapter, trainable_fraction, unmerge
from training.parallelize import ParallelDims
from training.train import batch

ALL_LINEAR = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk", "weights_proj",
              "gate_proj", "up_proj", "down_proj"]
EVERYWHERE = LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR,
                        target_parameters=["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def _model(seed=0):
    torch.manual_seed(seed)
    return GLM5ForCausalLM(preset("tiny").replace(num_nextn_predict_layers=0))


def _ids(n=40):
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(1))


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_fresh_adapter_leaves_logits_bit_identical():
    base, adapted = _model(), _model()
    names = apply_lora(adapted, EVERYWHERE)
    # 8 attention linears x 3 layers, the dense MLP's 3 and 2 shared experts' 3, 2 routers, 2 x 2 expert tensors
    assert len(names) == 8 * 3 + 3 + 2 * 3 + 2 + 2 * 2
    with torch.no_grad():
        assert torch.equal(base(_ids()), adapted(_ids()))


def test_merge_unmerge_restores_weights_and_merged_forward_matches():
    model = _model()
    apply_lora(model, EVERYWHERE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(std=0.05)   # a trained-looking adapter: B != 0
        before = _weights(model)
        adapted_logits = model(_ids())
        merge(model)
        merged_logits = model(_ids())
        moved = max(float((p - before[n]).abs().max()) for n, p in model.named_parameters())
        unmerge(model)
        worst = max(float((p - before[n]).abs().max()) for n, p in model.named_parameters())
    assert moved > 1e-3   # merging really changed the base weights
    assert worst <= 1e-6, worst
    assert (merged_logits - adapted_logits).norm() <= 1e-5 * adapted_logits.norm()


def test_trainable_fraction_and_merged_checkpoint_names(tmp_path):
    model = _model()
    apply_lora(model, LoraConfig(r=2, target_modules=["q_a_proj"], modules_to_save=["lm_head"]))
    trainable, total = trainable_fraction(model)
    lora = 3 * 2 * (64 + 32)   # three q_a_proj [32, 64]: A [2, 64] + B [32, 2]
    assert trainable == lora + 512 * 64 and total == 266976 + lora
    print(f"\ntrainable {trainable} of {total} parameters ({100 * trainable / total:.2f}%)")
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    assert set(merged_tensors(tensors, model.lora_config)) == {n for n, _ in _model().named_parameters()}
    save_adapter(str(tmp_path), tensors, model.lora_config)
    saved = load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight" in saved
    assert "base_model.model.lm_head.weight" in saved and len(saved) == 7
    config = json.load(open(os.path.join(tmp_path, "adapter_config.json")))
    assert config["r"] == 2 and config["peft_type"] == "LORA"


def _domain() -> torch.Tensor:
    root = os.path.join(sysconfig.get_paths()["stdlib"], "email")
    data = b"".join(open(os.path.join(root, f), "rb").read() for f in sorted(os.listdir(root)) if f.endswith(".py"))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _histogram(model, x) -> torch.Tensor:
    model.record = True
    with torch.no_grad():
        model(x)
    model.record = False
    return torch.stack([torch.bincount(ids.flatten(), minlength=8) for _, ids in sorted(model.last_routing.items())])


def test_router_adapter_changes_expert_histogram():
    """Only the routers' adapters train (on the stdlib's email package): the
    expert histogram on held-out email bytes moves, nothing else changes."""
    data = _domain()
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=["mlp.gate.weight"])
    trainer = Trainer(preset("tiny"), ParallelDims(), None, lr=3e-2, lora=cfg)
    held = batch(data[-20000:], 8, 64, torch.Generator().manual_seed(2))[0]
    before = _histogram(trainer.model, held)
    gen = torch.Generator().manual_seed(0)
    losses = [trainer.step(*batch(data[:-20000], 8, 64, gen)) for _ in range(8)]
    after = _histogram(trainer.model, held)
    moved = int((after - before).abs().sum()) // 2
    print(f"\nexpert histogram per MoE layer (held-out email bytes)\nbefore {before.tolist()}\nafter  {after.tolist()}"
          f"\n{moved} of {int(before.sum())} expert choices moved; losses {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert before.sum() == after.sum() and moved > 0.02 * int(before.sum())


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(r=0), ValueError, "r must be a positive int, got 0"),
    (dict(lora_dropout=0.1), ValueError, "lora_dropout must be 0"),
    (dict(target_modules="q_a_proj"), TypeError, "target_modules must be a list"),
])
def test_bad_config_is_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        LoraConfig(**kwargs)


def test_tp_and_ep_sharded_targets_are_refused():
    with pytest.raises(ValueError, match="q_b_proj is sharded by tensor parallelism"):
        apply_lora(_model(), LoraConfig(target_modules=["q_b_proj"]), tp=2)
    with pytest.raises(ValueError, match="split by expert parallelism"):
        apply_lora(_model(), LoraConfig(target_modules=[], target_parameters=["mlp.experts.down_proj"]), ep=2)
    with pytest.raises(ValueError, match="no parameter matches"):
        apply_lora(_model(), LoraConfig(target_modules=["nope"]))
