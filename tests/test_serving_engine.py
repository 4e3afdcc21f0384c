"""The serving engine against the simple path: a request served in a busy
batch gets exactly the tokens it gets alone (greedy, fp32), under continuous
batching with chunked prefill, with prefix caching on and off, and with
preemption forced by a pool too small for the load; bad input is refused
with an error naming the argument and harms no other request; aborts free
their pages."""
import random

import pytest
import torch

from models.glm5 import GLM5ForCausalLM, preset
from serving import Engine, SamplingParams


def _model(name="tiny", attn="dsa", seed=0, **changes):
    """Weights of std 1/sqrt(fan_in) (as tests/test_model.py): activations O(1), so
    the indexer's choice of keys, and every page read, changes the tokens."""
    torch.manual_seed(seed)
    model = GLM5ForCausalLM(preset(name).replace(**changes), attn=attn).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def _workload(vocab, n, seed, *, max_prompt, max_out, shared_prefixes=4, prefix_len=40):
    """n prompts of mixed lengths; half start with one of a few shared prefixes (prefix-cache hits)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(shared_prefixes)]
    prompts, params = [], []
    for i in range(n):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
        prompts.append(prefixes[i % shared_prefixes] + tail if i % 2 else tail)
        params.append(SamplingParams(max_tokens=rng.randint(1, max_out), temperature=0.0))
    return prompts, params


def _alone(model, prompts, params):
    engine = Engine(model, max_num_seqs=1, max_num_batched_tokens=4096, num_pages=256, page_size=16, log=False)
    return [engine.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params)]


def _busy(engine, prompts, params):
    """All requests added at once, then stepped to completion, checking the pages after every step."""
    for i, (p, q) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, q)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()          # the live requests and a static batch's padding slots
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages     # the pool is whole again
    return [tokens[f"r{i}"] for i in range(len(prompts))]


CASES = {   # name: (preset, attn, engine kwargs, workload kwargs)
    "tiny-dsa": ("tiny", "dsa", {}, {}),
    "tiny-dense": ("tiny", "dense", {}, {}),
    "tiny-dsa-prefix": ("tiny", "dsa", dict(enable_prefix_caching=True), {}),
    "tiny-dense-prefix": ("tiny", "dense", dict(enable_prefix_caching=True), {}),
    "tiny-dsa-preempt": ("tiny", "dsa", dict(num_pages=24), {}),
    "tiny-dsa-prefix-preempt": ("tiny", "dsa", dict(num_pages=24, enable_prefix_caching=True), {}),
    "tiny-dsa-spec": ("tiny", "dsa", dict(speculative=True), {}),
    "tiny-dense-spec-preempt": ("tiny", "dense", dict(speculative=True, num_pages=24), {}),
    "small-dsa": ("small", "dsa", {}, {}),
    "small-dense": ("small", "dense", {}, {}),
    "small-dsa-prefix-preempt": ("small", "dsa", dict(num_pages=24, enable_prefix_caching=True), {}),
}


_ALONE = {}


# (requests, shared prefixes) per workload: `tiny` takes 64 requests; `small` (8 wider layers,
# ~10x the time a token) takes 24, still more than max_num_seqs=16 running at once, so
# requests queue, chunk and (with 24 pages) get preempted; 2 shared prefixes, so each
# recurs 6 times (`tiny`'s 4 recur 8 times) and the prefix cache has hits to find.
WORKLOAD = {"tiny": (64, 4), "small": (24, 2)}


def _model_and_alone(name, attn):
    """The model, its workload and each request's tokens alone (computed once per model)."""
    if (name, attn) not in _ALONE:
        model = _model(name, attn)
        n, shared = WORKLOAD[name]
        prompts, params = _workload(model.config.vocab_size, n, seed=1, max_prompt=120, max_out=24,
                                    shared_prefixes=shared)
        _ALONE[name, attn] = model, prompts, params, _alone(model, prompts, params)
    return _ALONE[name, attn]


@pytest.mark.parametrize("case", sorted(CASES))
def test_busy_batch_gives_each_request_its_tokens_alone(case):
    name, attn, engine_kwargs, _ = CASES[case]
    model, prompts, params, alone = _model_and_alone(name, attn)
    kwargs = dict(max_num_seqs=16, max_num_batched_tokens=96, long_prefill_token_threshold=48, num_pages=200,
                  page_size=16, log=False)
    engine = Engine(model, **{**kwargs, **engine_kwargs})
    busy = _busy(engine, prompts, params)
    differ = [i for i in range(len(prompts)) if busy[i] != alone[i]]
    assert not differ, f"{case}: requests {differ} differ from their tokens alone"
    stats = engine.stats()
    if "preempt" in case:
        assert stats["num_preemptions"] > 0, "the small pool forced no preemption: the case tests nothing"
    if "prefix" in case:
        assert stats["prefix_cache_hit_rate"] > 0.1, stats
    if "spec" in case:
        assert stats["spec_drafts_proposed"][0] > 100, stats
        print(case, {k: v for k, v in stats.items() if k.startswith("spec")})


@pytest.mark.parametrize("poison", [float("nan"), float("-inf")])
def test_unwritten_pool_slots_never_reach_a_token(poison):
    """The pool comes from torch.empty: its unwritten slots hold whatever the
    heap held (the test suite's earlier tensors: -inf masks, NaN). Dense
    attention reads every key of a decode segment, masked past each sequence's
    end; a masked NaN or -inf key still poisons the softmax (q.k + -inf), so
    those positions must read the pool's zeroed null slot. Before that fix a
    busy batch's tokens depended on what ran earlier in the process."""
    model, prompts, params, alone = _model_and_alone("tiny", "dense")
    n = 16
    engine = Engine(model, max_num_seqs=16, max_num_batched_tokens=96, long_prefill_token_threshold=48,
                    num_pages=200, page_size=16, enable_prefix_caching=True, log=False)
    null = engine.pool.null_slot
    engine.pool.latent[:, :null].fill_(poison)
    busy = _busy(engine, prompts[:n], params[:n])
    differ = [i for i in range(n) if busy[i] != alone[i]]
    assert not differ, f"requests {differ} read unwritten slots"


def test_static_batch_padding_leaves_each_request_its_tokens_alone():
    """policy="static" computes pad tokens after each shorter prompt and in
    finished members' slots, on their own pages: no real token may see them."""
    model, prompts, params, alone = _model_and_alone("tiny", "dsa")
    n = 24
    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=96, num_pages=200, page_size=16,
                    policy="static", log=False)
    busy = _busy(engine, prompts[:n], params[:n])
    assert [i for i in range(n) if busy[i] != alone[i]] == []
    assert engine.stats()["padding_fraction"] > 0.2


def test_abort_mid_prefill_and_mid_decode_frees_pages():
    model = _model()
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=16, log=False)
    engine.add_request("long", list(range(100)), SamplingParams(max_tokens=50, temperature=0))
    engine.add_request("short", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
    engine.step()                                    # "long" is mid-prefill (32 of 100 tokens)
    assert 0 < engine.requests["long"].num_computed_tokens < 100
    engine.abort("long")
    engine.step()
    engine.step()                                    # "short" is decoding
    assert engine.requests["short"].output_token_ids
    engine.abort("short")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_pages == 64
    engine.abort("never-added")                      # unknown ids are ignored, as vLLM does


BAD = {
    "empty prompt": (dict(prompt_token_ids=[]), ValueError, "prompt_token_ids"),
    "prompt over the context": (dict(prompt_token_ids=[1] * 300), ValueError, "prompt_token_ids"),
    "token outside the vocabulary": (dict(prompt_token_ids=[1, 512]), ValueError, "prompt_token_ids"),
    "max_tokens 0": (dict(params=SamplingParams(max_tokens=0)), ValueError, "max_tokens"),
    "top_p 0": (dict(params=SamplingParams(top_p=0.0)), ValueError, "top_p"),
    "top_p over 1": (dict(params=SamplingParams(top_p=1.5)), ValueError, "top_p"),
    "negative temperature": (dict(params=SamplingParams(temperature=-0.5)), ValueError, "temperature"),
    "unknown stop id": (dict(params=SamplingParams(stop_token_ids=[100000])), ValueError, "stop_token_ids"),
    "id in use": (dict(request_id="good"), ValueError, "request_id"),
    "id not a str": (dict(request_id=7), TypeError, "request_id"),
    "more than the pool": (dict(params=SamplingParams(max_tokens=200)), ValueError, "max_tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_refused_and_harms_no_other(case):
    model = _model()
    prompt, params = [5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0)
    alone = _alone(model, [prompt], [params])[0]
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=64, num_pages=12, page_size=16, max_model_len=256,
                    log=False)
    engine.add_request("good", prompt, params)
    engine.step()
    bad, error, argument = BAD[case]
    kwargs = dict(request_id="bad", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4), **{})
    kwargs.update(bad)
    with pytest.raises(error, match=argument):
        engine.add_request(kwargs["request_id"], kwargs["prompt_token_ids"], kwargs["params"])
    out = None
    while engine.has_unfinished_requests():
        out = engine.step() or out
    assert out[0].request_id == "good" and out[0].outputs[0].token_ids == alone


def test_generate_keeps_prompt_order_and_reports_the_pool(capsys):
    model = _model()
    engine = Engine(model, max_num_seqs=8, kv_cache_memory="1MiB", page_size=16)
    assert "tokens" in capsys.readouterr().err                       # the pool's size in tokens is reported
    assert engine.max_tokens_in_pool == engine.pool.num_pages * 16
    prompts = [[3] * n for n in (50, 2, 17)]
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m, temperature=0) for m in (3, 9, 5)],
                           use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_stop_token_ends_the_request():
    model = _model()
    engine = Engine(model, num_pages=32, page_size=16, log=False)
    free_run = engine.generate([[9, 8, 7]], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0]
    stop = free_run.outputs[0].token_ids[3]
    out = engine.generate([[9, 8, 7]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop]),
                          use_tqdm=False)[0].outputs[0]
    first = free_run.outputs[0].token_ids.index(stop)
    assert out.token_ids == free_run.outputs[0].token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_accepted_drafts_give_the_same_tokens():
    """Random weights make MTP a poor drafter (almost every draft is rejected),
    so here drafts are replaced after the MTP layer ran: the true next token for
    even requests (always accepted), a wrong one for odd requests (always
    rejected). The tokens must still be the requests' tokens alone, with two
    tokens per verifying forward where drafts are right."""
    model, prompts, params, alone = _model_and_alone("tiny", "dsa")
    prompts, params, alone = prompts[:16], params[:16], alone[:16]
    engine = Engine(model, max_num_seqs=16, max_num_batched_tokens=96, num_pages=200, page_size=16,
                    speculative=True, log=False)
    truth = {f"r{i}": alone[i] for i in range(16)}
    real_draft = engine.drafter.draft

    def draft(batch, hidden, wants_draft):
        real_draft(batch, hidden, wants_draft)
        for req in engine.requests.values():
            if req.spec_token_ids:
                right = truth[req.request_id][len(req.output_token_ids)]
                even = int(req.request_id[1:]) % 2 == 0
                req.spec_token_ids = [right if even else (right + 1) % model.config.vocab_size]

    engine.drafter.draft = draft
    busy = _busy(engine, prompts, params)
    assert busy == alone
    stats = engine.stats()
    # even requests accept every draft and so finish in about half the verifications: about 1/3 of all
    assert 0.15 < stats["spec_acceptance_per_position"][0] < 0.6, stats
    assert stats["spec_tokens_per_verify"] > 1.1, stats


@pytest.mark.parametrize("speculative", [False, True])
def test_logprobs_of_the_chosen_tokens(speculative):
    model = _model()
    engine = Engine(model, num_pages=32, page_size=16, speculative=speculative, log=False)
    prompt = [4, 5, 6, 7]
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=2), use_tqdm=False)[0]
    c = out.outputs[0]
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        expected = model(ids)[0, len(prompt) - 1:-1].float().log_softmax(-1)
    chosen = expected.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(c.logprobs), chosen, atol=1e-4)
    assert len(c.top_logprobs) == 6 and all(t in top for t, top in zip(c.token_ids, c.top_logprobs))
