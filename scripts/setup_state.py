"""What scripts/setup.sh asks before it installs or compiles anything, answered
without importing torch, so a rerun with nothing changed takes seconds:

  python scripts/setup_state.py missing EXTRA...  requirements from pyproject.toml (build,
                                                  runtime, the extras named) not installed, one a line
  python scripts/setup_state.py fresh             exit 0 when glm5_ops._C and this interpreter's
                                                  editable install match the stamp, else 1 (says why)
  python scripts/setup_state.py stamp             record the build just made

The stamp (glm5_ops/_C.stamp.json, beside the extension) holds a hash of every
input of the build (csrc/**, setup.py, pyproject.toml, the torch version, the
Python environment and its version, the GLM5_* / CUDA build variables) and a hash of the extension
itself, so a rebuild by hand (setup.py build_ext) or any changed input rebuilds.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: scripts/setup.sh installs tomli first
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "glm5-kernel-lab"
EXTENSION = ROOT / "glm5_ops" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
STAMP = ROOT / "glm5_ops" / "_C.stamp.json"
# everything setup.py reads from the environment, plus CUDA_HOME (which nvcc)
BUILD_ENV = ("GLM5_BUILD_CUDA", "GLM5_CPU_ARCH", "GLM5_SANITIZE", "GLM5_PLANT_OOB",
             "TORCH_CUDA_ARCH_LIST", "CUDA_HOME")


def load_pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def requirements(extras: list[str]) -> list[str]:
    """Build requirements, runtime dependencies and the extras named, with the
    project's references to its own extras (test -> hf) expanded."""
    meta = load_pyproject()
    optional = meta["project"].get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise SystemExit(f"unknown extra(s) {unknown}; pyproject.toml declares {sorted(optional)}")
    reqs = list(meta["build-system"]["requires"]) + list(meta["project"]["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in optional[extra]:
            if req.startswith(PROJECT + "["):
                todo += [e.strip() for e in req[len(PROJECT) + 1:-1].split(",")]
            else:
                reqs.append(req)
    return list(dict.fromkeys(reqs))


def missing(reqs: list[str]) -> list[str]:
    try:
        from packaging.requirements import Requirement
    except ModuleNotFoundError:  # a bare interpreter: let pip sort out all of it
        return reqs
    out = []
    for line in reqs:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(line)
            continue
        if not req.specifier.contains(installed, prereleases=True):
            out.append(line)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_inputs() -> str:
    h = hashlib.sha256()
    files = sorted(p for p in (ROOT / "csrc").rglob("*") if p.is_file())
    for path in files + [ROOT / "setup.py", ROOT / "pyproject.toml"]:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + _sha256(path).encode())
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    h.update(f"torch={torch_version}\0env={sys.prefix}\0python={sys.version}".encode())
    for name in BUILD_ENV:
        h.update(f"\0{name}={os.environ.get(name, '')}".encode())
    return h.hexdigest()


def editable_install_here() -> bool:
    """This interpreter has the project installed in editable mode from ROOT."""
    try:
        dist = metadata.distribution(PROJECT)
    except metadata.PackageNotFoundError:
        return False
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    return url.get("url") == ROOT.as_uri() and url.get("dir_info", {}).get("editable", False)


def why_stale() -> str | None:
    if not EXTENSION.exists():
        return f"{EXTENSION.name} is not built"
    if not STAMP.exists():
        return f"no stamp {STAMP.name}"
    if not editable_install_here():
        return f"{PROJECT} is not installed in editable mode from {ROOT} for {sys.executable}"
    stamp = json.loads(STAMP.read_text())
    if stamp.get("inputs") != build_inputs():
        return "sources, torch, Python environment or build variables changed"
    if stamp.get("extension") != _sha256(EXTENSION):
        return f"{EXTENSION.name} was rebuilt outside scripts/setup.sh"
    return None


def main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    if command == "missing":
        for req in missing(requirements(args)):
            print(req)
        return 0
    if command == "fresh":
        reason = why_stale()
        print("[setup] glm5_ops._C is up to date: nothing to build" if reason is None
              else f"[setup] building: {reason}")
        return 0 if reason is None else 1
    if command == "stamp" and not args:
        if not EXTENSION.exists():
            raise SystemExit(f"no {EXTENSION} to stamp: the build did not produce it")
        STAMP.write_text(json.dumps({"inputs": build_inputs(), "extension": _sha256(EXTENSION)}) + "\n")
        return 0
    raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
