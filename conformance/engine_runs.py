"""Driving an Engine in tests: step it until every request it holds has finished."""

import time
from collections import defaultdict

from infer.engine.engine import Engine


def run_to_completion(engine: Engine, max_steps: int = 1000) -> dict[str, list]:
    """Each request's EngineOutputs, in order, by request id; fails if work is left after
    max_steps steps (a scheduler that stalls would otherwise hang the test)."""
    outputs = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        for output in engine.step():
            outputs[output.request_id].append(output)
    raise AssertionError(f"engine still has work after {max_steps} steps")


def run_until_finished(engine: Engine, request_ids, timeout_s: float = 300.0) -> dict[str, list]:
    """Each request's StepOutputs until all of `request_ids` finished, for an engine whose core
    runs in other processes (each step waits for their outputs; a count of steps means nothing
    there); fails if any is left after `timeout_s`."""
    outputs, left = defaultdict(list), set(request_ids)
    deadline = time.monotonic() + timeout_s
    while left:
        assert time.monotonic() < deadline, f"{len(left)} requests unfinished after {timeout_s} s: {left}"
        for output in engine.step(wait_s=0.1):
            outputs[output.request_id].append(output)
            if output.finished:
                left.discard(output.request_id)
    return outputs


def token_ids(outputs) -> list[int]:
    """The ids of the outputs that carry a token (a final output may carry none)."""
    return [output.token_id for output in outputs if output.token_id is not None]
