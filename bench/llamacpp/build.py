"""Fetch llama.cpp's source from the package registry and build it here.

The `llama-cpp-python` source distribution vendors llama.cpp (with the
GLM_DSA model, `convert_hf_to_gguf.py`, `gguf-py` and `llama-bench`) and its
ctypes bindings, so pip is the only network client needed. Everything lives in
a work folder outside the repository (default ~/.cache/glm5-lab/llamacpp,
`GLM5_LLAMACPP_HOME` overrides) and is reused by later runs: the download, the
extracted tree and the CMake build are each skipped when already present.
No llama.cpp code is committed to the lab.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass

DEFAULT_VERSION = "0.3.36"
TARGETS = ("llama", "llama-bench")


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot be fetched or built on this machine; the message says why."""


@dataclass(frozen=True)
class LlamaCpp:
    package_dir: str      # the extracted sdist: llama_cpp/ (ctypes bindings) lives here
    source_dir: str       # vendor/llama.cpp
    build_dir: str

    @property
    def lib_dir(self) -> str:
        return os.path.join(self.build_dir, "bin")

    @property
    def bench_bin(self) -> str:
        return os.path.join(self.lib_dir, "llama-bench")

    @property
    def converter(self) -> str:
        return os.path.join(self.source_dir, "convert_hf_to_gguf.py")


def default_home() -> str:
    return os.environ.get("GLM5_LLAMACPP_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "glm5-lab", "llamacpp")


def _log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", flush=True)


def check_toolchain() -> None:
    """Raises LlamaCppUnavailable naming every missing tool (cmake, a C and a C++ compiler)."""
    missing = [tool for tool, names in (("cmake", ["cmake"]), ("a C compiler", ["cc", "gcc", "clang"]),
                                        ("a C++ compiler", ["c++", "g++", "clang++"]))
               if not any(shutil.which(n) for n in names)]
    if missing:
        raise LlamaCppUnavailable(
            f"cannot build llama.cpp here: {', '.join(missing)} not found on PATH "
            "(install e.g. `apt-get install cmake g++`); the comparison needs a local llama.cpp build")


def _run(cmd: list[str], what: str, log_path: str | None = None, cwd: str | None = None, hint: str = "") -> None:
    _log(f"{what}: {' '.join(cmd)}")
    with open(log_path, "a") if log_path else open(os.devnull, "w") as log:
        proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE if not log_path else log,
                              stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = proc.stdout[-2000:] if proc.stdout else _tail(log_path)
        raise LlamaCppUnavailable(f"{what} failed (exit {proc.returncode}){hint}:\n{tail}")


def _tail(path: str | None, n: int = 2000) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def fetch_source(home: str, version: str = DEFAULT_VERSION) -> str:
    """The extracted sdist folder, downloaded with pip when not already here."""
    package_dir = os.path.join(home, f"llama_cpp_python-{version}")
    if os.path.isfile(os.path.join(package_dir, "vendor", "llama.cpp", "CMakeLists.txt")):
        return package_dir
    os.makedirs(home, exist_ok=True)
    sdist = os.path.join(home, f"llama_cpp_python-{version}.tar.gz")
    if not os.path.exists(sdist):
        # pip prepares the sdist's metadata (about a minute) before it saves it.
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={version}", "-d", home],
             f"downloading llama-cpp-python {version} (source) from the package registry",
             hint=" (is the package registry reachable, and does it hold this version?)")
        if not os.path.exists(sdist):
            raise LlamaCppUnavailable(f"pip reported success but {sdist} is not there")
    _log(f"extracting {sdist}")
    with tarfile.open(sdist) as tar:
        tar.extractall(home, filter="data") if sys.version_info >= (3, 12) else tar.extractall(home)
    if not os.path.isfile(os.path.join(package_dir, "vendor", "llama.cpp", "CMakeLists.txt")):
        raise LlamaCppUnavailable(f"{sdist} holds no vendor/llama.cpp (a llama-cpp-python without vendored source?)")
    return package_dir


def build(home: str | None = None, version: str = DEFAULT_VERSION, jobs: int = 2, nice: int = 15) -> LlamaCpp:
    """Fetches and builds llama.cpp (libllama and llama-bench, CPU, -march=native);
    returns the paths. Raises LlamaCppUnavailable with the reason when it cannot."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    home = home or default_home()
    check_toolchain()
    package_dir = fetch_source(home, version)
    source = os.path.join(package_dir, "vendor", "llama.cpp")
    build_dir = os.path.join(home, f"build-{version}")
    lc = LlamaCpp(package_dir, source, build_dir)
    log = os.path.join(home, f"build-{version}.log")
    if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
        _run(["cmake", "-S", source, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
              "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"],
             "configuring llama.cpp", log)
    if not (os.path.exists(lc.bench_bin) and _libllama(lc.lib_dir)):
        _log(f"building {', '.join(TARGETS)} with {jobs} jobs (several minutes on 2 cores; log: {log})")
        prefix = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
        _run(prefix + ["cmake", "--build", build_dir, "--config", "Release", "-j", str(jobs),
                       "--target", *TARGETS], "building llama.cpp", log)
    if not _libllama(lc.lib_dir):
        raise LlamaCppUnavailable(f"the build finished but {lc.lib_dir} holds no libllama.so")
    _log(f"ready: {lc.lib_dir}")
    return lc


def _libllama(lib_dir: str) -> bool:
    return os.path.exists(os.path.join(lib_dir, "libllama.so"))
