"""The GLM-5 model's entry points as fuzz targets (hypothesis side): input ids
(empty, out of vocabulary, negative, floating, bool), lengths past
max_position_embeddings, caches too small, bad chunk sizes and generation
settings. The worker runs them on models.glm5's tiny preset with
max_position_embeddings=MAX_POS, so a too-long input stays cheap to build.
"""
from __future__ import annotations

from hypothesis import strategies as st

from .ops import Arg
from .spec import tensor

MAX_POS = 96
VOCAB = 512          # the tiny preset's vocab_size
ATTN = ("dsa", "block_sparse", "dense")


def _ids(draw, d, name="input_ids", lo_b=1, lo_s=1) -> Arg:
    B, S = draw(st.integers(lo_b, 2)), draw(st.one_of(st.integers(lo_s, 20), st.sampled_from([33, 70])))
    return Arg(name, tensor([B, S], "int64", f"randint:0:{VOCAB}"), "index_t", bound=VOCAB)


def _attn(draw) -> Arg:
    return Arg("attn", draw(st.sampled_from(ATTN)), "str", True)


def forward(draw, d, raw):
    ids = _ids(draw, d)
    B, S = ids.value["tensor"]["shape"]
    cache = draw(st.one_of(st.none(), st.integers(S, S + 8)))
    return [_attn(draw), ids, Arg("max_tokens", cache, "int", True),
            Arg("logits_to_keep", draw(st.integers(0, S)), "int", True)]


def decode(draw, d, raw):
    """prefill `prompt` tokens into a cache, then one forward of input_ids (one token each)."""
    prompt = _ids(draw, d, "prompt")
    B, n = prompt.value["tensor"]["shape"]
    ids = Arg("input_ids", tensor([B, 1], "int64", f"randint:0:{VOCAB}"), "index_t", bound=VOCAB)
    return [_attn(draw), prompt, ids, Arg("max_tokens", draw(st.integers(n + 1, n + 4)), "int", True)]


def prefill(draw, d, raw):
    ids = _ids(draw, d)
    S = ids.value["tensor"]["shape"][1]
    return [_attn(draw), ids, Arg("max_tokens", draw(st.integers(S, S + 4)), "int", True),
            Arg("chunk", draw(st.one_of(st.integers(1, 8), st.sampled_from([2048]))), "int", True)]


def generate(draw, d, raw):
    ids = _ids(draw, d)
    sample = draw(st.booleans())
    return [_attn(draw), ids, Arg("max_new_tokens", draw(st.integers(1, 4)), "int"),
            Arg("do_sample", sample, "bool", True),
            Arg("temperature", draw(st.sampled_from([1.0, 0.7])), "float", True),
            Arg("top_k", draw(st.sampled_from([0, 1, 5])), "int", True),
            Arg("top_p", draw(st.sampled_from([1.0, 0.9])), "float", True),
            Arg("prefill_chunk", draw(st.sampled_from([2048, 3])), "int", True),
            Arg("page_size", draw(st.sampled_from([64, 1, 5])), "int", True)]


def speculative_generate(draw, d, raw):
    ids = _ids(draw, d)
    return [_attn(draw), ids, Arg("max_new_tokens", draw(st.integers(1, 4)), "int"),
            Arg("prefill_chunk", draw(st.sampled_from([2048, 3])), "int", True),
            Arg("page_size", draw(st.sampled_from([64, 1, 5])), "int", True)]


def new_cache(draw, d, raw):
    return [_attn(draw), Arg("batch", draw(st.integers(1, 3)), "int"),
            Arg("max_tokens", draw(st.integers(1, MAX_POS)), "int"),   # the cache holds at most MAX_POS
            Arg("page_size", draw(st.sampled_from([64, 1, 7])), "int", True)]


MODEL = {"forward": forward, "decode": decode, "prefill": prefill, "generate": generate,
         "speculative_generate": speculative_generate, "new_cache": new_cache}
