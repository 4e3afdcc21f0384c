"""Model accounting (models/glm5/accounting.py) and `glm5-lab inspect`.

Parameter counts are checked against transformers' GlmMoeDsaForCausalLM built
on the meta device, FLOPs against torch's FlopCounterMode over transformers'
own forward, and the presets against their published or claimed totals.
"""
import argparse
import pathlib
import random
import re

import pytest
import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: scripts/setup.sh installs tomli
    import tomli as tomllib

from models.glm5 import GLM5Config, preset
from models.glm5.accounting import (active_breakdown, cache_bytes_per_token, flops_per_token, param_breakdown,
                                    report)
from profiling.inspect import add_parser, context_for_saving, run

try:
    import transformers
    HAVE_HF = hasattr(transformers, "GlmMoeDsaForCausalLM")
except ImportError:
    HAVE_HF = False
needs_hf = pytest.mark.skipif(not HAVE_HF, reason="transformers with GlmMoeDsaForCausalLM is not installed")


def pinned_transformers() -> str:
    """The transformers version pyproject.toml's `hf` extra pins."""
    with open(pathlib.Path(__file__).parents[1] / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["hf"]
    return next(d.split("==", 1)[1] for d in extra if d.startswith("transformers=="))


def random_config(seed: int, *, n_group: int, shared: bool, tied: bool) -> GLM5Config:
    rng = random.Random(seed)
    layers = rng.randint(2, 5)
    rope = rng.choice([4, 8])
    experts = n_group * rng.randint(2, 4)
    indexer_types = ["full"] + [rng.choice(["full", "shared"]) if shared else "full" for _ in range(layers - 1)]
    if shared:
        indexer_types[-1] = "shared"
    return GLM5Config(
        vocab_size=rng.randint(50, 300), hidden_size=rng.choice([24, 32, 48]),
        intermediate_size=rng.randint(20, 70), moe_intermediate_size=rng.randint(8, 24),
        num_hidden_layers=layers, first_k_dense_replace=rng.randint(0, layers - 1),
        num_attention_heads=(h := rng.randint(1, 4)), num_key_value_heads=h,
        q_lora_rank=rng.randint(8, 24), kv_lora_rank=rng.randint(8, 24),
        qk_nope_head_dim=rng.randint(4, 12), qk_rope_head_dim=rope, v_head_dim=rng.randint(4, 12),
        n_routed_experts=experts, num_experts_per_tok=rng.randint(1, experts), n_group=n_group,
        topk_group=rng.randint(1, n_group), n_shared_experts=rng.randint(1, 2),
        index_n_heads=rng.randint(1, 4), index_head_dim=rope + rng.choice([0, 4, 8]), index_topk=rng.randint(2, 6),
        attention_bias=rng.random() < 0.5, tie_word_embeddings=tied, indexer_types=indexer_types,
        max_position_embeddings=512)


RANDOM = [dict(seed=0, n_group=1, shared=False, tied=False), dict(seed=1, n_group=2, shared=True, tied=False),
          dict(seed=2, n_group=4, shared=True, tied=True), dict(seed=3, n_group=1, shared=True, tied=True),
          dict(seed=4, n_group=2, shared=False, tied=True)]


def hf_model(cfg: GLM5Config, device="meta"):
    hf_cfg = transformers.GlmMoeDsaConfig(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    hf_cfg._experts_implementation = "eager"
    with torch.device(device):
        return transformers.GlmMoeDsaForCausalLM(hf_cfg)


def hf_tensors(model) -> dict:
    """Every checkpoint tensor (parameters once when tied, persistent buffers) by name."""
    out = {n: p.numel() for n, p in model.named_parameters()}
    for mod_name, mod in model.named_modules():
        for n, b in mod.named_buffers(recurse=False):
            if n not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{n}"] = b.numel()
    return out


def hf_component(name: str) -> str:
    """Our breakdown component for a transformers tensor name."""
    if re.search(r"self_attn\.\w+_proj\w*\.bias", name):
        return "attn_bias"
    rules = [("embed_tokens", "embedding"), ("lm_head", "lm_head"), ("e_score_correction_bias", "router_bias"),
             ("mlp.gate.", "router"), ("mlp.experts.", "routed_experts"), ("shared_experts", "shared_experts"),
             ("norm", "norms"), ("indexer.", "indexer"), ("self_attn.", "mla"), ("mlp.", "dense_mlp")]
    return next(comp for key, comp in rules if key in name)


@needs_hf
@pytest.mark.parametrize("kw", RANDOM, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_param_breakdown_matches_transformers(kw):
    cfg = random_config(**kw)
    by_component = {}
    for name, n in hf_tensors(hf_model(cfg)).items():
        by_component[hf_component(name)] = by_component.get(hf_component(name), 0) + n
    ours = {k: v for k, v in param_breakdown(cfg).items() if v}
    assert ours == by_component


@needs_hf
@pytest.mark.parametrize("name", ["glm-5", "seed-1.8t"])
def test_preset_total_matches_transformers(name):
    cfg = preset(name)
    assert report(cfg).total == sum(hf_tensors(hf_model(cfg)).values())


@needs_hf
@pytest.mark.parametrize("kw", RANDOM[1:3], ids=["group2-shared", "group4-shared-tied"])
def test_flops_match_transformers_forward(kw):
    """transformers' eager forward builds the full S x S score matrices (the
    mask drops the rest), so its FLOPs are ours per token for the weights plus
    S keys per query for the expanded attention core and the indexer."""
    from torch.utils.flop_counter import FlopCounterMode
    pinned = pinned_transformers()
    if transformers.__version__ != pinned:   # 5.17.0 (the GPU image's) counts 4 more a token
        pytest.skip(f"FLOPs are counted over transformers=={pinned}'s forward, not {transformers.__version__}'s")
    cfg = random_config(**kw)
    torch.manual_seed(0)
    model = hf_model(cfg, device="cpu").eval()
    S = 3 * cfg.index_topk + 1
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (1, S)))
    f = flops_per_token(cfg, S, "prefill", "dsa")
    H, n_full = cfg.num_attention_heads, cfg.indexer_types.count("full")
    core = cfg.num_hidden_layers * 2 * H * S * (cfg.qk_head_dim + cfg.v_head_dim)
    scoring = n_full * S * (2 * cfg.index_n_heads * cfg.index_head_dim + 2 * cfg.index_n_heads)
    indexer_proj = 2 * active_breakdown(cfg)["indexer"]
    assert counter.get_total_flops() == S * (f.other + f.attn_proj + indexer_proj + core + scoring)


def test_glm5_published_totals():
    rep = report(preset("glm-5"))
    assert abs(rep.total / 744e9 - 1) < 0.01
    assert abs(rep.active_params / 40e9 - 1) < 0.05
    # one MTP layer: a MoE decoder layer + enorm, hnorm, eh_proj, shared_head.norm
    cfg = rep.config
    assert rep.mtp == 2 * cfg.hidden_size ** 2 + 3 * cfg.hidden_size + (
        sum(param_breakdown(cfg.replace(num_hidden_layers=1, first_k_dense_replace=0, vocab_size=1,
                                        tie_word_embeddings=True)).values()) - 2 * cfg.hidden_size)


def test_seed_preset_matches_article():
    cfg = preset("seed-1.8t")
    rep = report(cfg)
    assert cfg.n_routed_experts == 128 and 8 <= cfg.num_experts_per_tok + cfg.n_shared_experts <= 12
    assert abs(rep.total / 1.8e12 - 1) < 0.02
    assert abs(rep.matmul_active / 200e9 - 1) < 0.05
    assert cfg.index_topk <= 0.05 * 32768
    for mode in ("decode", "prefill"):
        assert flops_per_token(cfg, 32768, mode).indexer_share_of_total < 0.03


def test_active_is_total_less_idle_experts():
    cfg = random_config(**RANDOM[2])
    full, act = param_breakdown(cfg), active_breakdown(cfg)
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = cfg.mlp_layer_types.count("sparse") * (cfg.n_routed_experts - cfg.num_experts_per_tok) * expert
    rep = report(cfg)
    assert rep.active_params == rep.total - full["embedding"] - full["lm_head"] - idle
    assert act["lm_head"] == cfg.vocab_size * cfg.hidden_size  # a tied head still multiplies per token


def test_flops_by_hand():
    cfg = preset("glm-5")
    L, H, k = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.index_topk
    dec = flops_per_token(cfg, 8192, "decode", "dsa")
    assert dec.attn_core == L * 2 * H * k * (512 + 64 + 512)  # absorbed: Dk = latent, Dv = kv_lora
    assert dec.indexer == 2 * report(cfg).active["indexer"] + L * 8192 * (2 * 32 * 128 + 2 * 32)
    dense = flops_per_token(cfg, 8192, "decode", "dense")
    assert dense.indexer == 0 and dense.attn_core == L * 2 * H * 8192 * 1088
    assert dense.other == dec.other and dense.attn_proj == dec.attn_proj
    # prefill: mean over positions 1..N of min(topk, i) keys, expanded dims (192+64, 256)
    pre = flops_per_token(cfg, 3 * k, "prefill", "dsa")
    mean_keys = sum(min(k, i) for i in range(1, 3 * k + 1)) / (3 * k)
    assert pre.attn_core == pytest.approx(L * 2 * H * mean_keys * (256 + 256), rel=1e-12)
    # below index_topk DSA reads every key and pays for the indexer on top
    short = flops_per_token(cfg, k, "decode", "dsa")
    assert short.attn_core == flops_per_token(cfg, k, "decode", "dense").attn_core and short.indexer > 0
    shares = [flops_per_token(cfg, n).indexer_share_of_attention for n in (4096, 32768, 131072)]
    assert shares == sorted(shares)


def test_shared_layers_skip_indexer_cost_and_cache():
    full = random_config(**RANDOM[0]).replace(indexer_types=None)
    half = full.replace(indexer_types=["full", "shared"] * (full.num_hidden_layers // 2)
                        + ["full"] * (full.num_hidden_layers % 2))
    per_key = 2 * full.index_n_heads * full.index_head_dim + 2 * full.index_n_heads
    n_shared = half.indexer_types.count("shared")
    a, b = flops_per_token(full, 100), flops_per_token(half, 100)
    assert a.attn_core == b.attn_core
    assert a.indexer - b.indexer == n_shared * (100 * per_key + 2 * (
        full.q_lora_rank * full.index_n_heads * full.index_head_dim
        + full.hidden_size * (full.index_head_dim + full.index_n_heads)))
    assert (cache_bytes_per_token(full)["indexer"] - cache_bytes_per_token(half)["indexer"]
            == n_shared * 2 * full.index_head_dim)


def test_cache_bytes_glm5():
    cfg = preset("glm-5")  # 78 layers + 1 MTP layer, all with an indexer
    assert cache_bytes_per_token(cfg, "bf16") == {"latent": 79 * 576 * 2, "indexer": 79 * 128 * 2,
                                                  "total": 79 * (576 + 128) * 2}
    # fp8 (FlashMLA layout): 512 fp8 + 4 fp32 scales + 64 bf16 rope = 656; key 128 fp8 + 1 scale = 132
    assert cache_bytes_per_token(cfg, "fp8")["total"] == 79 * (656 + 132)
    assert cache_bytes_per_token(cfg, "bf16", attention="dense")["indexer"] == 0


def test_bad_arguments():
    cfg = preset("tiny")
    with pytest.raises(ValueError, match="context"):
        flops_per_token(cfg, 0)
    with pytest.raises(ValueError, match="mode"):
        flops_per_token(cfg, 16, mode="train")
    with pytest.raises(ValueError, match="attention"):
        flops_per_token(cfg, 16, attention="block_sparse")
    with pytest.raises(ValueError, match="dtype"):
        cache_bytes_per_token(cfg, "int4")


# ---- glm5-lab inspect ----
def inspect_parser():
    parser = argparse.ArgumentParser(prog="glm5-lab")
    add_parser(parser.add_subparsers(dest="command"))
    return parser


def inspect(capsys, *argv):
    rc = run(inspect_parser().parse_args(["inspect", *argv]))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_inspect_glm5_prints_published_totals(capsys):
    rc, out, _ = inspect(capsys, "--preset", "glm-5")
    assert rc == 0
    total, active = re.search(r"total \(published convention: no MTP\) \| ([\d.]+)B .*\| ([\d.]+)B", out).groups()
    assert abs(float(total) / 744 - 1) < 0.01 and abs(float(active) / 40 - 1) < 0.05
    for ctx in ("4K", "32K", "128K"):
        assert f"| {ctx} | decode |" in out and f"| {ctx} | prefill |" in out
    assert "| bf16 | 91,008 | 20,224 | 111,232 |" in out
    assert "Seed article" not in out


def test_inspect_seed_prints_claims(capsys):
    rc, out, _ = inspect(capsys, "--preset", "seed-1.8t", "--format", "text", "--context", "4K,32K",
                         "--context", "65536")
    assert rc == 0
    total = float(re.search(r"total parameters\s+~1\.8T\s+([\d.]+)T", out).group(1))
    assert abs(total / 1.8 - 1) < 0.02
    shares = re.search(r"predictor cost\s+<= 3% of total compute\s+([\d.]+)% decode, ([\d.]+)% prefill", out)
    assert all(0 < float(x) < 3 for x in shares.groups())
    rows = [line.split()[0] for line in out.splitlines() if re.match(r"\s*\d+K\s+(decode|prefill)\s", line)]
    assert rows == ["4K", "4K", "32K", "32K", "64K", "64K"]


def test_inspect_config_file_and_claims_flag(capsys, tmp_path):
    preset("tiny").to_json(tmp_path / "config.json")
    rc, out, _ = inspect(capsys, "--config", str(tmp_path), "--claims", "--context", "1000")
    assert rc == 0 and "Seed article" in out and "| 1000 | decode |" in out


def test_inspect_bad_input(capsys, tmp_path):
    rc, _, err = inspect(capsys, "--preset", "tiny", "--context", "65536")
    assert rc == 2 and "--context" in err and "max_position_embeddings" in err
    rc, _, err = inspect(capsys, "--config", str(tmp_path / "missing.json"))
    assert rc == 2 and "--config" in err
    for argv in (["--preset", "nope"], ["--preset", "tiny", "--context", "4x"], ["--preset", "tiny", "--config", "x"],
                 []):
        with pytest.raises(SystemExit) as e:
            inspect_parser().parse_args(["inspect", *argv])
        assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_context_for_saving_is_the_crossing():
    cfg = preset("glm-5")
    n = context_for_saving(cfg, "decode")
    save = lambda m: 1 - flops_per_token(cfg, m, "decode").total / flops_per_token(cfg, m, "decode", "dense").total
    assert save(n) >= 0.40 > save(n - 1)
    assert context_for_saving(cfg, "decode", target=0.999) is None
