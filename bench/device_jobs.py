"""Child processes for bench/device_run.py: the background build of the
extension, and a pool that runs jobs (pytest shards, timing modules) at most
N at a time, each in its own process group with a time limit and a log file."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
T0 = time.time()
_PRINT = threading.Lock()


def log(msg: str) -> None:
    with _PRINT:
        print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def extension_has_cuda() -> bool:
    code = "import glm5_ops._C as c, sys; sys.exit(0 if getattr(c, 'WITH_CUDA', 0) else 3)"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True).returncode == 0


class Build:
    """Builds glm5_ops._C with CUDA in a background thread (TORCH_CUDA_ARCH_LIST=9.0a,
    MAX_JOBS = cores) while the jobs that do not need it run. The extension is built
    outside the package (build_ext --build-lib) and renamed into glm5_ops/ when
    complete: a process importing glm5_ops meanwhile sees no extension or the whole
    new one, never a half-written file."""

    def __init__(self, out_dir: str):
        self.log_path = os.path.join(out_dir, "build.log")
        self.done = threading.Event()
        self.ok = False

    def start(self) -> "Build":
        if extension_has_cuda():
            log("glm5_ops._C already has the CUDA kernels: no build")
            self.ok = True
            self.done.set()
        else:
            threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            self.ok = self._build()
        except Exception as e:  # noqa: BLE001 - reported; the jobs that need it are not run
            log(f"build failed: {type(e).__name__}: {e}")
        finally:
            self.done.set()

    def _build(self) -> bool:
        env = dict(os.environ, GLM5_BUILD_CUDA="1")
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
        env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
        if "CUDA_HOME" not in env:
            env.update({"CUDA_HOME": c for c in ("/usr/local/cuda", "/usr/local/cuda-13.0")
                        if os.path.exists(os.path.join(c, "bin", "nvcc"))})
        lib = os.path.join(ROOT, "build", "device_run_lib")
        log(f"building glm5_ops._C with CUDA in the background (CUDA_HOME={env.get('CUDA_HOME')}, "
            f"MAX_JOBS={env['MAX_JOBS']}; log {self.log_path})")
        t = time.time()
        with open(self.log_path, "w") as f:
            rc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", lib], cwd=ROOT, env=env,
                                stdout=f, stderr=subprocess.STDOUT).returncode
        built = glob.glob(os.path.join(lib, "glm5_ops", "_C*.so"))
        if rc != 0 or not built:
            log(f"build failed (exit {rc}) after {time.time() - t:.0f}s; the end of {self.log_path}:")
            with open(self.log_path) as f:
                print(f.read()[-4000:], flush=True)
            return False
        os.replace(built[0], os.path.join(ROOT, "glm5_ops", os.path.basename(built[0])))   # atomic
        with open(self.log_path) as f:
            warnings = [ln for ln in f if "warning" in ln.lower()]
        log(f"built in {time.time() - t:.0f}s ({len(warnings)} warning lines)")
        for ln in warnings[:10]:
            print("   ", ln.rstrip()[:300], flush=True)
        if not extension_has_cuda():
            log("the built glm5_ops._C does not load with CUDA kernels")
            return False
        return True


class Job:
    """One child process: cmd, its log file, a time limit; `needs_build`: it waits for
    the extension; `weight`: larger ones start first; `echo`: its lines go to the console."""

    def __init__(self, name, cmd, log_path, *, limit_s, env=None, needs_build=True, weight=1.0, echo=False,
                 nice=False):
        self.name, self.cmd, self.log_path, self.limit_s = name, cmd, log_path, limit_s
        self.env, self.needs_build, self.weight, self.echo, self.nice = env or {}, needs_build, weight, echo, nice
        self.proc = self.thread = None
        self.t0 = self.wall = 0.0
        self.end = "not started"

    def start(self, limit_s: float, niced: bool) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.limit_s = limit_s
        self.t0 = time.time()
        pre = ["nice", "-n", "10"] if niced else []
        self.proc = subprocess.Popen(pre + self.cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()
        log(f"start {self.name} (limit {limit_s:.0f}s{', niced while the build runs' if niced else ''})")

    def _pump(self) -> None:
        with open(self.log_path, "w") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()
                if self.echo:
                    with _PRINT:
                        print(f"[{time.time() - T0:6.1f}s] {self.name} | {line.rstrip()}", flush=True)

    def poll(self):
        """None while running; else how it ended ("ok", "exit N", "time limit")."""
        rc = self.proc.poll()
        if rc is None and time.time() - self.t0 > self.limit_s:
            os.killpg(self.proc.pid, signal.SIGKILL)   # the child and its compilers (its own session)
            self.proc.wait()
            rc = "time limit"
        if rc is None:
            return None
        self.thread.join(timeout=10)
        self.wall = time.time() - self.t0
        self.end = rc if isinstance(rc, str) else ("ok" if rc == 0 else f"exit {rc}")
        return self.end


def run_jobs(jobs: list, parallel: int, build: Build | None, phase_s: float | None, on_done) -> None:
    """Runs `jobs`, at most `parallel` at a time, heaviest first; those that need
    the extension wait for `build` (None: it is there). Each gets its limit or what
    is left of the phase's `phase_s`; one that would get under 30 s is not started
    (its end says so). on_done(job) is called as each ends."""
    pending = sorted(jobs, key=lambda j: -j.weight)
    running: list = []
    start = time.time()
    while pending or running:
        building = build is not None and not build.done.is_set()
        for job in [j for j in pending if j.needs_build and build is not None and build.done.is_set()
                    and not build.ok]:
            pending.remove(job)
            job.end = "not run: the extension did not build"
            on_done(job)
        while pending and len(running) < parallel:
            ready = [j for j in pending if not (j.needs_build and building)]
            if not ready:
                break
            left = job_limit = ready[0].limit_s
            if phase_s is not None:
                left = min(job_limit, phase_s - (time.time() - start))
            if left < 30:
                for job in pending:
                    job.end = f"not started: the phase's {phase_s:.0f}s were spent"
                    on_done(job)
                pending = []
                break
            job = ready[0]
            pending.remove(job)
            job.start(left, niced=building and job.nice)
            running.append(job)
        time.sleep(0.2)
        for job in list(running):
            if job.poll() is not None:
                running.remove(job)
                log(f"done {job.name} in {job.wall:.0f}s ({job.end})")
                on_done(job)
