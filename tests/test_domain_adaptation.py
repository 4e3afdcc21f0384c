"""bench/domain_adaptation.py at tiny sizes: the identifier mask marks exactly
the identifier bytes (not keywords, strings, comments; multi-byte names and
form feeds counted right), the scoring windows score every byte once, and
the three adaptation variants train what they claim: LoRA without the router
adapter leaves the routers (and everything else but the attention
projections) untouched, with it the routers change, full fine-tuning changes
every weight the LM loss reaches."""
from __future__ import annotations

import pytest
import torch

from bench.domain_adaptation import (adapt, draw_samples, effective_weights, evaluate, identifier_mask,
                                     make_variant, new_model, scoring_windows, tiny_config)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def one_thread():
    # on a shared 2-core machine two torch threads ran these steps ~40x slower than one
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _marked(src: bytes) -> list[bytes]:
    m = identifier_mask(src).tolist() + [False]
    out, cur = [], bytearray()
    for b, k in zip(src + b"\0", m):
        if k:
            cur.append(b)
        elif cur:
            out.append(bytes(cur))
            cur = bytearray()
    return out


def test_identifier_mask_marks_exactly_the_names():
    src = ('def parse_addr(x, *, strict=True):\n'
           '\x0c\n'                                   # a form feed: str.splitlines would shift the rows
           '    """doc with words"""  # and comments\n'
           '    return x.lower() if not None else "caf\u00e9"\n'
           'caf\u00e9 = parse_addr\n').encode()
    assert _marked(src) == [b"parse_addr", b"x", b"strict", b"x", b"lower", "caf\u00e9".encode(), b"parse_addr"]
    assert identifier_mask(src).sum() == 10 + 1 + 6 + 1 + 5 + 5 + 10
    # source that does not tokenize keeps the names before the error
    assert _marked(b"foo = (\n") == [b"foo"]


@pytest.mark.parametrize("n,seq,stride", [(10, 4, 2), (300, 256, 128), (1000, 64, 32), (65, 64, 32)])
def test_scoring_windows_score_every_byte_once(n, seq, stride):
    got = []
    for s, first in scoring_windows(n, seq, stride):
        assert 0 <= s and s + seq <= n - 1
        got += [s + 1 + j for j in range(first, seq)]
    assert sorted(got) == list(range(1, n))


def test_variants_train_what_they_claim(one_thread):
    config = tiny_config()
    base = new_model(config, "dsa", seed=0)
    state = {k: v.detach().clone() for k, v in base.state_dict().items()}
    before = effective_weights(base)
    text = torch.frombuffer(bytearray(open(__file__, "rb").read()), dtype=torch.uint8).clone()
    samples = draw_samples(text, 4, 32, seed=0)
    start = bytes(text.numpy()).find(b"def _marked")
    held = text[start:start + 400]
    general = draw_samples(text, 2, 32, seed=1)
    masks = dict(ident=identifier_mask(held.numpy().tobytes()))
    base_eval = evaluate(base, held, masks, general, seq=32, stride=16)
    assert base_eval["n_ident"] > 100 and 0 <= base_eval["acc_ident"] <= 1

    changed, counts = {}, {}
    for variant in ("lora", "lora+router", "full"):
        model, counts[variant] = make_variant(state, config, "dsa", variant)
        # a fresh adapter adds exact zeros: the same numbers as the base model
        assert evaluate(model, held, masks, general, seq=32, stride=16) == base_eval
        adapt(model, samples, batch=2, lr=1e-2, warmup=1, log=lambda *_: None)
        after = effective_weights(model)
        assert after.keys() == before.keys()
        changed[variant] = {k for k in before if not torch.equal(before[k], after[k])}

    routers = {k for k in before if k.endswith("mlp.gate.weight")}
    attention = {k for k in before if k.rsplit(".", 1)[0].endswith(
        ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))}
    assert len(routers) == config.num_hidden_layers - config.first_k_dense_replace
    assert changed["lora"] == attention                      # not the routers, nothing else
    assert changed["lora+router"] == attention | routers
    # full fine-tuning: every weight the LM loss reaches (DSA's indexer is trained by its own KL loss)
    indexer = {k for k in before if ".indexer." in k}
    assert changed["full"] == set(before) - indexer
    assert counts["lora"] < counts["lora+router"] < counts["full"] == sum(p.numel() for p in base.parameters())
