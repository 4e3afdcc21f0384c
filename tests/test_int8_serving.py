"""An int8 model where users meet it (issue 20): the serving engine (Engine(...,
quantization=)) gives the tokens the same int8 model gives alone through
generate(); `glm5-lab profile / serve / bench-serve --quantization` quantise
the model they build and refuse what the int8 ops cannot do."""
import json
import random
from argparse import Namespace

import pytest
import torch

import glm5_ops
from models.glm5 import quantize
from models.glm5.generate import generate
from models.glm5.quantization import Int8Experts, Int8Linear
from profiling.args import UsageError, check_quantization
from profiling.cli import main
from serving import Engine, SamplingParams
from server_helpers import scaled_model


def _prompts(vocab, n, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _alone(model, prompt, max_tokens):
    out = generate(model, torch.tensor([prompt]), max_tokens)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("mode", ["int8_weight_only", "w8a8"])
def test_engine_serves_the_int8_model_with_its_own_tokens(mode):
    float_model = scaled_model()
    reference = quantize(scaled_model(), mode)     # the int8 model alone, through generate()
    engine = Engine(float_model, quantization=mode, max_num_seqs=8, max_num_batched_tokens=256, num_pages=64,
                    page_size=16, log=False)
    assert engine.model is float_model and isinstance(float_model.model.layers[0].self_attn.o_proj, Int8Linear)
    assert any(isinstance(m, Int8Experts) for m in float_model.modules())
    prompts = _prompts(float_model.config.vocab_size, 6)
    # weight-only: every request at once (rows per call vary; int8_linear's GEMV and its
    # dequantised GEMM agree to fp32 rounding). w8a8 quantises activations only in calls
    # of more than W8A8_MIN_ROWS rows, so the batch shape is part of its numerics: one
    # request at a time there, each prompt prefilled whole as generate() does.
    at_once = mode == "int8_weight_only"
    params = SamplingParams(max_tokens=8, temperature=0)
    if at_once:
        served = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    else:
        served = [engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    alone = [_alone(reference, p, 8) for p in prompts]
    assert served == alone
    assert engine.stats()["quantization"] == mode
    # the float model gives other tokens: the comparison can fail
    assert [_alone(scaled_model(), p, 8) for p in prompts] != alone


def test_engine_quantization_argument_errors():
    with pytest.raises(ValueError, match=r"quantization must be None or one of .*got 'int4'"):
        Engine(scaled_model(), quantization="int4", num_pages=8, log=False)
    q = quantize(scaled_model(), "int8_weight_only")
    assert Engine(q, quantization="int8_weight_only", num_pages=8, log=False).quantization == "int8_weight_only"
    assert Engine(q, num_pages=8, log=False).quantization == "int8_weight_only"   # a quantised model says so
    with pytest.raises(ValueError, match="already quantised as 'int8_weight_only'"):
        Engine(q, quantization="w8a8", num_pages=8, log=False)
    assert "quantization" not in Engine(scaled_model(), num_pages=8, log=False).stats()


def test_quantization_needs_a_device_with_int8_kernels():
    check_quantization(Namespace(quantization=None), torch.device("cuda"))
    check_quantization(Namespace(quantization="w8a8"), torch.device("cpu"))
    with pytest.raises(UsageError, match="--quantization w8a8: the int8 kernels run on the CPU and CUDA"):
        check_quantization(Namespace(quantization="w8a8"), torch.device("mps"))
    if not glm5_ops._backend._C.WITH_CUDA:
        with pytest.raises(UsageError, match="built without its CUDA kernels"):
            check_quantization(Namespace(quantization="w8a8"), torch.device("cuda"))
    else:
        check_quantization(Namespace(quantization="w8a8"), torch.device("cuda"))


@pytest.mark.parametrize("argv, message", [
    (["profile", "--quantization", "int4"], "argument --quantization: invalid choice"),
    (["profile", "--preset", "tiny", "--seq", "8", "--mode", "train", "--quantization", "w8a8"],
     "the int8 ops are inference only"),
    (["bench-serve", "--base-url", "http://127.0.0.1:1", "--quantization", "w8a8"],
     "--quantization applies to --offline"),
    (["serve", "--quantization", "fp8"], "argument --quantization: invalid choice"),
])
def test_cli_quantization_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: glm5-lab") and message in err and "Traceback" not in err


def test_profile_decode_int8(tmp_path):
    out = tmp_path / "p"
    assert main(["profile", "--preset", "tiny", "--seq", "16", "--mode", "decode", "--steps", "1", "--warmup", "0",
                 "--quantization", "int8_weight_only", "--out", str(out)]) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["quantization"]["mode"] == "int8_weight_only" and "lm_head" in data["quantization"]["skip"]
    # FLOPs of the int8 ops are counted (glm5::int8_linear, fused_moe_int8): the experts' and projections' rows
    assert data["flops"]["experts"] > 0 and data["flops"]["attention projections"] > 0
    assert "quantisation: int8_weight_only" in (out / "report.md").read_text()


def test_bench_serve_offline_int8(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["bench-serve", "--offline", "--preset", "tiny", "--quantization", "w8a8", "--num-prompts", "3",
                 "--random-input-len", "20-40", "--random-output-len", "2-4", "--num-warmups", "0",
                 "--num-pages", "32", "--page-size", "16", "--out", str(out)]) == 0
    data = json.loads((out / "result.json").read_text())
    assert data["completed"] == 3 and data["config"]["quantization"] == "w8a8"
    assert data["engine_stats"]["quantization"] == "w8a8"


def test_serve_int8_answers():
    httpx = pytest.importorskip("httpx")
    from profiling.cli import build_parser
    from profiling.serve_cmd import build_app, build_model
    from server_helpers import running_server

    args = build_parser().parse_args(["serve", "--preset", "tiny", "--kv-cache-memory", "16MiB", "--page-size", "16",
                                      "--max-model-len", "128", "--quantization", "int8_weight_only"])
    model = build_model(args)
    assert model.quantization["mode"] == "int8_weight_only"
    with running_server(build_app(args, model=model)) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": "glm5-tiny", "prompt": "int8", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
