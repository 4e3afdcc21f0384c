"""The engine's own thread: the only code that touches the Engine (it is not thread-safe).

    runner = EngineRunner(engine); runner.start()
    runner.add(request_id, prompt_ids, params, deliver)   # any thread; deliver(item) runs on the engine thread
    runner.abort(request_id)                              # any thread; frees its pages
    runner.snapshot                                       # the engine's stats after its last step
    runner.stop()

Requests and aborts reach the thread through one queue and are applied
between steps. deliver gets each RequestOutput of its request (token_ids are
cumulative), or the exception add_request raised; after a finished output,
an exception or an abort it is never called again. The server's deliver puts
the item on the request's asyncio queue with loop.call_soon_threadsafe.
"""
from __future__ import annotations

import queue
import sys
import threading
import traceback
from typing import Callable


IDLE_WAIT_S = 0.5           # how long the idle thread sleeps on the queue before looking for stop()


class EngineRunner:
    def __init__(self, engine, *, name: str = "engine"):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deliver: dict[str, Callable] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.snapshot: dict = self._stats()
        self.num_step_errors = 0
        self.last_error: str | None = None

    # -- any thread ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def add(self, request_id: str, prompt_token_ids: list[int], params, deliver: Callable) -> None:
        self._inbox.put(("add", request_id, prompt_token_ids, params, deliver))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # -- the engine thread ---------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished_requests()
            self._drain(block=not busy)
            if self.engine.has_unfinished_requests():
                self._step()
            self.snapshot = self._stats()
        for rid in list(self._deliver):          # shutting down: nobody waits forever
            self._fail(rid, RuntimeError("the server is shutting down"))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, item) -> None:
        if item[0] == "add":
            _, rid, prompt, params, deliver = item
            try:
                self.engine.add_request(rid, prompt, params)
            except (ValueError, TypeError) as e:
                _call(deliver, e)
                return
            self._deliver[rid] = deliver
        elif item[0] == "abort":
            rid = item[1]
            if self._deliver.pop(rid, None) is not None:
                self.engine.abort(rid)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:      # a bug: fail what is in flight, keep serving the next requests
            self.num_step_errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
            for rid in list(self._deliver):
                self._fail(rid, RuntimeError(f"the engine failed: {self.last_error}"))
            return
        for out in outputs:
            deliver = self._deliver.get(out.request_id)
            if deliver is None:
                continue
            if out.finished:
                del self._deliver[out.request_id]
            _call(deliver, out)

    def _fail(self, rid: str, error: Exception) -> None:
        deliver = self._deliver.pop(rid)
        self.engine.abort(rid)
        _call(deliver, error)

    def _stats(self) -> dict:
        bm = self.engine.block_manager
        return {**self.engine.stats(), "num_pages": bm.num_pages, "num_free_pages": bm.num_free_pages,
                "prefix_cache_queries": bm.prefix_cache_queries, "prefix_cache_hits": bm.prefix_cache_hits,
                "page_size": bm.page_size}


def _call(deliver: Callable, item) -> None:
    try:
        deliver(item)
    except Exception:           # the client's loop is gone (shutdown): nothing to tell it
        traceback.print_exc(file=sys.stderr)
