"""Issue 21, items 3 and 4: overlap and memory of GLM-5 training on gloo processes.

    python bench/train_distributed.py overlap --layers 4    # dp_shard=4, K=4: prefetch on/off alternated
    python bench/train_distributed.py memory                # one process vs dp_shard=4, memory policy none/recompute
    python bench/train_distributed.py memory --ep 4         # ... vs 4 processes whose routed experts are split by EP

overlap: one Trainer per process; steps alternate between all-gathers
prefetched asynchronously (training/parallelize.py set_prefetch on) and
gathered when reached (off), so both modes share the processes, the memory
and the machine's state. Then one profiled step of each (torch.profiler):
communication = the gloo worker threads' "gloo:*" intervals, compute = the
main thread's aten ops outside a blocking c10d call; hidden = the share of
the communication's time during which the main thread computed.

memory: each configuration in fresh processes (peak RSS only grows). Per
process: RSS after importing torch and the lab and joining the process
group (the fixed cost), the model state (parameters + gradients + AdamW
state, Trainer.state_bytes), the bytes autograd saved for backward at their
peak (activations), and peak RSS over two optimizer steps.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Peak bytes of the tensors autograd holds for backward (each storage once; parameters excluded)."""

    def __init__(self):
        self.live, self.peak = {}, 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t):
        if not isinstance(t, torch.nn.Parameter) and t.device.type != "meta":
            key = t.untyped_storage().data_ptr()
            if key not in self.live:
                self.live[key] = t.untyped_storage().nbytes()
                self.peak = max(self.peak, sum(self.live.values()))
        return t

    @staticmethod
    def _unpack(t):
        return t

    def reset(self):
        self.live = {}


def _config(layers: int | None):
    from models.glm5.config import preset
    c = preset("small")
    return c if layers is None else c.replace(num_hidden_layers=layers)


def _worker(rank: int, world: int, port: int, job: str, kw: dict, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(kw.get("threads", 1))
    import torch.distributed as dist

    import training.distributed_train  # noqa: F401  (the lab, imported before the fixed cost is read)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    fixed = _rss_mib()
    try:
        result = (_overlap if job == "overlap" else _memory)(rank, world, kw)
        result["fixed_rss_mib"] = fixed
        out.put((rank, result))
    except BaseException as e:   # the parent must not wait for an answer that will not come
        out.put((rank, RuntimeError(f"rank {rank}: {type(e).__name__}: {e}")))
        raise
    finally:
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()


def _batch(kw, seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 32000, (kw["batch"], kw["seq"] + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def _dims(world: int, ep: int):
    """The mesh of `world` processes: ep of them split the routed experts, the rest dp_shard (one process: none)."""
    from training.parallelize import ParallelDims
    return ParallelDims(dp_shard=world // ep, ep=ep) if world > 1 else ParallelDims()


def _trainer(world, kw):
    from training.distributed_train import Trainer
    dims = _dims(world, kw.get("ep", 1))
    mesh = dims.build_mesh("cpu") if world > 1 else None
    return Trainer(_config(kw["layers"]), dims, mesh, micro_batches=kw["K"], lr=1e-4,
                   memory_policy=kw.get("policy", "none"))


def _overlap(rank, world, kw):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from training.parallelize import set_prefetch
    trainer = _trainer(world, kw)
    _log(rank, "built")
    times = {True: [], False: []}
    step = 0
    for on in (True, False):             # warm-up, one step each
        set_prefetch(trainer.model, on)
        trainer.step(*_batch(kw, step))
        step += 1
    for _ in range(kw["rounds"]):
        for on in (True, False):
            set_prefetch(trainer.model, on)
            dist.barrier()
            t0 = time.perf_counter()
            trainer.step(*_batch(kw, step))
            times[on].append(time.perf_counter() - t0)
            _log(rank, f"prefetch {'on' if on else 'off'}: {times[on][-1]:.2f} s")
            step += 1
    traces = {}
    for on in (True, False):
        set_prefetch(trainer.model, on)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.step(*_batch(kw, step))
        step += 1
        path = os.path.join(kw["trace_dir"], f"rank{rank}-{'on' if on else 'off'}.json")
        prof.export_chrome_trace(path)
        traces["on" if on else "off"] = hidden_fraction(path)
    return dict(step_s_on=times[True], step_s_off=times[False], trace=traces, peak_rss_mib=_peak_rss_mib())


def _log(rank, msg):
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap_len(xs, ys):
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def hidden_fraction(trace_path: str) -> dict:
    """From a torch.profiler chrome trace of one process: gloo's communication
    time, the main thread's compute time, and how much of the former the latter covers."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    main = max({e["tid"] for e in events}, key=lambda t: sum(1 for e in events if e["tid"] == t))
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] != main and e["name"].startswith("gloo:")])
    blocking = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == main
                       and e["name"].startswith("c10d::")])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == main
                      and e["name"].startswith("aten::")
                      and not any(a <= e["ts"] < b for a, b in blocking)])
    comm_us = sum(b - a for a, b in comm)
    hidden = _overlap_len(comm, compute)
    return dict(comm_ms=comm_us / 1e3, compute_ms=sum(b - a for a, b in compute) / 1e3,
                hidden_ms=hidden / 1e3, hidden_fraction=hidden / comm_us if comm_us else 0.0,
                blocking_c10d_ms=sum(b - a for a, b in blocking) / 1e3)


def _memory(rank, world, kw):
    trainer = _trainer(world, kw)
    saved = SavedBytes()
    peak_saved = 0
    trace = None
    if kw.get("trace"):
        from bench.memory_phases import PhaseTrace
        trace = PhaseTrace(trainer.model)
        trace.mark("built")
    for step in range(2):
        saved.reset()
        with saved:
            if trace is None:
                trainer.step(*_batch(kw, step))
            else:
                trace.mark(f"step {step} start")
                trainer.backward(*_batch(kw, step))
                trace.mark("backward returned")
                trainer.optimizer.step()
                trace.mark("optimizer.step")
                trainer.optimizer.zero_grad(set_to_none=True)
                trace.mark("zero_grad")
        peak_saved = max(peak_saved, saved.peak)
    out = dict(state_mib=trainer.state_bytes() / 2**20, saved_mib=peak_saved / 2**20, peak_rss_mib=_peak_rss_mib())
    if trace is not None:   # its marks reset the kernel's peak (ru_maxrss too): the peak is the marks' largest
        out["trace"] = trace.rows
        out["peak_rss_mib"] = max(r["peak_since_last"] for r in trace.rows)
    return out


def launch(world: int, job: str, **kw) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, job, kw, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=3600) for _ in procs)
    failed = [r for r in results.values() if isinstance(r, Exception)]
    if failed:
        for p in procs:
            p.terminate()
        raise failed[0]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a worker exited with {p.exitcode}")
    return [results[r] for r in range(world)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("overlap", "memory"))
    ap.add_argument("--layers", type=int, default=None, help="the small preset with this many layers (default: 8)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--K", type=int, default=None, help="micro-batches (overlap: 4, memory: 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default="none,recompute")
    ap.add_argument("--trace-dir", default="runs/overlap-traces")
    ap.add_argument("--worlds", default="1,4", help="memory: the process counts to measure")
    ap.add_argument("--ep", type=int, default=1,
                    help="memory: expert parallelism over this many of the processes (the rest dp_shard); "
                         "one process ignores it")
    ap.add_argument("--trace", action="store_true",
                    help="memory: print RSS and glibc's heap per phase of the step (bench/memory_phases.py)")
    args = ap.parse_args(argv)
    if args.ep < 1 or any(w > 1 and w % args.ep for w in map(int, args.worlds.split(","))):
        ap.error(f"--ep {args.ep} must divide every process count in --worlds {args.worlds}")
    if args.what == "overlap":
        os.makedirs(args.trace_dir, exist_ok=True)
        res = launch(4, "overlap", layers=args.layers, batch=args.batch, seq=args.seq, K=args.K or 4,
                     rounds=args.rounds, trace_dir=args.trace_dir)
        on = statistics.median(t for r in res[:1] for t in r["step_s_on"])
        off = statistics.median(t for r in res[:1] for t in r["step_s_off"])
        print(json.dumps(res, indent=1))
        print(f"step time (rank 0, median of {args.rounds}): prefetch on {on:.3f} s, off {off:.3f} s, "
              f"on/off {on / off:.3f} (speed-up {off / on - 1:+.1%})")
        for mode in ("on", "off"):
            tr = [r["trace"][mode] for r in res]
            print(f"  {mode}: gloo comm {statistics.mean(t['comm_ms'] for t in tr):.0f} ms/step, hidden behind "
                  f"compute {statistics.mean(t['hidden_fraction'] for t in tr):.1%} (mean of 4 processes; per "
                  f"process {[round(t['hidden_fraction'], 3) for t in tr]}), main thread blocked in c10d "
                  f"{statistics.mean(t['blocking_c10d_ms'] for t in tr):.0f} ms")
        return 0
    rows = []
    for policy in args.policies.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            res = launch(world, "memory", layers=args.layers, batch=args.batch, seq=args.seq, K=args.K or 1,
                         policy=policy, threads=1, trace=args.trace, ep=args.ep)
            r = max(res, key=lambda r: r["peak_rss_mib"])
            trace = r.pop("trace", None)
            dims = _dims(world, args.ep)
            mesh = f"dp_shard={dims.dp_shard}" + (f" x ep={dims.ep}" if dims.ep > 1 else "")
            mesh = "one process" if world == 1 else mesh
            rows.append(dict(policy=policy, world=world, mesh=mesh, **r,
                             peak_by_rank=[round(x["peak_rss_mib"]) for x in res]))
            print(json.dumps(rows[-1]), flush=True)
            if trace is not None:
                from bench.memory_phases import format_rows
                print(f"phases of the largest process, policy {policy}, {world} process(es):\n{format_rows(trace)}",
                      flush=True)
    print("| policy | processes (mesh) | peak RSS MiB | fixed MiB | RSS - fixed | state MiB | saved activations MiB |")
    for r in rows:
        print(f"| {r['policy']} | {r['world']} ({r['mesh']}) | {r['peak_rss_mib']:.0f} | {r['fixed_rss_mib']:.0f} | "
              f"{r['peak_rss_mib'] - r['fixed_rss_mib']:.0f} | {r['state_mib']:.0f} | {r['saved_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
