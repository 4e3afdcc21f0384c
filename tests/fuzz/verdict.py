"""What an outcome means: the counts, the error-message convention (issue 24
item 4), the one-line reproducer, and findings grouped by op."""
from __future__ import annotations

import json
import re
import shlex
from collections import Counter, defaultdict

from . import known

CLEAN_TYPES = ("ValueError", "TypeError", "NotImplementedError")
# torch's dispatcher checks a raw schema's argument types itself ("Expected a
# value of type 'int' for argument 'k' but instead found type 'str'"): clean,
# and not ours to reword.
DISPATCHER = re.compile(r"Expected a value of type .* for argument '\w+' but instead found type")
# Arguments a message may name by another spelling: the public moe_combine
# takes the plan, whose token_slot the fuzzer perturbs; a block mask's parts;
# model.decode's prompt goes through the model's input_ids check.
ALIASES = {"token_slot": ("token_slot", "plan"), "prompt": ("prompt", "input_ids"), "kv_num_blocks": ("kv_num_blocks", "block mask"),
           "kv_indices": ("kv_indices", "block mask")}


def repro(case: dict) -> str:
    """The one-line command that replays `case` in this process."""
    return "python -m tests.fuzz.repro " + shlex.quote(json.dumps(case, separators=(",", ":")))


def is_dispatcher_error(outcome: dict) -> bool:
    return bool(DISPATCHER.search(outcome.get("message", "")))


def message_problem(case: dict, outcome: dict) -> str | None:
    """Why an error breaks the convention, or None: ValueError / TypeError
    (NotImplementedError for a backend that cannot run a valid input); the
    message names the perturbed argument, says what was expected ("must" /
    "expected") and what was given ("got")."""
    if outcome["status"] != "error" or is_dispatcher_error(outcome):
        return None
    kind, msg = outcome["type"], outcome.get("message", "")
    if kind not in CLEAN_TYPES:
        return f"raises {kind}, not ValueError/TypeError"
    name = case.get("perturbed")
    if name is None or kind == "NotImplementedError":
        return None
    names = ALIASES.get(name, (name,)) + tuple(case.get("or_names", ()))
    if not any(re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", msg) for n in names):
        return f"does not name {name!r}"
    low = msg.lower()
    if "must" not in low and "expected" not in low:
        return "does not say what was expected (must/expected)"
    if "got" not in low:
        return "does not say what was given (got ...)"
    return None


def classify(case: dict, outcome: dict) -> str:
    """ok | clean | unclear | invalid | crash | hang | skipped."""
    status = outcome["status"]
    if status == "error":
        return "clean" if outcome["type"] in CLEAN_TYPES or is_dispatcher_error(outcome) else "unclear"
    return status


class Report:
    """Counts and findings of one run; `new_*` leave out what known.py lists."""

    def __init__(self, cases: list, outcomes: list, seconds: float, seed):
        self.cases, self.outcomes, self.seconds, self.seed = cases, outcomes, seconds, seed
        self.kinds = [classify(c, o) for c, o in zip(cases, outcomes)]
        self.counts = Counter(self.kinds)

    def failures(self, kind: str, *, include_known: bool = False) -> list:
        """(case, outcome) pairs of a kind (crash, hang, invalid, message), known ones left out."""
        out = []
        for case, outcome, k in zip(self.cases, self.outcomes, self.kinds):
            if kind == "message":
                problem = message_problem(case, outcome)
                if problem is None:
                    continue
                outcome = dict(outcome, problem=problem)
            elif k != kind:
                continue
            if include_known or known.match(kind, case, outcome) is None:
                out.append((case, outcome))
        return out

    def summary(self) -> str:
        c = self.counts
        parts = [f"ran {len(self.cases) - c['skipped']}", f"ok {c['ok']}", f"clean errors {c['clean']}",
                 f"unclear errors {c['unclear']}", f"invalid {c['invalid']}"]
        for kind in ("crash", "hang"):
            new = len(self.failures(kind))
            parts.append(f"{kind}{'es' if kind == 'crash' else 's'} {new}" + (f" (+{c[kind] - new} known)" if c[kind] - new else ""))
        if c["skipped"]:
            parts.append(f"skipped {c['skipped']} (known hangs)")
        return f"fuzz seed {self.seed}: {len(self.cases)} cases in {self.seconds:.0f} s: " + ", ".join(parts)

    def findings_markdown(self) -> str:
        """Every distinct finding (crash, hang, invalid result, unclear or
        unconventional error), grouped by op, with one reproducer each."""
        groups = defaultdict(dict)
        for case, outcome in zip(self.cases, self.outcomes):
            kind = classify(case, outcome)
            problem = message_problem(case, outcome)
            if kind not in ("crash", "hang", "invalid") and problem is None:
                continue
            what = kind if kind in ("crash", "hang", "invalid") else f"message: {problem}"
            if problem is not None and kind not in ("crash", "hang", "invalid"):
                outcome = dict(outcome, problem=problem)
            text = re.sub(r"-?\d+", "N", f"{outcome.get('type', '')}: {outcome.get('message', '')}")[:160]
            key = (what, text, case.get("perturbed"), case.get("mutation"))
            groups[case["target"]].setdefault(key, (case, outcome, []))[2].append(1)
        lines = []
        for target in sorted(groups):
            lines.append(f"### {target}")
            for (what, _, arg, mutation), (case, outcome, hits) in groups[target].items():
                tag = "known" if known.match(what.split(":")[0], case, outcome) else "NEW"
                msg = outcome.get("message", "").splitlines()[0][:200] if outcome.get("message") else ""
                lines.append(f"- [{tag}] {what} ({len(hits)} cases; perturbed {arg}/{mutation}): "
                             f"{outcome.get('type', '')} {msg} @ {outcome.get('where', '')}")
                lines.append(f"  `{repro(case)}`")
        return "\n".join(lines)
