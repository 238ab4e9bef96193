"""The engine core in a child process of its own, and `ProcClient`, the frontend's end of it.

Why: the core's loop (schedule, build inputs, launch, sample) is Python, and so is the
frontend's work (HTTP parsing, tokenizing, detokenizing, stop strings, SSE). In one process they
share one GIL and the GPU waits on both; apart, the core steps on without waiting for the
frontend, as vLLM's and SGLang's engine processes do.

Transport: two one-way `multiprocessing` pipes (spawn context, so a CUDA child starts clean),
pickling the `infer.engine.protocol` dataclasses. Frontend -> core: ("add", EngineRequest),
("abort", [ids]), ("shutdown", None). Core -> frontend: ("ready", CoreLimits, EngineStats) once
built, or ("failed", reason) and exit; then ("outputs", EngineOutputs) after each step that
produced some, and at least every HEARTBEAT_S otherwise.

Faults: the pipe's end of file means the child died; no message for `unresponsive_timeout_s`
means it stopped answering (a hang in a step), and it is killed. Either way `get_outputs` raises
EngineDeadError from then on, and the frontend fails what was in flight. The child exits when
the frontend's end closes (the frontend died) or on "shutdown".
"""

import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from infer.engine.client import EngineDeadError
from infer.engine.config import EngineConfig
from infer.engine.protocol import EngineOutputs, EngineRequest

logger = logging.getLogger(__name__)

# An idle core says it is alive this often; a busy one with each step's outputs.
HEARTBEAT_S = 0.5
# No word from the core for this long and the frontend takes it for hung: the core speaks after
# every step with outputs and every HEARTBEAT_S, so only a step stuck this long is silent (one
# step of a served model takes milliseconds, a long prompt chunk on a CPU about a second).
DEFAULT_UNRESPONSIVE_TIMEOUT_S = 30.0
# How long `shutdown` waits for the child to exit by itself before killing it.
SHUTDOWN_WAIT_S = 5.0


class EngineStartError(RuntimeError):
    """The engine process could not build its core; the message is the child's reason."""


class ProcClient:
    """An EngineClient over a child process (see the module doc)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        startup_timeout_s: float | None = None,
        unresponsive_timeout_s: float = DEFAULT_UNRESPONSIVE_TIMEOUT_S,
        environment: dict[str, str] | None = None,
        name: str = "infer-engine-core",
    ):
        """Starts the child and waits until its core is built (`startup_timeout_s`: None waits
        as long as loading takes). Raises EngineStartError when it fails or dies first.
        `environment`: variables the child sets first, before CUDA starts (a data-parallel
        replica's CUDA_VISIBLE_DEVICES)."""
        context = multiprocessing.get_context("spawn")
        core_inbox, self._to_core = context.Pipe(duplex=False)
        self._from_core, core_outbox = context.Pipe(duplex=False)
        self.process = context.Process(
            target=engine_process_main,
            args=(config, core_inbox, core_outbox, logging.getLogger().getEffectiveLevel(), environment),
            name=name,
            daemon=True,
        )
        self.process.start()
        # The child holds these ends now; closing ours lets each side see the other's exit.
        core_inbox.close()
        core_outbox.close()
        self.unresponsive_timeout_s = unresponsive_timeout_s
        self.failure: str | None = None
        self._send_lock = threading.Lock()
        kind, *payload = self._wait_for_start(startup_timeout_s)
        if kind == "failed":
            self.process.join(SHUTDOWN_WAIT_S)
            raise EngineStartError(payload[0])
        self.limits, self.initial_stats = payload
        self._last_heard_s = time.monotonic()
        logger.info("engine core runs in process %d", self.process.pid)

    def _wait_for_start(self, timeout_s: float | None) -> tuple:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._from_core.poll(HEARTBEAT_S):
            if not self.process.is_alive():
                raise EngineStartError(
                    f"the engine process exited with code {self.process.exitcode} while starting"
                )
            if deadline is not None and time.monotonic() > deadline:
                self.process.kill()
                raise EngineStartError(f"the engine process did not start within {timeout_s} s")
        try:
            return self._from_core.recv()
        except EOFError:
            self.process.join(SHUTDOWN_WAIT_S)
            raise EngineStartError(
                f"the engine process exited with code {self.process.exitcode} while starting"
            ) from None

    @property
    def connection(self):
        """The pipe end the core's messages arrive on (for multiprocessing.connection.wait)."""
        return self._from_core

    # -- the EngineClient calls -------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        self._send(("add", request))

    def abort(self, request_ids: Sequence[str]) -> None:
        self._send(("abort", list(request_ids)))

    def has_work(self) -> bool:
        # Whether the core has work is the child's to know; the frontend counts its own requests.
        return False

    def get_outputs(self, wait_s: float = 0.0) -> EngineOutputs | None:
        """The next outputs the core sent (a heartbeat: none, with the core's statistics), or None
        when nothing came within `wait_s`. Raises EngineDeadError once the core is gone."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        try:
            if not self._from_core.poll(wait_s):
                self._check_alive()
                return None
            kind, payload = self._from_core.recv()
        except (EOFError, OSError):
            self.process.join(SHUTDOWN_WAIT_S)
            self._fail(f"the engine process exited (code {self.process.exitcode})")
        self._last_heard_s = time.monotonic()
        return payload if kind == "outputs" else EngineOutputs([], payload)

    def shutdown(self) -> None:
        """Asks the child to exit, and kills it if it does not."""
        if self.process.is_alive():
            with contextlib.suppress(EngineDeadError):
                self._send(("shutdown", None))
            self.process.join(SHUTDOWN_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(SHUTDOWN_WAIT_S)
        self._to_core.close()
        self._from_core.close()

    # -- internals ------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        try:
            # Any thread of the frontend may send; the pipe takes one message at a time.
            with self._send_lock:
                self._to_core.send(message)
        except (BrokenPipeError, OSError):
            self._fail(f"the engine process exited (code {self.process.exitcode})")

    def _check_alive(self) -> None:
        if not self.process.is_alive():
            self._fail(f"the engine process exited (code {self.process.exitcode})")
        silent_s = time.monotonic() - self._last_heard_s
        if silent_s > self.unresponsive_timeout_s:
            self.process.kill()
            self._fail(f"the engine process did not answer for {silent_s:.1f} s and was killed")

    def _fail(self, reason: str):
        self.failure = reason
        raise EngineDeadError(reason)


def run_engine_core(config: EngineConfig, inbox, outbox, log_level: int = logging.INFO) -> None:
    """The child's whole life: build the core, then step it while it has work, taking what the
    frontend sent before each step (see the module doc)."""
    # Ctrl-C in a terminal signals the whole process group: the frontend decides what it means
    # (drain, then shutdown), and this process follows it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s %(name)s[core {os.getpid()}]: %(message)s"
    )
    from infer.engine.engine_core import EngineCore
    from infer.engine.startup_progress import startup_phase

    try:
        with startup_phase(f"building the engine core for {config.model}", logger):
            core = EngineCore(config)
    except BaseException as error:  # noqa: BLE001 - the reason goes to the frontend, which reports it
        if not isinstance(error, ValueError | OSError):
            logger.exception("building the engine core failed")
        outbox.send(("failed", f"{type(error).__name__}: {error}"))
        return
    # Everything built so far (the model, the graphs, torch's own objects) lives as long as the
    # process: out of the collector's sight, so that a full collection scans only what serving
    # made. Without this, one full collection with a large prefix cache stalled every stream
    # ~190 ms (measured: the scheduler alone over a pool of 20k cached blocks, SmolLM2 loaded).
    # vLLM and SGLang freeze the same way after start-up.
    gc.collect()
    gc.freeze()
    outbox.send(("ready", core.limits, core.stats()))
    last_sent_s = time.monotonic()
    try:
        while True:
            # Take everything the frontend sent; wait for it only when there is nothing to step,
            # and no longer than until the next heartbeat is due.
            heartbeat_due_s = last_sent_s + HEARTBEAT_S
            timeout_s = 0.0 if core.has_work() else max(0.0, heartbeat_due_s - time.monotonic())
            while inbox.poll(timeout_s):
                kind, payload = inbox.recv()
                if kind == "add":
                    core.add(payload)
                elif kind == "abort":
                    core.abort(payload)
                else:  # "shutdown"
                    return
                timeout_s = 0.0
            if core.has_work():
                engine_outputs = core.step()
                if engine_outputs.outputs or time.monotonic() >= heartbeat_due_s:
                    outbox.send(("outputs", engine_outputs))
                    last_sent_s = time.monotonic()
            elif time.monotonic() >= heartbeat_due_s:
                outbox.send(("heartbeat", core.stats()))
                last_sent_s = time.monotonic()
    except (EOFError, BrokenPipeError):
        return  # the frontend is gone
    finally:
        core.shutdown()


def engine_process_main(
    config: EngineConfig,
    inbox,
    outbox,
    log_level: int = logging.INFO,
    environment: dict[str, str] | None = None,
) -> None:
    """The child process: `run_engine_core`, then an exit without the interpreter's teardown.

    What start-up built is frozen out of the collector's sight (gc.freeze), so a teardown would
    free little of it, and Triton's MLIR objects among what it leaves make nanobind print
    "leaked N instances" and a line for each (27 lines on every `infer serve` shutdown), which
    reads like a crash. Unfreezing first silences them too, but the teardown then frees
    everything: `shutdown()` took 0.9-1.3 s for SmolLM2 on a 2-core machine, against 0.1 s this
    way, of the 5 s a Ctrl-C may take. Nothing is left to do at exit but flush what was written.

    `environment` is set before anything starts CUDA."""
    os.environ.update(environment or {})
    run_engine_core(config, inbox, outbox, log_level)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
