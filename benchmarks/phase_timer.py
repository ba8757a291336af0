"""Wall time per phase, by wrapping a module's or class's own functions (no copy of their code).

Shared by the *_cpu_phases.py benchmarks: `timer.wrap(owner, "fn", "label")` replaces
owner.fn with a timed wrapper; `timer.seconds[label]` sums, `timer.calls[label]` lists each call.
"""

from __future__ import annotations

import collections
import functools
import time


class PhaseTimer:
    def __init__(self, sync=None) -> None:
        """`sync` (e.g. torch.cuda.synchronize) runs before each timed call ends, so queued GPU
        work is charged to the phase that queued it."""
        self.sync = sync
        self.seconds: collections.Counter = collections.Counter()
        self.calls: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(self, owner, attr: str, label: str) -> None:
        """Time owner.attr under `label`; a missing attribute (a phase this version of the code
        does not have) is left alone."""
        fn = getattr(owner, attr, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                out = fn(*a, **k)
                if self.sync is not None:
                    self.sync()
                return out
            finally:
                dt = time.perf_counter() - t
                self.seconds[label] += dt
                self.calls[label].append(dt)
        setattr(owner, attr, wrapper)
