"""serving: SamplingParams.validate names every bad argument; the Sampler's
greedy, seeded, top_k / top_p and logprob behaviour."""
import math

import pytest
import torch

from serving.params import SamplingParams
from serving.request import Request
from serving.sampler import Sampler

V = 12
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def req(rid, **params):
    return Request(rid, [1, 2, 3], SamplingParams(**params))


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(max_tokens=0), ValueError, "max_tokens must be >= 1"),
    (dict(max_tokens=2.0), TypeError, "max_tokens must be an int"),
    (dict(max_tokens=True), TypeError, "max_tokens must be an int"),
    (dict(temperature=-0.5), ValueError, "temperature must be a finite float >= 0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite"),
    (dict(temperature="1"), TypeError, "temperature must be a float"),
    (dict(top_p=0.0), ValueError, "top_p must be in (0, 1]"),
    (dict(top_p=1.5), ValueError, "top_p must be in (0, 1]"),
    (dict(top_p=None), TypeError, "top_p must be a float"),
    (dict(top_k=-2), ValueError, "top_k must be >= 1, or 0 / -1"),
    (dict(top_k=2.5), TypeError, "top_k must be an int"),
    (dict(seed=1.0), TypeError, "seed must be an int"),
    (dict(seed=2**64), ValueError, "seed must be in"),
    (dict(stop_token_ids=[V]), ValueError, "stop_token_ids must be in [0, vocab_size=12)"),
    (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids must be in"),
    (dict(stop_token_ids=["3"]), TypeError, "stop_token_ids must hold ints"),
    (dict(stop_token_ids=3), TypeError, "stop_token_ids must be a list or tuple"),
    (dict(logprobs=-1), ValueError, "logprobs must be in [0, vocab_size=12]"),
    (dict(logprobs=1.0), TypeError, "logprobs must be an int or None"),
])
def test_validate_names_the_argument(kwargs, exc, message):
    with pytest.raises(exc, match=message.replace("(", r"\(").replace("[", r"\[").replace(")", r"\)")):
        SamplingParams(**kwargs).validate(V)


def test_validate_accepts_the_edges():
    for kwargs in (dict(), dict(temperature=0), dict(top_k=-1), dict(top_k=0), dict(top_p=1.0), dict(seed=-3),
                   dict(stop_token_ids=(0, V - 1)), dict(logprobs=0), dict(logprobs=V), dict(max_tokens=1)):
        SamplingParams(**kwargs).validate(V)
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_ties_take_the_lowest_id(device):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    logits[3, 5] = logits[3, 7] = 50.0
    ids, lps, tops = Sampler().sample(logits.to(device), [req(f"r{i}", temperature=0.0) for i in range(4)])
    assert ids == logits.argmax(-1).tolist() and ids[3] == 5
    assert lps == [None] * 4 and tops == [None] * 4


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_request_samples_the_same_alone_or_in_a_batch(device):
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(5, V, generator=g).to(device)
    target = rows[2:3]

    def draws(batch_rows, index, seed, steps=20):
        sampler = Sampler()
        reqs = [req(f"r{i}", temperature=0.9, top_p=0.9, seed=(seed if i == index else None))
                for i in range(batch_rows.shape[0])]
        return [sampler.sample(batch_rows, reqs)[0][index] for _ in range(steps)]

    alone = draws(target, 0, seed=42)
    torch.manual_seed(123)                  # the unseeded rows' draws must not shift the seeded one
    in_batch = draws(rows, 2, seed=42)
    assert alone == in_batch
    assert len(set(alone)) > 1              # really sampled, not greedy
    assert draws(target, 0, seed=43) != alone


def test_release_drops_the_generator_so_a_reused_id_restarts_its_sequence():
    sampler = Sampler()
    logits = torch.zeros(1, V)
    r = req("a", seed=5)
    first = [sampler.sample(logits, [r])[0][0] for _ in range(10)]
    sampler.release("a")
    again = [sampler.sample(logits, [r])[0][0] for _ in range(10)]
    assert first == again and sampler._generators.keys() == {"a"}
    sampler.release("a")
    assert not sampler._generators


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2))
    greedy = logits.argmax(-1).tolist()
    torch.manual_seed(0)
    for _ in range(20):
        assert Sampler().sample(logits, [req(f"k{i}", temperature=1.5, top_k=1) for i in range(6)])[0] == greedy
        assert Sampler().sample(logits, [req(f"p{i}", temperature=1.5, top_p=1e-6) for i in range(6)])[0] == greedy


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_and_top_p_restrict_the_support(device):
    # probabilities 0.4, 0.3, 0.15, 0.1, 0.05 on ids 3, 0, 7, 1, 9; the rest -inf-ish
    probs = torch.full((V,), 1e-12)
    for i, p in zip((3, 0, 7, 1, 9), (0.4, 0.3, 0.15, 0.1, 0.05)):
        probs[i] = p
    rows = 1000                 # per rule, in one batch: 3000 draws a call, 2 calls
    logits = probs.log()[None].repeat(3 * rows, 1).to(device)
    sampler = Sampler()
    reqs = ([req(f"k{i}", top_k=2) for i in range(rows)] + [req(f"p{i}", top_p=0.8) for i in range(rows)]
            + [req(f"a{i}", seed=i) for i in range(rows)])        # seeded: each row its own generator
    seen = [set(), set(), set()]
    for _ in range(2):
        ids = sampler.sample(logits, reqs)[0]
        for rule in range(3):
            seen[rule].update(ids[rule * rows:(rule + 1) * rows])
    assert seen[0] == {3, 0}
    assert seen[1] == {3, 0, 7}             # 0.4 + 0.3 < 0.8: the smallest prefix reaching it adds id 7
    assert seen[2] == {3, 0, 7, 1, 9}


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_log_softmax_of_the_raw_logits(device):
    logits = (torch.randn(3, V, generator=torch.Generator().manual_seed(4)) * 3).to(device)
    reqs = [req("a", temperature=0.0, logprobs=0), req("b", temperature=2.0, seed=9, logprobs=3),
            req("c", temperature=0.7)]
    ids, lps, tops = Sampler().sample(logits, reqs)
    ref = logits.log_softmax(-1)
    assert lps[0] == pytest.approx(ref[0, ids[0]].item()) and tops[0] is None
    assert lps[1] == pytest.approx(ref[1, ids[1]].item())     # untempered, though drawn at temperature 2
    assert lps[2] is None and tops[2] is None
    top3 = ref[1].topk(3)
    expect = dict(zip(top3.indices.tolist(), top3.values.tolist()))
    expect.setdefault(ids[1], ref[1, ids[1]].item())
    assert tops[1].keys() == expect.keys()
    assert all(math.isclose(tops[1][k], v, rel_tol=1e-5) for k, v in expect.items())


def test_sample_checks_the_logits_shape():
    with pytest.raises(ValueError, match="one row per request"):
        Sampler().sample(torch.zeros(2, V), [req("a")])
    assert Sampler().sample(torch.zeros(0, V), []) == ([], [], [])
