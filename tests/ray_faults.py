"""Failures injected into Ray workers (imported by the workers of tests/test_ray_executor.py's local cluster).

:class:`DieOnce` wraps a job's worker spec: the first worker to compute work item ``at`` writes its process id
to ``marker`` and dies on the spot (``os._exit``: no exception, no cleanup, as a killed or out-of-memory worker
does); later runs of that item compute it normally. Ray sees a worker lost, not an error, and runs the task
again.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DieOnce:
    spec: Any
    marker: str
    at: int

    @property
    def key(self) -> str:
        return self.spec.key

    def open(self, stack: ExitStack) -> _Dying:
        return _Dying(self.spec.open(stack), self.marker, self.at)


class _Dying:
    def __init__(self, job: Any, marker: str, at: int) -> None:
        self.job, self.marker, self.at = job, marker, at
        self.items = job.items

    def read(self, item):
        return self.job.read(item)

    def compute(self, item, inputs):
        if item is self.items[self.at] and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os._exit(1)
        return self.job.compute(item, inputs)

    def deliver(self, item, output):
        return self.job.deliver(item, output)
