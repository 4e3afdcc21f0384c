"""What continuous batching can gain over the static baselines on issue 18's
random dataset, from the schedules alone (no model, seconds): tokens computed
(real + padding) and steps, per policy. Where a step costs in proportion to
the rows it computes (compute-bound: this CPU), the throughput ratio is about
the ratio of tokens computed; where a step costs the same whatever its rows
(memory-bound decode, a GPU at these batch sizes), about the ratio of steps.

    python bench/batching_counts.py [--num-prompts 32] [--max-num-seqs 16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from serving.block_manager import BlockManager        # noqa: E402
from serving.datasets import random_requests         # noqa: E402
from serving.request import Request, RequestStatus   # noqa: E402
from serving.scheduler import Scheduler              # noqa: E402


def schedule_counts(requests, policy: str, max_num_seqs: int, budget: int = 2048, page_size: int = 64) -> dict:
    sched = Scheduler(BlockManager(4096, page_size, enable_prefix_caching=False), max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=budget, max_model_len=65536, policy=policy)
    for i, r in enumerate(requests):
        sched.add_request(Request(f"r{i}", list(r.prompt_token_ids), SimpleNamespace(max_tokens=r.output_len)))
    steps = decode_rows = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        decode_rows += sum(c.num_tokens + c.num_pad == 1 for c in out.scheduled)
        for c in out.scheduled:
            sched.update_from_step(c)
        for c in out.scheduled:
            if c.reaches_end:
                c.request.output_token_ids.append(0)
                if len(c.request.output_token_ids) >= c.request.params.max_tokens:
                    sched.finish_request(c.request, RequestStatus.FINISHED_LENGTH)
    return {"steps": steps, "real_tokens": sched.num_real_tokens, "pad_tokens": sched.num_pad_tokens,
            "decode_rows": decode_rows, "slot_utilisation": sched.slot_utilisation}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    args = p.parse_args(argv)
    reqs = random_requests(args.num_prompts, input_len=(32, 1024), output_len=(8, 256), vocab_size=32000, seed=0)
    out = {policy: schedule_counts(reqs, policy, args.max_num_seqs)
           for policy in ("continuous", "static", "static_unpadded")}
    cont = out["continuous"]
    for policy in ("static", "static_unpadded"):
        s = out[policy]
        out[f"compute_bound_ratio_vs_{policy}"] = (s["real_tokens"] + s["pad_tokens"]) / cont["real_tokens"]
        out[f"step_bound_ratio_vs_{policy}"] = s["steps"] / cont["steps"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
