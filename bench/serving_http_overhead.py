"""The HTTP layer's cost (issue 19, "must show" 6): the same trace through
`glm5-lab bench-serve --offline` (the engine in-process) and through
`glm5-lab serve` + `glm5-lab bench-serve --base-url` (OpenAI API over
loopback, streaming), on the `small` preset, for the `random` and
`prefix_repetition` datasets with prefix caching off and on.

    python bench/serving_http_overhead.py [--num-prompts 32] [--out runs/serving-http]

Prints one table row per (dataset, caching): output tokens/s offline, over
HTTP, and HTTP / offline; writes the bench-serve results under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATASETS = {
    "random": ["--dataset", "random", "--random-input-len", "32-512", "--random-output-len", "16-64"],
    "prefix_repetition": ["--dataset", "prefix_repetition", "--prefix-repetition-prefix-len", "256",
                          "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-output-len", "32"],
}
ENGINE = ["--max-num-seqs", "16", "--max-num-batched-tokens", "2048", "--kv-cache-memory", "1GiB"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lab(*args) -> list[str]:
    return [sys.executable, "-m", "profiling", *args]


def wait_healthy(url: str, proc, timeout=300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("the server did not become healthy")


def throughput(out_dir: str) -> float:
    with open(os.path.join(out_dir, "result.json")) as f:
        return json.load(f)["output_throughput"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "serving-http"))
    args = p.parse_args(argv)
    common = ["--preset", "small", "--num-prompts", str(args.num_prompts), "--seed", "0"]
    rows = []
    for caching in (False, True):
        flag = ["--enable-prefix-caching"] if caching else []
        port = free_port()
        server = subprocess.Popen(lab("serve", "--preset", "small", "--port", str(port), *ENGINE, *flag), cwd=ROOT)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", server)
            for name, data in DATASETS.items():
                tag = f"{name}-{'on' if caching else 'off'}"
                http_dir, off_dir = os.path.join(args.out, tag, "http"), os.path.join(args.out, tag, "offline")
                subprocess.run(lab("bench-serve", "--base-url", f"http://127.0.0.1:{port}/v1", *common, *data,
                                   "--out", http_dir), cwd=ROOT, check=True)
                subprocess.run(lab("bench-serve", "--offline", *common, *data, *ENGINE, *flag, "--out", off_dir),
                               cwd=ROOT, check=True)
                rows.append((name, caching, throughput(off_dir), throughput(http_dir)))
        finally:
            server.terminate()
            server.wait(timeout=30)
    print("| dataset | prefix caching | offline output tok/s | HTTP output tok/s | HTTP / offline |")
    print("|---|---|---|---|---|")
    for name, caching, off, http in rows:
        print(f"| {name} | {'on' if caching else 'off'} | {off:.1f} | {http:.1f} | {http / off:.3f} |")


if __name__ == "__main__":
    main()
