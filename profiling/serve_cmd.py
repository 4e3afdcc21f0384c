"""`glm5-lab serve`: the OpenAI-compatible server (serving/api) on the lab's Engine.

    glm5-lab serve --preset tiny --port 8000
    glm5-lab serve --checkpoint DIR --api-key KEY --enable-prefix-caching --kv-cache-memory 2GiB

FastAPI on uvicorn; the engine steps in its own thread. Binds 127.0.0.1
unless --host says otherwise. docs/SERVING_API.md has the endpoints and curl /
openai-client examples. --api-key may also come from $GLM5_LAB_API_KEY (keeps
the key out of the process list).
"""
from __future__ import annotations

import os
import sys

from .args import UsageError, add_quantization_arg, check_quantization, nonnegative_int, positive_int, quantize_for

PRESETS = ("tiny", "small")


def add_parser(subparsers):
    from models.glm5.attention_modes import ATTENTION_MODES, DEFAULT_ATTENTION

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
                              description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=PRESETS, help="configuration preset, random weights (default tiny)")
    src.add_argument("--checkpoint", metavar="DIR",
                     help="an HF checkpoint directory (config.json + safetensors; tokenizer.json if it has one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=nonnegative_int, default=8000, help="port (0: any free one)")
    p.add_argument("--api-key", default=os.environ.get("GLM5_LAB_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default $GLM5_LAB_API_KEY)")
    p.add_argument("--served-model-name", help="the model id clients ask for (default glm5-<preset> or the folder)")
    p.add_argument("--reinject-system-every", type=nonnegative_int, default=5, metavar="N",
                   help="repeat the system prompt before every Nth user turn (0: never; default 5)")
    p.add_argument("--max-queue", type=nonnegative_int, default=256,
                   help="requests that may wait beyond --max-num-seqs before new ones get 503 (default 256)")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="larger bodies get 413 (default 1 MiB)")
    p.add_argument("--attn", choices=sorted(ATTENTION_MODES), default=DEFAULT_ATTENTION)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seed", type=int, default=0, help="the preset's random weights")
    add_quantization_arg(p)
    e = p.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=positive_int, default=32)
    e.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    e.add_argument("--kv-cache-memory", metavar="SIZE", default="1GiB", help="cache memory, e.g. 2GiB (default 1GiB)")
    e.add_argument("--page-size", type=positive_int, default=64)
    e.add_argument("--max-model-len", type=positive_int,
                   help="context per request (default: the model's, capped by what the KV pool holds)")
    e.add_argument("--enable-prefix-caching", action="store_true")
    e.add_argument("--speculative", action="store_true", help="MTP drafts for greedy requests (docs/SERVING.md)")
    p.set_defaults(parser=p)
    return p


def build_model(args):
    import torch

    from models.glm5 import GLM5ForCausalLM

    from . import profile_cmd

    device = profile_cmd._device(args)
    dtype = profile_cmd.DTYPES[args.dtype] if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg = profile_cmd._config(args)
    name = args.checkpoint or args.preset or "tiny"
    check_quantization(args, device)
    profile_cmd._check_fits(cfg, device, dtype, name)
    print(f"[glm5-lab serve] building {name} (attn={args.attn}) on {device}, {dtype}"
          + (f", quantised {args.quantization}" if args.quantization else ""), file=sys.stderr, flush=True)
    torch.manual_seed(args.seed)
    if args.checkpoint:
        model = GLM5ForCausalLM.from_pretrained(args.checkpoint, attn=args.attn)
    else:
        model = GLM5ForCausalLM(cfg, attn=args.attn)
    model = model.to(device=device, dtype=dtype).eval()
    quantize_for(args, model, device)
    return model


def build_app(args, model=None):
    """The ASGI app `args` describe (model: an already built one, for tests)."""
    from models.glm5.cache import KVPool
    from serving.api import ServerConfig, create_app, load_tokenizer
    from serving.engine import Engine
    from serving.memory import parse_bytes

    model = build_model(args) if model is None else model
    cfg = model.config
    dtype = next(model.parameters()).dtype
    try:
        pool_tokens = parse_bytes(args.kv_cache_memory) // (KVPool.bytes_per_token(cfg, dtype) * args.page_size) \
            * args.page_size
    except (ValueError, TypeError) as e:
        raise UsageError(f"--kv-cache-memory: {e}") from None
    max_model_len = min(args.max_model_len or cfg.max_position_embeddings, pool_tokens)
    if args.max_model_len and args.max_model_len > cfg.max_position_embeddings:
        raise UsageError(f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    if max_model_len < 2:
        raise UsageError(f"--kv-cache-memory {args.kv_cache_memory} holds {pool_tokens} tokens: too few to serve")
    try:
        engine = Engine(model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        kv_cache_memory=args.kv_cache_memory, page_size=args.page_size,
                        enable_prefix_caching=args.enable_prefix_caching, max_model_len=max_model_len,
                        speculative=args.speculative)
        tokenizer = load_tokenizer(args.checkpoint, cfg.vocab_size)
    except (ValueError, TypeError) as e:
        raise UsageError(f"engine arguments: {e}") from None
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.checkpoint)) if args.checkpoint
                                      else f"glm5-{args.preset or 'tiny'}")
    config = ServerConfig(model_name=name, api_key=args.api_key or None, max_queue=args.max_queue,
                          max_body_bytes=args.max_body_bytes, reinject_system_every=args.reinject_system_every)
    print(f"[glm5-lab serve] model {name!r}, context {max_model_len} tokens, tokenizer {tokenizer.name}, "
          f"prefix caching {'on' if args.enable_prefix_caching else 'off'}", file=sys.stderr, flush=True)
    return create_app(engine, tokenizer, config)


def run(args) -> int:
    import uvicorn

    app = build_app(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    return 0
