"""Failures injected into Ray workers (imported by the workers of tests/test_ray_executor.py's local cluster).

:class:`DieOnce` wraps a job's worker spec: the first worker to compute work item ``at`` writes its process id
to ``marker`` and is killed on the spot (SIGKILL, what the kernel's out-of-memory killer or ``kill -9`` sends: no
exception, no cleanup); later runs of that item compute it normally. Ray sees a worker lost, not an error, and
runs the task again.
"""

from __future__ import annotations

import os
import signal
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DieOnce:  # with always=True, every run of item ``at`` dies
    spec: Any
    marker: str
    at: int
    always: bool = False

    @property
    def key(self) -> str:
        return self.spec.key

    def open(self, stack: ExitStack) -> _Dying:
        return _Dying(self.spec.open(stack), self.marker, self.at, self.always)


class _Dying:
    def __init__(self, job: Any, marker: str, at: int, always: bool) -> None:
        self.job, self.marker, self.at, self.always = job, marker, at, always
        self.items = job.items

    def read(self, item):
        return self.job.read(item)

    def compute(self, item, inputs):
        if item is self.items[self.at] and (self.always or not os.path.exists(self.marker)):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return self.job.compute(item, inputs)

    def deliver(self, item, output):
        return self.job.deliver(item, output)
