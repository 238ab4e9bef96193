"""EngineClient: how a frontend reaches an EngineCore, in its own thread or in a child process.

Both clients take requests and aborts from any thread of the frontend and give back the core's
`EngineOutputs` to one reading thread:

- `InProcClient` (tests, `infer generate`, `infer serve --engine-in-process`): the core runs in
  whichever thread calls `get_outputs`, which steps it. `add` and `abort` only append to an inbox
  under a lock; the next `get_outputs` hands the inbox to the core, so the core is touched by
  the reading thread alone.
- `ProcClient` (`infer serve`'s default; `infer.engine.engine_process`): the core runs in a child
  process that loops `step()` without waiting on the frontend; `get_outputs` reads what it sent.

`get_outputs(wait_s)` returns the next step's outputs, or None when there were none within
`wait_s`. A client whose core is gone (the child died or stopped answering) sets `failure` and
raises EngineDeadError from then on.
"""

import threading
from collections.abc import Sequence
from typing import Protocol

from infer.engine.engine_core import EngineCore
from infer.engine.protocol import CoreLimits, EngineOutputs, EngineRequest


class EngineDeadError(RuntimeError):
    """The engine core is gone: its process died or stopped answering, or a step raised."""


class EngineClient(Protocol):
    limits: CoreLimits
    failure: str | None

    def add(self, request: EngineRequest) -> None: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def get_outputs(self, wait_s: float = 0.0) -> EngineOutputs | None: ...

    def has_work(self) -> bool: ...

    def shutdown(self) -> None: ...


class InProcClient:
    """The core in the calling thread (see the module doc)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.limits = core.limits
        self.failure: str | None = None
        self._lock = threading.Lock()
        # ("add", EngineRequest) and ("abort", ids) in the order they were asked for.
        self._inbox: list[tuple[str, object]] = []
        self._wake = threading.Event()

    def add(self, request: EngineRequest) -> None:
        with self._lock:
            self._inbox.append(("add", request))
        self._wake.set()

    def abort(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            self._inbox.append(("abort", list(request_ids)))
        self._wake.set()

    def has_work(self) -> bool:
        with self._lock:
            pending = bool(self._inbox)
        return pending or self.core.has_work()

    def get_outputs(self, wait_s: float = 0.0) -> EngineOutputs | None:
        """Steps the core once, when it has work; otherwise waits up to `wait_s` for some."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        # Cleared before the inbox is taken: an add after it sets it again, and the wait ends.
        self._wake.clear()
        self._take_inbox()
        if not self.core.has_work():
            if wait_s <= 0 or not self._wake.wait(wait_s):
                return None
            self._take_inbox()
            if not self.core.has_work():
                return None
        try:
            return self.core.step()
        except Exception as error:
            # A step that raises leaves the core's state unknown (a failed forward does not
            # raise: it fails its requests); nothing more is stepped.
            self.failure = f"{type(error).__name__}: {error}"
            raise EngineDeadError(self.failure) from error

    def shutdown(self) -> None:
        self.core.shutdown()

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, payload in inbox:
            if kind == "add":
                self.core.add(payload)
            else:
                self.core.abort(payload)
