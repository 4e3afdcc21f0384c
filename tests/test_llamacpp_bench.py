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


def _row(engine, precision, task, n, tok_s, started="2026-12-04 10:00:00 UTC"):
    return {"engine": engine, "precision": precision, "task": task, "n": n, "tok_s": tok_s, "started": started}


def test_speed_table_pairs_each_measurement_and_the_newest_wins():
    from llamacpp_report import speed_table
    rows = [_row("ours", "fp32", "decode", 0, 20.0, "2026-12-04 09:00:00 UTC"),
            _row("llama.cpp", "fp32", "decode", 0, 50.0, "2026-12-04 09:00:00 UTC"),
            _row("ours", "fp32", "decode", 0, 60.0), _row("llama.cpp", "fp32", "decode", 0, 40.0),   # a rerun
            _row("ours", "fp32", "prefill", 4096, 600.0), _row("llama.cpp", "fp32", "prefill", 4096, 200.0),
            _row("ours", "int8", "prefill", 4096, 500.0)]                                # no Q8_0 row
    lines = speed_table(rows).splitlines()
    assert lines[2].startswith("| prefill 4,096 tokens | 600.0 | 200.0 | **3.00x** | 500.0 | - | - |")
    assert lines[3].startswith("| decode at depth 0 | 60.0 | 40.0 | **1.50x** | - | - | - |")
    assert len(lines) == 4


def test_speed_table_marks_compiled_decode_rows():
    from llamacpp_report import speed_table
    rows = [{**_row("ours", "fp32", "decode", 0, 60.0), "compiled": True}, _row("llama.cpp", "fp32", "decode", 0, 40.0)]
    assert speed_table(rows).splitlines()[2].startswith("| decode at depth 0 | 60.0 (compiled) | 40.0 | **1.50x** |")


def test_repeated_measurements_give_each_engines_median():
    """--repeat: the newest run's repeats of a point give each engine's median (an older run
    of the same point does not mix in) and the cell shows their range."""
    from llamacpp_report import latest, speed_table
    old = "2026-12-04 09:00:00 UTC"
    rows = [_row("ours", "fp32", "decode", 0, 10.0, old), _row("llama.cpp", "fp32", "decode", 0, 99.0, old)]
    rows += [_row("ours", "fp32", "decode", 0, v) for v in (60.0, 50.0, 58.0)]
    rows += [_row("llama.cpp", "fp32", "decode", 0, v) for v in (40.0, 70.0, 45.0, 30.0)]
    best = latest(rows)
    assert best[("ours", "fp32", "decode", 0)]["tok_s"] == 58.0
    assert best[("llama.cpp", "fp32", "decode", 0)]["tok_s"] == 42.5          # even count: the middle two
    assert best[("llama.cpp", "fp32", "decode", 0)]["reps"] == 4
    line = speed_table(rows).splitlines()[2]
    assert line.startswith("| decode at depth 0 | 58.0 (median of 3: 50-60) | 42.5 (median of 4: 30-70) | **1.36x** |")


def test_results_block_is_replaced_between_its_markers():
    from llamacpp_report import BEGIN, END, replace_block
    text = f"intro\n{BEGIN}\nold table\n{END}\nafter\n"
    assert replace_block(text, "new") == f"intro\n{BEGIN}\nnew\n{END}\nafter\n"
    with pytest.raises(ValueError, match="markers"):
        replace_block("no markers here", "new")


def test_llama_bench_commands():
    from llamacpp.build import LlamaCpp
    from llamacpp.speed import WARMUP_MAX_PROMPT, llama_bench_cmd
    lc = LlamaCpp("/p", "/s", "/b")
    pp = llama_bench_cmd(lc, "m.gguf", "prefill", 512, 2, 128)
    assert pp[:1] == ["/b/bin/llama-bench"] and "-p 512 -n 0" in " ".join(pp) and "--no-warmup" not in pp
    assert "--no-warmup" in llama_bench_cmd(lc, "m.gguf", "prefill", WARMUP_MAX_PROMPT + 1, 2, 128)
    tg = " ".join(llama_bench_cmd(lc, "m.gguf", "decode", 4096, 2, 128))
    assert "-t 2" in tg and "-p 0 -n 128 -d 4096" in tg


def test_speed_arguments_are_checked(capsys):
    import llamacpp_compare
    with pytest.raises(SystemExit):
        llamacpp_compare.main(["speed", "--precision", "fp16"])
    assert "fp32, int8, int8_head" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        llamacpp_compare.main(["speed", "--decode-steps", "0"])
    assert "--decode-steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        llamacpp_compare.main(["speed", "--repeat", "0"])
    assert "--repeat must be >= 1" in capsys.readouterr().err


def test_int8_head_is_the_default_skip_list_less_the_lm_head():
    """Q8_0 quantises the LM head: int8_head is our like-for-like model, int8 our default."""
    from llamacpp.speed import GGUF_TYPE, int8_skip
    from models.glm5.quantization import DEFAULT_SKIP
    assert int8_skip("int8") == DEFAULT_SKIP
    assert set(int8_skip("int8_head")) == set(DEFAULT_SKIP) - {"lm_head"} and "lm_head" in DEFAULT_SKIP
    assert GGUF_TYPE["int8"] == GGUF_TYPE["int8_head"] == "q8_0"
    with pytest.raises(ValueError, match="not an int8 precision"):
        int8_skip("fp32")


def test_speed_table_has_the_int8_head_pair():
    from llamacpp_report import speed_table
    rows = [_row("ours", "int8_head", "decode", 0, 90.0), _row("llama.cpp", "int8_head", "decode", 0, 60.0)]
    lines = speed_table(rows).splitlines()
    assert "ours int8, LM head int8" in lines[0]
    assert lines[2].startswith("| decode at depth 0 | - | - | - | - | - | - | 90.0 | 60.0 | **1.50x** |")


def test_our_decode_measurement_runs_llama_benchs_loop(tmp_path):
    """ours_speed's decode: the depth prefilled untimed, then one-token forwards fed
    random tokens (llama-bench's tg loop: no sampling), on a saved int8 model."""
    import torch

    from llamacpp import ours_speed
    from llamacpp.speed import int8_skip
    from models.glm5 import GLM5ForCausalLM, preset, quantize, save_quantized
    torch.manual_seed(0)
    save_quantized(quantize(GLM5ForCausalLM(preset("tiny")).eval(), "int8_weight_only", skip=int8_skip("int8")),
                   str(tmp_path))
    r = ours_speed.measure(str(tmp_path), "int8", "decode", 5, 3, 16)
    assert (r["engine"], r["task"], r["steps"], r["depth_filled"], r["compiled"]) == ("ours", "decode", 3, 5, False)
    assert r["tok_s"] > 0


def test_timed_decode_feeds_tensors_a_compiled_step_takes_without_recompiling():
    """Dynamo guards on input_ids' strides: a slice of one long token tensor has stride
    (steps, 1), which differs from the warm-up's and recompiled inside the timed loop
    (20 tok/s where the compiled step runs 150). Every step must get a fresh [1, 1]."""
    from types import SimpleNamespace

    from llamacpp import ours_speed
    seen = []

    class Model:
        config = SimpleNamespace(vocab_size=100)

        def __call__(self, x, cache):
            seen.append((tuple(x.shape), x.stride()))

    ours_speed._decode(Model(), None, 5, seed=0)
    assert seen == [((1, 1), (1, 1))] * 5


def test_report_keeps_published_rows_a_fresh_clone_has_no_runs_for(tmp_path):
    """The report merges the rows it published last with the runs folder: a new depth-0 run
    replaces its own cells and leaves the rest (measured on another machine, runs/ not
    cloned); a published row whose run is still in the folder comes from that run alone."""
    import json

    from llamacpp_report import latest, load_published
    old, new = "2026-12-05 22:28:35 UTC", "2026-12-06 06:02:00 UTC"
    published = [_row("ours", "fp32", "decode", 4096, 50.5, old), _row("llama.cpp", "fp32", "decode", 4096, 33.6, old),
                 _row("ours", "fp32", "decode", 0, 58.7, old), _row("llama.cpp", "fp32", "decode", 0, 58.1, old)]
    path = tmp_path / "llamacpp_speed.json"
    path.write_text(json.dumps(published))
    runs = [_row("ours", "fp32", "decode", 0, v, new) for v in (60.0, 61.0, 59.0)]
    runs += [_row("llama.cpp", "fp32", "decode", 0, 57.0, new)]
    best = latest(load_published(str(path), runs) + runs)
    assert best[("ours", "fp32", "decode", 4096)]["tok_s"] == 50.5
    assert best[("ours", "fp32", "decode", 0)]["tok_s"] == 60.0 and best[("ours", "fp32", "decode", 0)]["reps"] == 3
    assert load_published(str(path), [_row("ours", "fp32", "decode", 0, 1.0, old)]) == []
    assert load_published(str(tmp_path / "missing.json"), runs) == []
