"""Range names -> the architecture's components, and a torch.profiler trace ->
time per component.

The model names every range like the architecture (docs/ARCHITECTURE.md, "NVTX ranges"):
`layer3/attn/indexer`, `layer3/moe/experts`, `lm_head`, ... A range belongs to
a component by its last path parts (its suffix), so any layer prefix (and
`mtp/...`) maps the same way. Ranges that match no component (a `layer3`
wrapper, say) are transparent: their time goes to the component around them.

A component's time is its *self* time: the time inside its ranges minus the
time inside component ranges nested in them. Every microsecond of a step lands
in exactly one component or in "other" (the step's time outside every
component range), so the shares sum to 100%.

Training: backward ops run outside any range; autograd's
`evaluate_function: XBackward0` events carry the sequence number of the
forward op that made them, so their time goes to that forward op's component.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

# (row label, range-name suffixes), in report order. The first nine are the
# issue's rows; the next five keep the rest of the network out of "other".
COMPONENTS = [
    ("indexer", ("attn/indexer",)),
    ("top-k", ("attn/topk",)),
    ("core attention", ("attn/core",)),
    ("router", ("moe/route",)),
    ("dispatch", ("moe/dispatch",)),
    ("experts", ("moe/experts",)),
    ("combine", ("moe/combine",)),
    ("norms", ("attn_norm", "mlp_norm", "norm")),
    ("LM head", ("lm_head",)),
    ("attention projections", ("attn/proj", "attn/out")),
    ("dense MLP", ("mlp",)),
    ("shared expert", ("moe/shared",)),
    ("embedding", ("embed",)),
    ("MTP", ("mtp",)),
]
OTHER = "other"
NAMES = [name for name, _ in COMPONENTS] + [OTHER]
STEP_RANGE = "glm5-lab/step"
_BACKWARD_PREFIX = "autograd::engine::evaluate_function:"


def component_of(range_name: str) -> str | None:
    """The component a range name belongs to, or None (a transparent range)."""
    parts = range_name.split("/")
    for name, suffixes in COMPONENTS:
        for suffix in suffixes:
            n = suffix.count("/") + 1
            if "/".join(parts[-n:]) == suffix:
                return name
    return None


def innermost_component(range_names) -> str | None:
    """The component of the innermost component range in a stack (outermost first)."""
    for name in reversed(range_names):
        comp = component_of(name)
        if comp is not None:
            return comp
    return None


@dataclass
class Breakdown:
    """Per-step averages in microseconds. forward/backward split the time by
    where it ran (backward = autograd's evaluate_function events)."""
    steps: int
    step_us: float                                   # mean step time (wall on CPU, kernel time on GPU)
    forward_us: dict = field(default_factory=dict)   # component -> us per step
    backward_us: dict = field(default_factory=dict)
    range_counts: dict = field(default_factory=dict)  # component -> ranges seen per step
    clock: str = "cpu wall"
    ops_us: float | None = None                      # CPU: time inside operator calls (aten::, glm5::)

    @property
    def outside_ops_us(self) -> float | None:
        """Step time between operator calls: Python, module calls, the framework (CPU only)."""
        return None if self.ops_us is None else self.step_us - self.ops_us

    def total_us(self, comp: str) -> float:
        return self.forward_us.get(comp, 0.0) + self.backward_us.get(comp, 0.0)

    def share(self, comp: str) -> float:
        return self.total_us(comp) / self.step_us if self.step_us > 0 else 0.0


def _duration(e) -> float:
    return e.time_range.end - e.time_range.start


def breakdown(events, *, device_time: bool = False) -> Breakdown:
    """Time per component from torch.profiler events (prof.events()).

    Steps are the ranges named STEP_RANGE* that profile_cmd wraps around each
    measured step. device_time=False: CPU wall time, each event's exclusive
    time (its duration minus its children's) to the innermost component.
    device_time=True: each op's own CUDA kernel time (self_device_time_total)
    to the innermost component; the step's total is the kernel time summed,
    so "other" holds the kernels launched outside every component range."""
    steps = sorted((e for e in events if e.name.startswith(STEP_RANGE)), key=lambda e: e.time_range.start)
    if not steps:
        raise ValueError(f"no '{STEP_RANGE}' range in the trace: nothing was measured")
    roots = {id(s): [s] for s in steps}
    if device_time:
        # Backward on CUDA runs on autograd's device thread, outside the step's
        # subtree: take the top-level events of other threads inside each step.
        main = steps[0].thread
        for e in events:
            if e.cpu_parent is None and e.thread != main:
                for s in steps:
                    if s.time_range.start <= e.time_range.start < s.time_range.end:
                        roots[id(s)].append(e)
                        break
    fwd, bwd, counts = defaultdict(float), defaultdict(float), defaultdict(int)
    ops = 0.0   # outermost operator events only: an op's nested ops are inside its time
    fwd_component = {}  # (forward thread, sequence nr) -> component of the forward op
    total = 0.0
    for s in steps:
        for root in sorted(roots[id(s)], key=lambda e: e.time_range.start):
            stack = [(root, OTHER, False, False)]
            while stack:
                e, comp, backward, in_op = stack.pop()
                if not in_op and _is_operator(e.name):
                    ops += _duration(e)
                    in_op = True
                own = component_of(e.name)
                if own is not None:
                    comp = own
                    counts[own] += 1
                elif e.name.startswith(_BACKWARD_PREFIX):
                    linked = fwd_component.get((e.fwd_thread, e.sequence_nr))
                    if linked is not None:
                        comp, backward = linked, True
                if not backward and e.sequence_nr >= 0 and comp != OTHER:
                    fwd_component.setdefault((e.thread, e.sequence_nr), comp)
                children = sorted(e.cpu_children, key=lambda c: c.time_range.start)
                if device_time:
                    t = e.self_device_time_total
                else:
                    t = _duration(e) - sum(_duration(c) for c in children)
                (bwd if backward else fwd)[comp] += t
                total += t
                # reversed so the earliest child is processed first (forward before backward)
                stack.extend((c, comp, backward, in_op) for c in reversed(children))
    n = len(steps)
    return Breakdown(steps=n, step_us=total / n, forward_us={k: v / n for k, v in fwd.items()},
                     backward_us={k: v / n for k, v in bwd.items()},
                     range_counts={k: v / n for k, v in counts.items()},
                     clock="cuda kernel time" if device_time else "cpu wall",
                     ops_us=None if device_time else ops / n)


def _is_operator(name: str) -> bool:
    """A dispatcher operator event (aten::mm, glm5::fused_moe_fwd), not a user range or autograd's wrapper."""
    return "::" in name and not name.startswith(_BACKWARD_PREFIX) and "/" not in name
