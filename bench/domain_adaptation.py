"""Domain adaptation after 500 training sequences of a held-out package (issue 22 item 5).

A tiny byte-level GLM-5 is trained on the standard library without one
package (default `email`; training/stages.py's stage_data with `exclude`),
then adapted on exactly N sequences (default 500) of that package's training
files, three ways from the same base weights, with the same optimizer and
learning-rate schedule:

    lora          LoRA (training/lora.py) on the attention projections only
    lora+router   the same adapters plus one on every MoE router (mlp.gate.weight)
    full          every parameter trains

Measured before and after (and every --eval-every steps): the next-byte
accuracy on the identifier bytes of the package's held-out files (the
"terminology": bytes inside NAME tokens that are not keywords, found with
the stdlib `tokenize`; accuracy = the argmax prediction equals the actual
byte, predicting it from the bytes before it), the same on identifiers that
never occur in the general training corpus, the domain's held-out loss, and
the general corpus's held-out loss (what adaptation costs elsewhere). A
bonus: how many held-out tokens change their routed expert set, and the
expert histogram's total-variation change per MoE layer.

The package's files in sorted order are split by file: the last files
holding >= --held-fraction of its bytes are held out (email: parser.py,
policy.py, quoprimime.py, utils.py). Held-out text is scored with windows of
--seq bytes at stride --seq/2, each byte once, with at least --seq/2 bytes of
context (except at the very start).

    PYTHONPATH=$PWD python bench/domain_adaptation.py --out runs/domain-adapt \\
        --png bench/figures/domain_adaptation.png

The base model is trained once and cached at OUT/base.pt (reused when its
settings match); results go to OUT/results.json and a markdown table is printed.
"""
from __future__ import annotations

import argparse
import io
import json
import keyword
import math
import os
import re
import sys
import time
import tokenize

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.glm5 import GLM5ForCausalLM                     # noqa: E402
from models.glm5.config import preset                       # noqa: E402
from training.lora import LoraConfig, apply_lora            # noqa: E402
from training.meta_init import seeded_init                  # noqa: E402
from training.pipeline import lm_loss                       # noqa: E402
from training.stages import STAGE_SKIP_DIRS, split_held_out, stage_data   # noqa: E402
from training.train import stdlib_py_files   # noqa: E402
from training.train import batch as sample_batch            # noqa: E402

ATTENTION = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]   # examples/stages.toml's
VARIANTS = ("lora", "lora+router", "full")


def lora_config(variant: str, r: int = 8, alpha: float = 16) -> LoraConfig | None:
    if variant == "full":
        return None
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=list(ATTENTION),
                      target_parameters=["mlp.gate.weight"] if variant == "lora+router" else [])


# -- data ----------------------------------------------------------------------------

def identifier_mask(source: bytes) -> torch.Tensor:
    """bool [len(source)]: True on the bytes of every NAME token that is not a keyword.
    Source that does not tokenize gets its tokens up to the error."""
    mask = torch.zeros(len(source), dtype=torch.bool)
    text = source.decode("utf-8", errors="surrogateescape")
    lines = io.StringIO(text).readlines()   # split at "\n" only, as tokenize reads them (not str.splitlines)
    starts, pos = [], 0
    for line in lines:                      # byte offset of each line's start
        starts.append(pos)
        pos += len(line.encode("utf-8", errors="surrogateescape"))
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type != tokenize.NAME or keyword.iskeyword(tok.string):
                continue
            (row, col), (erow, ecol) = tok.start, tok.end
            a = starts[row - 1] + len(lines[row - 1][:col].encode("utf-8", errors="surrogateescape"))
            b = starts[erow - 1] + len(lines[erow - 1][:ecol].encode("utf-8", errors="surrogateescape"))
            mask[a:b] = True
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return mask


def package_split(package: str, held_fraction: float) -> tuple[list[str], list[str]]:
    """(training files, held-out files): the last files in sorted order holding >= held_fraction of the bytes."""
    paths = stdlib_py_files(package, skip_dirs=STAGE_SKIP_DIRS)
    total, acc, k = sum(os.path.getsize(p) for p in paths), 0, 0
    while acc < held_fraction * total and k < len(paths) - 1:
        k += 1
        acc += os.path.getsize(paths[-k])
    return paths[:-k] if k else paths, paths[-k:] if k else []


def read_files(paths: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The files concatenated with a newline after each (as stage_data does): (uint8 [N], identifier mask [N])."""
    data, masks = bytearray(), []
    for p in paths:
        with open(p, "rb") as f:
            src = f.read()
        data += src + b"\n"
        masks += [identifier_mask(src), torch.zeros(1, dtype=torch.bool)]
    return torch.frombuffer(data, dtype=torch.uint8).clone(), torch.cat(masks)


_WORD = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")


def novel_identifier_mask(data: torch.Tensor, ident: torch.Tensor, known: set[bytes]) -> torch.Tensor:
    """The identifier bytes of `data` whose whole name is not in `known`."""
    out = torch.zeros_like(ident)
    raw = data.numpy().tobytes()
    for m in _WORD.finditer(raw):
        a, b = m.span()
        if m.group() not in known and bool(ident[a:b].all()):
            out[a:b] = True
    return out


def draw_samples(data: torch.Tensor, n: int, seq: int, seed: int) -> torch.Tensor:
    """n windows of seq + 1 bytes at seeded random starts: int64 [n, seq + 1]."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq - 1, (n,), generator=gen)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()


def scoring_windows(n: int, seq: int, stride: int) -> list[tuple[int, int]]:
    """(start, first scored target index) for windows of seq over n bytes: every target position 1..n-1 once."""
    out, done = [], 0            # targets at text positions 1..done are scored
    s = 0
    while done < n - 1:
        s = min(s, max(n - seq - 1, 0))
        first = done - s          # target j sits at text position s + 1 + j
        out.append((s, max(first, 0)))
        done = min(s + seq, n - 1)
        s += stride
    return out


# -- model ---------------------------------------------------------------------------

def tiny_config():
    return preset("tiny").replace(num_nextn_predict_layers=0)


def new_model(config, attn: str, seed: int = 0) -> GLM5ForCausalLM:
    model = GLM5ForCausalLM(config, attn=attn)
    seeded_init(model, seed)
    return model


def schedule(steps: int, warmup: int):
    """Linear warm-up, then cosine from 1 to 0.1 (training/train.py's shape), as a LambdaLR factor."""
    return lambda s: min(1.0, (s + 1) / max(warmup, 1)) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1))))


def train_base(config, attn, general_train, *, steps, batch, seq, lr, warmup, seed, log=print):
    model = new_model(config, attn, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(steps, warmup))
    gen = torch.Generator().manual_seed(seed)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        x, y = sample_batch(general_train, batch, seq, gen)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"[base] step {step:4d}/{steps} loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)")
    return model, losses


def make_variant(base_state: dict, config, attn: str, variant: str, r: int = 8, alpha: float = 16):
    """A fresh model with the base weights, adapted for `variant`; (model, trainable parameter count)."""
    model = GLM5ForCausalLM(config, attn=attn)
    model.load_state_dict(base_state)
    cfg = lora_config(variant, r, alpha)
    if cfg is not None:
        apply_lora(model, cfg)     # freezes all but the adapters
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, n


def effective_weights(model) -> dict[str, torch.Tensor]:
    """Every weight as the forward sees it (a LoRA-parametrized weight with its delta), by its base name."""
    out = {}
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            out[f"{mname}.{pname}" if mname else pname] = getattr(module, pname).detach().clone()
        if hasattr(module, "parametrizations"):
            for pname in module.parametrizations.keys():
                out[f"{mname}.{pname}"] = getattr(module, pname).detach().clone()
    return {k: v for k, v in out.items() if ".parametrizations." not in k}


# -- evaluation ----------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, domain: torch.Tensor, masks: dict[str, torch.Tensor], general: torch.Tensor, *,
             seq: int, stride: int, batch: int = 32, routing: bool = False) -> dict:
    """Domain held-out: loss and next-byte accuracy over every byte and over each mask's bytes;
    general held-out: mean loss of `general` windows [n, seq + 1]. With routing, also the routed
    expert ids of every scored domain position per MoE layer."""
    model.eval()
    model.record = routing
    wins = scoring_windows(domain.numel(), seq, stride)
    nll, right, tgt_pos, ids = [], [], [], {}
    for i in range(0, len(wins), batch):
        chunk = wins[i:i + batch]
        rows = torch.stack([domain[s:s + seq + 1] for s, _ in chunk]).long()
        logits = model(rows[:, :-1]).float()
        keep = torch.zeros(rows.shape[0], seq, dtype=torch.bool)
        for r, (_, first) in enumerate(chunk):
            keep[r, first:] = True
        y = rows[:, 1:]
        nll.append(torch.nn.functional.cross_entropy(logits[keep], y[keep], reduction="none"))
        right.append(logits[keep].argmax(-1) == y[keep])
        tgt_pos.append((torch.tensor([s for s, _ in chunk])[:, None] + 1 + torch.arange(seq))[keep])
        if routing:
            for layer, lid in model.last_routing.items():
                ids.setdefault(layer, []).append(lid.reshape(rows.shape[0], seq, -1)[keep].sort(-1).values)
    nll, right, tgt_pos = torch.cat(nll), torch.cat(right), torch.cat(tgt_pos)
    assert torch.equal(tgt_pos.sort().values, torch.arange(1, domain.numel())), "every byte scored once"
    out = dict(domain_loss=nll.mean().item(), acc_all=right.float().mean().item())
    for name, m in masks.items():
        sel = m[tgt_pos]
        out[f"acc_{name}"] = right[sel].float().mean().item()
        out[f"n_{name}"] = int(sel.sum())
    gl = [lm_loss(model(general[i:i + batch, :-1]), general[i:i + batch, 1:]).item() * len(general[i:i + batch])
          for i in range(0, len(general), batch)]
    out["general_loss"] = sum(gl) / len(general)
    model.record = False
    model.last_routing = {}
    model.train()
    if routing:
        out["_routing"] = {layer: torch.cat(v) for layer, v in ids.items()}
    return out


def routing_change(before: dict, after: dict, n_experts: int) -> dict:
    """Per MoE layer: the fraction of positions whose routed expert set changed, and the total-variation
    distance between the expert-usage histograms."""
    out = {}
    for layer in sorted(before):
        a, b = before[layer], after[layer]
        ha = torch.bincount(a.flatten(), minlength=n_experts).float()
        hb = torch.bincount(b.flatten(), minlength=n_experts).float()
        out[str(layer)] = dict(changed=(a != b).any(-1).float().mean().item(),
                               tv=0.5 * (ha / ha.sum() - hb / hb.sum()).abs().sum().item(),
                               hist_before=ha.long().tolist(), hist_after=hb.long().tolist())
    return out


# -- adaptation ----------------------------------------------------------------------

def adapt(model, samples: torch.Tensor, *, batch: int, lr: float, warmup: int, eval_every: int = 0,
          eval_fn=None, log=print, name: str = "") -> tuple[list[float], list[dict]]:
    """One pass over `samples` [N, seq + 1] in order, `batch` rows a step (the last step may be smaller);
    AdamW over the trainable parameters, warm-up + cosine to 0.1 x lr. Returns (losses, evals at steps)."""
    steps = math.ceil(samples.shape[0] / batch)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(steps, warmup))
    losses, evals, t0 = [], [], time.perf_counter()
    for step in range(steps):
        rows = samples[step * batch:(step + 1) * batch]
        loss = lm_loss(model(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
        done = step + 1
        if eval_fn is not None and eval_every and (done % eval_every == 0 or done == steps):
            e = eval_fn(model, done == steps)
            evals.append(dict(step=done, samples=min(done * batch, samples.shape[0]), **e))
            log(f"[{name}] step {done}/{steps} train loss {loss.item():.4f}; identifier acc {e['acc_ident']:.4f}, "
                f"domain loss {e['domain_loss']:.4f}, general loss {e['general_loss']:.4f} "
                f"({time.perf_counter() - t0:.0f} s)")
        elif done % 10 == 0:
            log(f"[{name}] step {done}/{steps} train loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)")
    return losses, evals


# -- the run ---------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package", default="email", help="the held-out package")
    p.add_argument("--held-fraction", type=float, default=0.1, help="the package's bytes held out (whole files)")
    p.add_argument("--attn", default="dsa", choices=("dsa", "dense"))
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--base-steps", type=int, default=800)
    p.add_argument("--base-batch", type=int, default=16)
    p.add_argument("--base-lr", type=float, default=3e-3)
    p.add_argument("--samples", type=int, default=500, help="adaptation sequences (one pass)")
    p.add_argument("--batch", type=int, default=10, help="adaptation batch")
    p.add_argument("--lr", type=float, default=3e-3, help="adaptation peak lr, every variant")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--general-windows", type=int, default=128)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=3,
                   help="adaptation repeats, each with its own sample draw and adapter init (mean, min-max)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 by default: on a shared 2-core machine 2 threads ran a step ~40x slower")
    p.add_argument("--out", default="runs/domain-adapt")
    p.add_argument("--png", default=None)
    return p.parse_args(argv)


def run(a, log=print) -> dict:
    if a.threads:
        torch.set_num_threads(a.threads)
    config = tiny_config()
    os.makedirs(a.out, exist_ok=True)
    general_train, general_held = split_held_out(stage_data("stdlib", exclude=[a.package]))
    train_files, held_files = package_split(a.package, a.held_fraction)
    domain_train, _ = read_files(train_files)
    domain_held, ident = read_files(held_files)
    known = set(_WORD.findall(general_train.numpy().tobytes()))
    masks = dict(ident=ident, novel=novel_identifier_mask(domain_held, ident, known))
    general = draw_samples(general_held, a.general_windows, a.seq, a.seed + 1)
    log(f"[data] general {general_train.numel() / 2**20:.2f} MiB train (stdlib without {a.package}); "
        f"{a.package}: {domain_train.numel()} train bytes ({len(train_files)} files), {domain_held.numel()} held-out "
        f"bytes ({', '.join(os.path.basename(p) for p in held_files)}), {int(ident.sum())} identifier bytes, "
        f"{int(masks['novel'].sum())} in names absent from the general corpus")

    base_path = os.path.join(a.out, "base.pt")
    key = dict(package=a.package, attn=a.attn, seq=a.seq, steps=a.base_steps, batch=a.base_batch, lr=a.base_lr,
               seed=a.seed, corpus_bytes=int(general_train.numel()))
    cached = torch.load(base_path) if os.path.exists(base_path) else None
    if cached is not None and cached["key"] == key:
        base_state, base_info = cached["state"], cached["info"]
        log(f"[base] reusing {base_path} (trained in {base_info['seconds']:.0f} s, last-20 loss "
            f"{base_info['final_train_loss']:.4f})")
    else:
        t0 = time.perf_counter()
        model, losses = train_base(config, a.attn, general_train, steps=a.base_steps, batch=a.base_batch,
                                   seq=a.seq, lr=a.base_lr, warmup=20, seed=a.seed, log=log)
        base_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        base_info = dict(seconds=time.perf_counter() - t0, losses=losses,
                         final_train_loss=sum(losses[-20:]) / len(losses[-20:]))
        torch.save(dict(key=key, state=base_state, info=base_info), base_path)
        del model

    def eval_fn(model, routing=False):
        return evaluate(model, domain_held, masks, general, seq=a.seq, stride=a.seq // 2, routing=routing)

    t0 = time.perf_counter()
    base_model, _ = make_variant(base_state, config, a.attn, "full")
    before = eval_fn(base_model, routing=True)
    base_routing = before.pop("_routing")
    log(f"[base] identifier acc {before['acc_ident']:.4f} (novel names {before['acc_novel']:.4f}), "
        f"domain loss {before['domain_loss']:.4f}, general loss {before['general_loss']:.4f} "
        f"({time.perf_counter() - t0:.0f} s)")
    n_all = sum(p.numel() for p in base_model.parameters())
    del base_model

    results = dict(args=vars(a), base=dict(key=key, seconds=base_info["seconds"], parameters=n_all,
                                           final_train_loss=base_info["final_train_loss"]),
                   held_files=[os.path.basename(p) for p in held_files], before=before, variants={})
    for variant in [v for v in a.variants.split(",") if v]:      # --variants "": the base model alone
        entry = results["variants"][variant] = dict(runs=[])
        for rep in range(a.repeats):
            # repeat k: its own 500 samples and adapter initialisation, the same for every variant
            samples = draw_samples(domain_train, a.samples, a.seq, a.seed + 2 + 100 * rep)
            torch.manual_seed(a.seed + 10 + rep)
            model, n_train = make_variant(base_state, config, a.attn, variant, a.r, a.alpha)
            entry["trainable"] = n_train
            log(f"[{variant}] repeat {rep}: {n_train} trainable parameters (the base has {n_all}); "
                f"{a.samples} samples, batch {a.batch}, lr {a.lr}")
            t0 = time.perf_counter()
            losses, evals = adapt(model, samples, batch=a.batch, lr=a.lr, warmup=a.warmup,
                                  eval_every=a.eval_every, eval_fn=eval_fn, log=log, name=f"{variant} #{rep}")
            after = dict(evals[-1])
            after_routing = after.pop("_routing")
            for e in evals:
                e.pop("_routing", None)
            entry["runs"].append(dict(
                repeat=rep, seconds=time.perf_counter() - t0, train_losses=losses, curve=evals, after=after,
                routing=routing_change(base_routing, after_routing, config.n_routed_experts)))
            with open(os.path.join(a.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
            del model
    return results


def _mean_spread(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, (max(values) - min(values)) / 2


def table(results: dict) -> str:
    """Mean over the repeats, +- half the range (when there are several)."""
    b = results["before"]
    head = ("| | trainable params | identifier acc | ... names not in the general corpus | all-byte acc | "
            "domain held-out loss | general held-out loss | general change | routed set changed (MoE layers) |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| base (before) | - | {b['acc_ident']:.4f} | {b['acc_novel']:.4f} | {b['acc_all']:.4f} | "
            f"{b['domain_loss']:.4f} | {b['general_loss']:.4f} | - | - |"]

    def cell(v, key, fmt=".4f", shift=0.0):
        m, h = _mean_spread([r["after"][key] - shift for r in v["runs"]])
        return f"{m:{'+' if shift else ''}{fmt}}" + (f" +- {h:{fmt}}" if len(v["runs"]) > 1 else "")

    for name, v in results["variants"].items():
        layers = v["runs"][0]["routing"].keys()
        rc = ", ".join(f"{100 * _mean_spread([r['routing'][k]['changed'] for r in v['runs']])[0]:.1f}%"
                       for k in layers)
        rows.append(f"| {name} | {v['trainable']:,} | {cell(v, 'acc_ident')} | {cell(v, 'acc_novel')} | "
                    f"{cell(v, 'acc_all')} | {cell(v, 'domain_loss')} | {cell(v, 'general_loss')} | "
                    f"{cell(v, 'general_loss', shift=b['general_loss'])} | {rc} |")
    return head + "\n".join(rows)


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    b = results["before"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, v in results["variants"].items():
        xs = [0] + [e["samples"] for e in v["runs"][0]["curve"]]
        for ax, key in zip(axes, ("acc_ident", "domain_loss", "general_loss")):
            ys = [[b[key]] + [e[key] for e in r["curve"]] for r in v["runs"]]
            mean = [sum(c) / len(c) for c in zip(*ys)]
            line, = ax.plot(xs, mean, marker="o", ms=3, label=f"{name} ({v['trainable']:,})")
            if len(ys) > 1:
                ax.fill_between(xs, [min(c) for c in zip(*ys)], [max(c) for c in zip(*ys)],
                                color=line.get_color(), alpha=0.2, lw=0)
    pkg = results["args"]["package"]
    for ax, title in zip(axes, (f"{pkg} held-out: next-byte accuracy on identifier bytes",
                                f"{pkg} held-out loss (nats/byte)", "general (stdlib) held-out loss (nats/byte)")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("adaptation samples seen")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, title="variant (trainable params)", title_fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None):
    a = parse_args(argv)
    t0 = time.perf_counter()
    results = run(a, log=lambda m: print(m, flush=True))
    results["seconds"] = time.perf_counter() - t0
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    if a.png:
        plot(results, a.png)
        print(f"[png] {a.png}")
    print(f"[done] {results['seconds']:.0f} s; {os.path.join(a.out, 'results.json')}")
    return results


if __name__ == "__main__":
    main()
