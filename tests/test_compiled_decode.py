"""GLM5ForCausalLM.compile_decode: decode steps through torch.compile'd layers
give the eager steps' tokens, logits and cache, as one graph (no graph break)
that stays compiled as the context grows (dynamic, not one compile per length),
across index_topk (every key -> the indexer's selection)."""
import pytest
import torch
import torch._dynamo

from models.glm5 import GLM5ForCausalLM
from models.glm5.config import preset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not torch._C._has_mkldnn,
                                reason="no inductor backend")


# Tests about what a compiled step reads, not about its wrapper, compile with the Python
# wrapper: the C++ one (compile_decode's CPU default, test_compiled_decode_matches_eager)
# costs its own C++ compile per graph (~25 s more for these two tests on a cold cache).
PY_WRAPPER = {"cpp_wrapper": False}


def _decode(model, prompt, steps):
    cache = model.new_cache(1, prompt.shape[1] + steps)
    with torch.inference_mode():
        logits, _ = model.prefill(prompt, cache)
        tokens, all_logits = [], [logits]
        nxt = logits.argmax(-1).view(1, 1)
        for _ in range(steps):
            logits = model(nxt, cache)[:, -1]
            all_logits.append(logits)
            nxt = logits.argmax(-1).view(1, 1)
            tokens.append(int(nxt))
    return tokens, torch.stack(all_logits), cache


def test_compiled_decode_matches_eager():
    torch.manual_seed(0)
    model = GLM5ForCausalLM(preset("tiny")).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, model.config.index_topk - 4))
    steps = 12                                     # crosses index_topk at step 4
    tokens, logits, cache = _decode(model, prompt, steps)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.compile_decode()
    c_tokens, c_logits, c_cache = _decode(model, prompt, steps)

    assert c_tokens == tokens
    # inductor fuses the small ops around the kernels (residual adds, the indexer's LayerNorm,
    # the rope tables): a few fp32 ulps of the logits
    torch.testing.assert_close(c_logits, logits, rtol=1e-5, atol=1e-5)
    written = cache.slots(cache.length)[0]         # the slots past them hold torch.empty's leftovers
    assert torch.equal(c_cache.slots(c_cache.length)[0], written)
    layers = model.config.num_hidden_layers       # the MTP layer's slots: not run here
    torch.testing.assert_close(c_cache.pool.latent[:layers, written], cache.pool.latent[:layers, written],
                               rtol=1e-5, atol=1e-5)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    # the first length, the length made dynamic, and the indexer's branch past index_topk
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3


def test_compile_decode_rebuilds_derived_weights():
    """compile_decode() takes kv_b_proj as it is now; a weight changed later needs compile_decode() again."""
    torch.manual_seed(1)
    model = GLM5ForCausalLM(preset("tiny")).eval()
    attn = model.model.layers[0].self_attn
    model.compile_decode()
    before = attn._derived["w_uk_rows"][1].clone()
    with torch.no_grad():
        attn.kv_b_proj.weight.mul_(2)
    model.compile_decode()
    torch.testing.assert_close(attn._derived["w_uk_rows"][1], before * 2)


def test_compiled_decode_reads_the_weights_of_each_step():
    """The compiled step reads the weights at each call: a weight changed in place, or a
    parameter replaced by one of the same shape, shows in the next compiled step as in eager."""
    torch.manual_seed(2)
    model = GLM5ForCausalLM(preset("tiny")).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 9))
    torch._dynamo.reset()
    model.compile_decode(options=PY_WRAPPER)
    _, before, _ = _decode(model, prompt, 3)       # compiled, at these weights
    with torch.no_grad():
        model.model.layers[1].self_attn.q_a_proj.weight.mul_(-1.5)
    dense = model.model.layers[0].mlp                 # first_k_dense_replace: layer 0's MLP is dense
    dense.down_proj.weight = torch.nn.Parameter(torch.randn_like(dense.down_proj.weight))
    c_tokens, c_logits, _ = _decode(model, prompt, 3)
    model._decode_layers = None                    # eager steps from here
    tokens, logits, _ = _decode(model, prompt, 3)
    assert c_tokens == tokens
    torch.testing.assert_close(c_logits, logits, rtol=1e-5, atol=1e-5)
    assert (c_logits - before).abs().max() > 1e-2      # the changes did change the step


def test_two_compiled_models_in_one_process_each_get_their_own_graph():
    """Models of different structure (fp32 and int8 layers) compiled in one process: each
    step runs its own model's graph. The compiled step has no guards on module attributes
    (decode_compile.py): what keeps the int8 model off the fp32 graph is that each
    compile_decode() compiles its own copy of the code (with one shared code object, the
    second model reused the first's graph)."""
    from models.glm5 import quantize
    torch.manual_seed(3)
    fp32 = GLM5ForCausalLM(preset("tiny")).eval()
    int8 = quantize(GLM5ForCausalLM(preset("tiny")).eval(), "int8_weight_only")
    prompt = torch.randint(0, fp32.config.vocab_size, (1, 7))
    eager = [_decode(m, prompt, 3)[1] for m in (fp32, int8)]
    torch._dynamo.reset()
    for m in (fp32, int8):
        m.compile_decode(options=PY_WRAPPER)
    for m, expect in zip((fp32, int8), eager):
        torch.testing.assert_close(_decode(m, prompt, 3)[1], expect, rtol=1e-5, atol=1e-5)


def test_compile_decode_again_after_quantizing_runs_the_new_structure():
    """A model compiled, then quantised in place and compiled again: its steps run a graph
    traced for the int8 layers (the first graph, found again without module guards, would
    feed int8 weights to the fp32 path), and equal the eager int8 steps."""
    from models.glm5 import quantize
    torch.manual_seed(4)
    model = GLM5ForCausalLM(preset("tiny")).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 7))
    torch._dynamo.reset()
    model.compile_decode(options=PY_WRAPPER)
    _decode(model, prompt, 2)
    quantize(model, "int8_weight_only")
    model._decode_layers = None
    _, eager, _ = _decode(model, prompt, 3)
    model.compile_decode(options=PY_WRAPPER)
    _, compiled, _ = _decode(model, prompt, 3)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_compile_options_drop_module_guards_and_add_the_cpp_wrapper_on_the_cpu():
    from models.glm5.decode_compile import decode_compile_options
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    skip = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    assert decode_compile_options({}, cpu) == {"options": {"guard_filter_fn": skip, "cpp_wrapper": True}}
    assert decode_compile_options({"mode": "default", "options": {"max_autotune": False}}, cpu) == \
        {"mode": "default", "options": {"guard_filter_fn": skip, "cpp_wrapper": True, "max_autotune": False}}
    assert decode_compile_options({"options": {"cpp_wrapper": False}}, cpu) == \
        {"options": {"guard_filter_fn": skip, "cpp_wrapper": False}}
    assert decode_compile_options({}, cuda) == {"options": {"guard_filter_fn": skip}}
    assert decode_compile_options({"options": {"guard_filter_fn": None}}, cuda) == {"options": {"guard_filter_fn": None}}
