"""bench/llamacpp (the llama.cpp comparison): the parts that need no llama.cpp.
The suite never fetches or builds llama.cpp; these check its failure messages,
the tokenizer the converter reads, and the agreement metric."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from llamacpp import build as lbuild  # noqa: E402
from llamacpp.tokenizer import GLM_SPECIAL_TOKENS, tokenizer_size, write_glm_tokenizer  # noqa: E402


def test_missing_toolchain_is_named(monkeypatch):
    monkeypatch.setattr(lbuild.shutil, "which", lambda name: None if name == "cmake" else f"/usr/bin/{name}")
    with pytest.raises(lbuild.LlamaCppUnavailable, match="cmake not found"):
        lbuild.check_toolchain()
    monkeypatch.setattr(lbuild.shutil, "which", lambda name: None)
    with pytest.raises(lbuild.LlamaCppUnavailable, match="cmake, a C compiler, a C\\+\\+ compiler not found"):
        lbuild.build(home="/nonexistent-never-created")


def test_registry_failure_is_reported_with_pip_output(monkeypatch, tmp_path):
    """No network to the registry: pip fails, and the error carries what it said."""
    class Failed:
        returncode = 1
        stdout = "ERROR: Could not find a version that satisfies the requirement llama-cpp-python==0.0.0"
    monkeypatch.setattr(lbuild.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(lbuild.LlamaCppUnavailable, match="(?s)downloading llama-cpp-python 0.0.0.*registry reachable.*Could not find"):
        lbuild.fetch_source(str(tmp_path), "0.0.0")


def test_compare_script_exits_2_with_the_reason(monkeypatch, capsys):
    import llamacpp_compare
    monkeypatch.setattr(lbuild.shutil, "which", lambda name: None)
    assert llamacpp_compare.main(["build", "--llamacpp-home", "/nonexistent-never-created"]) == 2
    assert "llama.cpp unavailable: cannot build llama.cpp here" in capsys.readouterr().err


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="jobs"):
        lbuild.build(home=str(tmp_path), jobs=0)
    with pytest.raises(ValueError, match="vocab_size"):
        write_glm_tokenizer(str(tmp_path), tokenizer_size() - 1)
    with pytest.raises(ValueError, match="path"):
        write_glm_tokenizer(str(tmp_path / "absent"), 512)


def test_glm_tokenizer_loads_with_glm_special_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    ids = write_glm_tokenizer(str(tmp_path), 512)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    added = tok.get_added_vocab()
    for name in ("[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>"):   # the converter looks these up
        assert added[name] == ids[name]
    assert len(tok) == tokenizer_size() and max(ids.values()) < 512
    assert sorted(ids.values()) == list(range(tokenizer_size() - len(GLM_SPECIAL_TOKENS), tokenizer_size()))
    text = "héllo [gMASK]<|user|> the"
    enc = tok.encode(text)
    assert ids["[gMASK]"] in enc and tok.decode(enc) == text
    assert tok.encode("h")[0] == ord("h")          # byte tokens sit at their byte value


def test_agreement_metrics():
    from llamacpp_compare import agreement_metrics
    ref = np.array([[1.0, 3.0, 2.0], [4.0, 0.0, -1.0]])
    same = agreement_metrics(ref, ref)
    assert same == {"top1": 1.0, "worst_rel": 0.0, "median_rel": 0.0, "within_1e-3": 1.0,
                    "first_off": -1}
    other = ref.copy()
    other[1, 1] = 4.5                                 # flips row 1's argmax, off by 4.5 of max |ref| = 4
    m = agreement_metrics(other, ref)
    assert m["top1"] == 0.5 and m["worst_rel"] == pytest.approx(4.5 / 4) and m["within_1e-3"] == 0.5
    assert m["first_off"] == 1
    with pytest.raises(ValueError, match="shape"):
        agreement_metrics(ref[:1], ref)
