"""Where one thread's wall-clock time goes, by sampling its Python stack (a poor man's py-spy,
which the GPU machine does not have; cProfile slows the loop and its numbers are per call,
not per phase).

Every `interval` seconds a daemon thread reads the watched thread's current frame and counts
the innermost quantkit frame together with the innermost frame of all (where a GPU-bound run
waits: a synchronising copy, `.item()`...). `label` (set by the caller, e.g. the block index)
splits the counts. Used by benchmarks/gpu_where_time_goes.py and quantkit_disk_run.py.
"""

from __future__ import annotations

import collections
import sys
import threading
import time


class StackSampler:
    def __init__(self, interval: float = 0.005, thread_id: int | None = None):
        self.interval = interval
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()
        self.label = "start"
        # seconds per key: each sample weighs the time since the previous one (the sampler
        # waits for the GIL, so samples come late while the thread runs Python or holds it)
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stack-sampler")

    @staticmethod
    def _key(frame) -> str:
        leaf = f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"
        ours = []
        f = frame
        while f is not None and len(ours) < 3:
            path = f.f_code.co_filename
            if "/quantkit/" in path and "-packages/" not in path and "/benchmarks/" not in path:
                ours.append(f"{path.rsplit('/quantkit/', 1)[-1]}:{f.f_code.co_name}:{f.f_lineno}")
            f = f.f_back
        return " < ".join(ours) + " | " + leaf

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            now = time.perf_counter()
            if frame is not None:
                self.counts[self.label][self._key(frame)] += now - last
            # a frame kept until the next sample keeps its locals alive (GPU buffers: the
            # first version of this sampler raised a GPTQ run's peak by 0.8 GiB)
            del frame
            last = now

    def __enter__(self) -> StackSampler:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, top: int = 12) -> dict:
        """{label: {"seconds": sampled seconds, "top": [[seconds, key], ...]}}"""
        out = {}
        for label, counter in self.counts.items():
            out[label] = {"seconds": round(sum(counter.values()), 2),
                          "top": [[round(s, 3), k] for k, s in counter.most_common(top)]}
        return out

    def print(self, top: int = 12) -> None:
        for label, rep in self.report(top).items():
            print(f"--- {label}: {rep['seconds']} s sampled")
            for sec, key in rep["top"]:
                print(f"  {sec:7.3f}  {key}")
