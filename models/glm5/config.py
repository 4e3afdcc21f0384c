"""GLM5Config: transformers' GlmMoeDsaConfig field for field, plus presets.

A config.json written by transformers for model type `glm_moe_dsa` loads with
`GLM5Config.from_json(path)`; `to_hf_dict()` gives back what
`transformers.GlmMoeDsaConfig(**d)` accepts, so tests build the same network
on both sides. Derived fields (qk_head_dim, indexer_types, mlp_layer_types)
follow transformers' __post_init__ exactly.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

MODEL_TYPE = "glm_moe_dsa"

# Keys a transformers config.json carries that describe the file, not the network.
_HF_BOOKKEEPING = {"architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
                   "auto_map", "_name_or_path", "quantization_config", "head_dim", "qk_head_dim",
                   "layer_types", "output_router_logits", "use_cache", "initializer_range",
                   "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id", "mlp_bias",
                   "num_local_experts", "_attn_implementation_autoset", "tie_word_embeddings"}


@dataclass
class GLM5Config:
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    first_k_dense_replace: int = 3
    mlp_layer_types: list | None = None
    indexer_types: list | None = None
    tie_word_embeddings: bool = False
    # Multi-token prediction layers stored after the decoder (GLM-5: one, as layers.78).
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list | None = 1
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.mlp_layer_types is None:
            n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
            self.mlp_layer_types = ["dense"] * n_dense + ["sparse"] * (self.num_hidden_layers - n_dense)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * self.num_hidden_layers
        self.validate()

    # ---- derived sizes ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 1e6))

    @property
    def latent_dim(self) -> int:
        """Width of one cached MLA token: the normalised latent then the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def validate(self) -> None:
        def need(ok, what):
            if not ok:
                raise ValueError(f"GLM5Config: {what}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_topk",
                     "index_head_dim", "index_n_heads", "n_routed_experts", "num_experts_per_tok",
                     "max_position_embeddings", "intermediate_size", "moe_intermediate_size"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0,
                 f"{name} must be a positive int, got {getattr(self, name)!r}")
        need(self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        need(self.index_head_dim >= self.qk_rope_head_dim,
             f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim ({self.qk_rope_head_dim}): "
             "the indexer ropes its first qk_rope_head_dim channels")
        need(self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok ({self.num_experts_per_tok}) > n_routed_experts ({self.n_routed_experts})")
        need(self.n_routed_experts % self.n_group == 0,
             f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})")
        need(1 <= self.topk_group <= self.n_group, f"topk_group ({self.topk_group}) must be in [1, n_group]")
        need(len(self.mlp_layer_types) == self.num_hidden_layers
             and set(self.mlp_layer_types) <= {"dense", "sparse"},
             f"mlp_layer_types must list 'dense'/'sparse' for each of {self.num_hidden_layers} layers")
        need(len(self.indexer_types) == self.num_hidden_layers
             and set(self.indexer_types) <= {"full", "shared"},
             f"indexer_types must list 'full'/'shared' for each of {self.num_hidden_layers} layers")
        need(self.indexer_types[0] == "full", "indexer_types[0] must be 'full': a shared layer reuses "
             "the previous full layer's selection")
        need(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported (GLM-5 uses silu)")
        rope_type = self.rope_parameters.get("rope_type", "default")
        need(rope_type == "default", f"rope_type {rope_type!r} is not supported (GLM-5 uses 'default')")

    # ---- transformers interop ----
    @classmethod
    def from_dict(cls, d: dict) -> "GLM5Config":
        model_type = d.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(f"config model_type is {model_type!r}; GLM5Config reads {MODEL_TYPE!r} configs")
        d = dict(d)
        if "rope_parameters" not in d or d["rope_parameters"] is None:
            # older configs: rope_theta / rope_scaling at the top level
            d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta", 1e6)}
        if d.get("indexer_types") is None:
            d["indexer_types"] = _indexer_pattern(d)
        if "num_experts" in d and "n_routed_experts" not in d:
            d["n_routed_experts"] = d["num_experts"]
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in names and k not in _HF_BOOKKEEPING
                         and not k.startswith("index_topk_") and k not in ("index_skip_topk_offset", "rope_theta",
                                                                            "num_experts", "rope_scaling"))
        if unknown:
            raise ValueError(f"config has fields GLM5Config does not know: {unknown}")
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_json(cls, path: str) -> "GLM5Config":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_hf_dict(self) -> dict:
        """Keyword arguments for transformers.GlmMoeDsaConfig (our extra fields dropped)."""
        d = dataclasses.asdict(self)
        d.pop("num_nextn_predict_layers")
        d["rope_parameters"] = dict(self.rope_parameters)
        return d

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"model_type": MODEL_TYPE, **dataclasses.asdict(self)}, f, indent=2)

    def replace(self, **changes) -> "GLM5Config":
        d = dataclasses.asdict(self)
        d.update(changes)
        if "num_hidden_layers" in changes or "first_k_dense_replace" in changes:
            d.setdefault("mlp_layer_types", None)
            if "mlp_layer_types" not in changes:
                d["mlp_layer_types"] = None
            if "indexer_types" not in changes:
                d["indexer_types"] = None
        return GLM5Config(**d)


def _indexer_pattern(d: dict) -> list:
    """transformers' default indexer_types: an explicit pattern, else the freq/offset schedule."""
    layers = d.get("num_hidden_layers", 78)
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(d.get("index_topk_freq", 1), 1)
    offset = d.get("index_skip_topk_offset", 2)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(layers)]


# ---- presets ----
def _glm5() -> GLM5Config:
    return GLM5Config()  # the published GLM-5 config is the default


def _seed_1_8t() -> GLM5Config:
    """The seed article's design (docs/ARCHITECTURE.md, "The seed article"): 128 experts with 8-12 active,
    ~1.8T parameters, compute of a ~200B dense model, each query reading the
    top 5% of keys at 32K, the predictor (indexer) within 3% of total compute.

    It gives only those totals, so this is GLM-5 at twice the width with every
    proportion kept: hidden 12288, 128 heads of the same MLA head dims
    (kv_lora 512, qk 192+64, v 256), q_lora = hidden/3, expert width =
    hidden/3, dense MLP = 2*hidden, 3 dense layers, the same 32x128 indexer and
    vocabulary. "Compute of a 200B dense model" is read as ~200B weights
    multiplied per token (2 FLOPs each, the 2N rule a dense model's compute is
    quoted by). Each MoE layer then holds ~133 hidden^2 parameters of which
    (5 + top_k) hidden^2 are active; with the dense layers, embeddings and
    indexers counted, 200B of 1.8T falls between top_k 9 (~196B) and
    10 (~210B): 9 is closer, so 9 routed + 1 shared = 10 experts per token,
    inside the article's 8-12. Depth 92 puts the total at 1.80T with 195B
    active (197B weights per token with the LM head; run
    `glm5-lab inspect --preset seed-1.8t`). index_topk 1600 is the largest
    multiple of 64 within 5% of 32K keys. To keep the indexer within 3% of the
    FLOPs at 32K context (decode 2.2%, prefill 1.3%) it runs on one layer in
    three and the layers between reuse its selection (indexer_types "shared",
    as transformers' index_topk_freq=3 lays it out); on every layer it would
    take 6.1% at 32K decode."""
    layers = 92
    return GLM5Config(
        hidden_size=12288, intermediate_size=24576, moe_intermediate_size=4096, num_hidden_layers=layers,
        first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=4096,
        n_routed_experts=128, num_experts_per_tok=9, n_shared_experts=1, index_topk=1600,
        indexer_types=_indexer_pattern({"num_hidden_layers": layers, "index_topk_freq": 3}))


def _small() -> GLM5Config:
    # GLM-5's shape at 1/6 width and 8 layers: every mechanism present (2 dense
    # layers then MoE, MLA, an 8-head indexer choosing 2048 keys, 64 experts in
    # 4 groups), small enough that transformers runs 8K-token prefill on a CPU.
    return GLM5Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
        num_hidden_layers=8, first_k_dense_replace=2, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=64, num_experts_per_tok=6, n_group=4, topk_group=2,
        index_n_heads=8, index_head_dim=64, index_topk=2048, max_position_embeddings=65536)


def _tiny() -> GLM5Config:
    # Seconds on a laptop CPU: for tests and the CI profile run. The indexer
    # keeps 8 heads so relu ties at exactly zero (all heads negative) stay rare.
    return GLM5Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        index_n_heads=8, index_head_dim=16, index_topk=16, max_position_embeddings=32768)


PRESETS = {"glm-5": _glm5, "seed-1.8t": _seed_1_8t, "small": _small, "tiny": _tiny}


def preset(name: str) -> GLM5Config:
    """A fresh config for a named preset: glm-5, seed-1.8t, small, tiny."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]()
