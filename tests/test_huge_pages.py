"""Weights and the paged cache on transparent huge pages (glm5_ops/memory.py).

Whether the kernel then backs a region with 2 MiB pages depends on its free
memory, so these tests check what the lab decides and asks for: which tensors
move, that values, identities and ties survive, that the mapping is advised
MADV_HUGEPAGE ("hg" in /proc/self/smaps), and that GLM5_HUGE_PAGES=0 turns it off."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from glm5_ops.memory import (HUGE_PAGE, huge_page_empty, huge_pages_enabled, on_huge_pages,
                             placed_on_huge_pages as _placed, weights_on_huge_pages)
from models.glm5 import GLM5Config, GLM5ForCausalLM, quantize

needs_thp = pytest.mark.skipif(not huge_pages_enabled(), reason="the kernel's transparent_hugepage is 'never'")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_huge_page_empty_is_aligned_advised_and_writable(dtype):
    shape = (3, HUGE_PAGE // 3 + 7)     # not a whole number of huge pages
    t = huge_page_empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert _placed(t)
    assert "hg" in _vm_flags(t.data_ptr())
    src = torch.randint(-100, 100, shape).to(dtype)
    t.copy_(src)
    assert torch.equal(t, src)


@needs_thp
def test_small_or_disabled_stays_on_torchs_allocator(monkeypatch):
    small = huge_page_empty((HUGE_PAGE // 4 - 1,), torch.float32)
    assert small.untyped_storage().resizable()
    monkeypatch.setenv("GLM5_HUGE_PAGES", "0")
    assert not huge_pages_enabled()
    assert huge_page_empty((HUGE_PAGE,), torch.float32).untyped_storage().resizable()
    big = torch.randn(HUGE_PAGE // 2)
    assert on_huge_pages(big) is big


@needs_thp
def test_on_huge_pages_copies_exactly_and_skips_what_it_cannot_move():
    t = torch.randn(HUGE_PAGE // 4 + 5)
    moved = on_huge_pages(t)
    assert moved is not t and _placed(moved) and torch.equal(moved, t)
    strided = torch.randn(2, HUGE_PAGE // 4).t()     # not contiguous
    assert on_huge_pages(strided) is strided
    assert on_huge_pages(torch.randn(8)) is not None


@needs_thp
def test_weights_on_huge_pages_keeps_identity_ties_and_values():
    big, small = nn.Linear(1024, 1024), nn.Linear(1024, 4)
    big.register_buffer("table", torch.randn(1024, 1024))
    small.register_buffer("table", big.table)                 # one buffer under two modules
    tied = nn.Linear(1024, 1024, bias=False)
    tied.weight = big.weight                                   # one parameter under two modules
    model = nn.Sequential(big, small, tied)
    weight, before = big.weight, {k: v.clone() for k, v in model.state_dict().items()}
    moved = weights_on_huge_pages(model)
    assert moved == 2 * 1024 * 1024 * 4                        # the weight and the buffer, once each
    assert big.weight is weight and tied.weight is weight and _placed(weight)
    assert small.table is big.table and _placed(big.table)
    assert not _placed(small.weight)                           # 16 KiB: left where it was
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert weights_on_huge_pages(model) == 0                   # already placed


@needs_thp
def test_huge_page_weights_train_and_copy():
    """A placed parameter takes gradients and optimizer steps as any other; deepcopy
    and state_dict give ordinary tensors with the same values."""
    torch.manual_seed(0)
    model = nn.Linear(1024, 600)
    ref = copy.deepcopy(model)
    weights_on_huge_pages(model)
    assert _placed(model.weight) and not _placed(ref.weight)
    x = torch.randn(5, 1024)
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(x).square().sum().backward()
        opt.step()
    assert torch.equal(model.weight, ref.weight) and _placed(model.weight)
    assert torch.equal(copy.deepcopy(model).weight, model.weight)


def _config():
    return GLM5Config(vocab_size=2048, hidden_size=512, intermediate_size=768, moe_intermediate_size=128,
                      num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                      n_group=2, topk_group=1, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_n_heads=2,
                      index_head_dim=32, index_topk=16, num_nextn_predict_layers=0)


@needs_thp
def test_model_construction_loading_quantization_and_cache_place_their_big_tensors(tmp_path, monkeypatch):
    from safetensors.torch import save_file
    torch.manual_seed(0)
    model = GLM5ForCausalLM(_config()).eval()
    big = {n for n, p in model.named_parameters() if p.numel() * p.element_size() >= HUGE_PAGE}
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= big
    for n, p in model.named_parameters():
        assert _placed(p) == (n in big), n
    cache = model.new_cache(1, 4096)
    assert _placed(cache.pool.latent)          # 2 layers x 4097 slots x 80 x 4 bytes
    ids = torch.randint(0, 2048, (1, 9))
    with torch.inference_mode():
        logits = model(ids)

    # saved (safetensors reads placed tensors like any) and loaded: placed again
    (tmp_path / "ckpt").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "ckpt" / "model.safetensors"))
    model.config.to_json(str(tmp_path / "ckpt" / "config.json"))
    loaded = GLM5ForCausalLM.from_pretrained(str(tmp_path / "ckpt"), verbose=False)
    assert all(_placed(p) == (n in big) for n, p in loaded.named_parameters())

    monkeypatch.setenv("GLM5_HUGE_PAGES", "0")
    plain = GLM5ForCausalLM(_config()).eval()
    assert not any(_placed(p) for p in plain.parameters())
    assert not _placed(plain.new_cache(1, 4096).pool.latent)
    plain.load_state_dict(model.state_dict())
    with torch.inference_mode():
        assert torch.equal(plain(ids), logits)             # where the weights live changes no value
        assert torch.equal(loaded(ids), logits)
    monkeypatch.delenv("GLM5_HUGE_PAGES")


@needs_thp
def test_quantize_places_the_int8_weights_it_makes():
    model = quantize(nn.Sequential(nn.Linear(2048, 1024), nn.Linear(1024, 16)), "int8_weight_only", skip=())
    assert _placed(model[0].qweight)             # 1024 x 2048 int8: one huge page
    assert not _placed(model[1].qweight)
