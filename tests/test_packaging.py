"""pyproject.toml, checked without installing anything: it parses, declares what
an isolated build and a fresh venv need, its console script resolves, and every
package of the lab ships."""
import importlib
import importlib.util
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent
# top-level folders that hold Python but are not part of the installed lab
NOT_SHIPPED = {"tests", "bench", "scripts", "build", "csrc", ".ci", ".git"}


def _setup_state():
    spec = importlib.util.spec_from_file_location("setup_state", ROOT / "scripts" / "setup_state.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


setup_state = _setup_state()
PYPROJECT = setup_state.load_pyproject()


def _names(reqs):
    from packaging.requirements import Requirement
    return {Requirement(r).name: str(Requirement(r).specifier) for r in reqs}


def test_build_requirements():
    build = PYPROJECT["build-system"]
    assert build["build-backend"] == "setuptools.build_meta"
    names = _names(build["requires"])
    assert names["setuptools"] == ">=64", "PEP 660 editable installs need setuptools >= 64"
    assert names["torch"] == "==2.14.1", "the isolated build compiles against CI's torch"
    assert "ninja" in names


def test_runtime_dependencies():
    names = _names(PYPROJECT["project"]["dependencies"])
    assert {"torch", "numpy", "nvtx", "matplotlib"} <= set(names)
    # the build pin must lie inside the supported runtime range
    from packaging.specifiers import SpecifierSet
    assert SpecifierSet(names["torch"]).contains("2.14.1")
    assert SpecifierSet(names["torch"]).contains("2.11.0")


def test_test_extra_brings_what_the_suite_imports():
    reqs = _names(setup_state.requirements(["test"]))
    for name in ("pytest", "pytest-xdist", "pytest-benchmark", "hypothesis", "transformers", "safetensors"):
        assert name in reqs, f"the test extra lacks {name}"
    assert reqs["transformers"] == "==5.23.0"


def test_unknown_extra_is_refused():
    with pytest.raises(SystemExit, match="unknown extra"):
        setup_state.requirements(["nope"])


def test_console_script_resolves():
    target = PYPROJECT["project"]["scripts"]["glm5-lab"]
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_every_package_ships():
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    assert find.get("namespaces") is False
    shipped = set(find_packages(str(ROOT), include=find["include"]))
    with_python = {p.parent.relative_to(ROOT) for p in ROOT.rglob("*.py")}
    expected = {".".join(d.parts) for d in with_python if d.parts and d.parts[0] not in NOT_SHIPPED}
    assert expected, "found no package folders"
    assert expected - shipped == set(), "folders with .py files that would not be installed (missing __init__.py or include)"
    assert {"glm5_ops", "glm5_ops.triton", "models.glm5", "profiling", "training"} <= shipped


def test_stamp_inputs_follow_build_variables(monkeypatch):
    monkeypatch.delenv("GLM5_BUILD_CUDA", raising=False)
    base = setup_state.build_inputs()
    monkeypatch.setenv("GLM5_BUILD_CUDA", "0")
    assert setup_state.build_inputs() != base
