"""Builds glm5_ops._C: the C++ CPU kernels always, the CUDA kernels whenever
torch is a CUDA build and nvcc is found (no GPU needed to compile).

Environment:
  GLM5_BUILD_CUDA=0|1   force the CUDA sources off / on (default: auto)
  TORCH_CUDA_ARCH_LIST  CUDA targets (default "9.0a": H100/H200)
  MAX_JOBS              parallel compile jobs (honoured by ninja)
  GLM5_CPU_ARCH         -march for the CPU sources (default: x86-64-v4 where the
                        build machine has AVX-512, else x86-64-v3)
  GLM5_SANITIZE=1       CPU sources only, built with AddressSanitizer and
                        UndefinedBehaviorSanitizer (-O1 -g; UB aborts); run with
                        libasan preloaded (scripts/sanitize.sh does both)
  GLM5_PLANT_OOB=1      test only: defines GLM5_PLANT_OOB, which plants one
                        out-of-bounds read for the sanitizer job to catch

Metadata and dependencies live in pyproject.toml. Build with the torch that
will run it:  pip install --no-build-isolation -e .
"""
import glob
import os
import platform
import shutil
import sys
import sysconfig

# torch decides CUDA_HOME when cpp_extension is imported, so point it at the
# toolkit first (a CPU machine has no CUDA runtime for torch to find it by).
if not os.environ.get("CUDA_HOME"):
    # /usr/local/cuda first: the nvcc on PATH may be a wrapper script outside the toolkit.
    nvcc = "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else shutil.which("nvcc")
    if nvcc:
        os.environ["CUDA_HOME"] = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils import cpp_extension as cx  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    flag = os.environ.get("GLM5_BUILD_CUDA", "").strip()
    if flag in ("0", "1"):
        if flag == "1" and (torch.version.cuda is None or cx.CUDA_HOME is None):
            raise RuntimeError("GLM5_BUILD_CUDA=1 but torch is not a CUDA build or nvcc was not found "
                               f"(torch.version.cuda={torch.version.cuda}, CUDA_HOME={cx.CUDA_HOME})")
        return flag == "1"
    return torch.version.cuda is not None and cx.CUDA_HOME is not None


def cuda_include_dirs():
    # pip's CUDA wheels ship headers (cusparse.h, cublas_v2.h, ...) that torch's
    # headers include; a bare toolkit may lack some of them.
    site = os.path.dirname(os.path.dirname(torch.__file__))
    return sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))


def _cpu_has_avx512() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))


def cpu_arch_flags():
    # The extension is built on the machine that runs it (pip install -e .),
    # so it targets that machine: AVX-512 where the CPU has it (twice the
    # vector width of AVX2 for the attention micro-kernels), else AVX2.
    # GLM5_CPU_ARCH=x86-64-v3 builds a binary that runs on any AVX2 machine.
    arch = os.environ.get("GLM5_CPU_ARCH")
    if arch is None and platform.machine() in ("x86_64", "AMD64"):
        arch = "x86-64-v4" if _cpu_has_avx512() else "x86-64-v3"
    # at::vec picks its vector width from CPU_CAPABILITY_AVX512 / _AVX2.
    if arch == "x86-64-v4" or (arch == "native" and _cpu_has_avx512()):
        vec = ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    elif arch in ("x86-64-v3", "native"):
        vec = ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    else:
        vec = []
    return ([f"-march={arch}"] if arch else []) + vec


def sanitize_flags():
    """(compile, link) flags for GLM5_SANITIZE=1: ASan + UBSan, every UB report
    fatal, so an out-of-bounds read or a division by zero fails the run even
    where it happens not to crash."""
    if os.environ.get("GLM5_SANITIZE") != "1":
        return [], []
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    plant = ["-DGLM5_PLANT_OOB"] if os.environ.get("GLM5_PLANT_OOB") == "1" else []
    return ["-O1", "-g"] + san + plant, san


def shared_libstdcxx() -> list:
    """The libstdc++ this process runs (torch loaded it), by path, ahead of the
    driver's own -lstdc++. The GPU machines' g++ (/opt/gcc) finds only a static
    libstdc++.a: the extension then carries a private copy of the C++ runtime, and
    every c10::Error thrown in it crashed the process (SIGSEGV) instead of reaching
    Python as an exception (first device run, 2026-12-06); `-Wl,-Bdynamic -lstdc++`
    found the same archive. Linked by path, the extension needs libstdc++.so.6."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "/libstdc++.so" in line})[:1]
    except OSError:   # not Linux: the toolchain's default
        return []


def extension():
    sources = ["csrc/ops.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    san_cxx, san_link = sanitize_flags()
    # the sanitizer flags come last: their -O1 overrides -O3
    cxx = ["-O3", "-fopenmp", "-DGLM5_WITH_OPENMP"] + cpu_arch_flags() + san_cxx
    link = ["-fopenmp"] + shared_libstdcxx()
    kwargs = dict(include_dirs=[os.path.join(ROOT, "csrc")], extra_link_args=link + san_link)
    if san_cxx:
        print("[glm5] building CPU kernels only, with ASan + UBSan (GLM5_SANITIZE=1)", flush=True)
        return cx.CppExtension("glm5_ops._C", sources, extra_compile_args={"cxx": cxx}, **kwargs)
    if want_cuda():
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        print(f"[glm5] building CPU + CUDA kernels (CUDA_HOME={cx.CUDA_HOME}, "
              f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']})", flush=True)
        cxx = cxx + ["-DGLM5_WITH_CUDA"]
        nvcc = ["-O3", "-DGLM5_WITH_CUDA", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
        return cx.CUDAExtension("glm5_ops._C", sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                                include_dirs=kwargs["include_dirs"] + cuda_include_dirs(),
                                extra_link_args=kwargs["extra_link_args"], py_limited_api=False)
    print("[glm5] building CPU kernels only (no CUDA build of torch or no nvcc)", flush=True)
    return cx.CppExtension("glm5_ops._C", sources, extra_compile_args={"cxx": cxx}, **kwargs)


class BuildExtension(cx.BuildExtension.with_options(use_ninja=True)):
    """pip builds an editable install in a fresh temporary directory, so every
    `pip install -e .` recompiled all of csrc (210 s on 2 cores). Editable
    builds use the directory `python setup.py build_ext --inplace` uses instead:
    ninja keeps its objects and log there and recompiles only what changed
    (a changed source, flag or torch changes the command line, so that rebuilds)."""

    def finalize_options(self):
        super().finalize_options()
        if getattr(self, "editable_mode", False):
            plat = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = os.path.join(ROOT, "build", f"temp.{plat}")


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension})
