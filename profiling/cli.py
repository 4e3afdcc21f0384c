"""glm5-lab: the lab's command line.

    glm5-lab profile --preset tiny --seq 64 --mode prefill --attn dsa --out runs/tiny
    glm5-lab bench [--filter EXPR] [--compare RUN.json] [--gpu-suite]
    glm5-lab inspect --preset glm-5 [--context N]
    glm5-lab serve --preset tiny --port 8000
    torchrun --nproc_per_node=4 -m profiling train --preset tiny --dp-shard 2 --tp 2 --out runs/train

Argument errors print the usage line and exit 2 (argparse's convention).
"""
from __future__ import annotations

import argparse
import shlex

from . import bench_cmd, bench_serve_cmd, profile_cmd, serve_cmd, train_cmd
from .args import UsageError
from . import inspect as inspect_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glm5-lab", description="GLM-5 Kernel Lab: where the time goes in GLM-5 and what each kernel buys.")
    sub = parser.add_subparsers(dest="command_name", metavar="{profile,bench,bench-serve,serve,inspect,train}",
                                required=True)
    profile_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    bench_serve_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    inspect_cmd.add_parser(sub)
    train_cmd.add_parser(sub)
    return parser


def main(argv=None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = "glm5-lab " + shlex.join(argv)
    run = {"profile": profile_cmd.run, "bench": bench_cmd.run, "bench-serve": bench_serve_cmd.run, "serve": serve_cmd.run,
           "inspect": inspect_cmd.run, "train": train_cmd.run}[args.command_name]
    try:
        return run(args)
    except UsageError as e:
        # found after parsing (needs the model's config): same contract as argparse
        getattr(args, "parser", parser).error(str(e))
