"""The scheduler's policies: in what order a step's token budget goes to the running requests and
to the queue. Admission itself is first-come-first-served under every policy (a queued request
is never overtaken), and decoding requests that are due (decode_service_interval) are served
before any policy order is consulted; a policy decides only the rest.

A policy is a function (running requests in admission order, step) -> the order in which they
take their tokens, with `ADMIT` marking where requests from the queue take theirs. "Prefilling"
is `Request.is_prefilling`: a prompt, or the recompute of a request back from a preemption.
"""

from collections.abc import Callable, Sequence

from infer.engine.request import Request


class _AdmitMarker:
    def __repr__(self) -> str:
        return "ADMIT"


# Where in a step's order newly admitted requests take their first prefill chunk.
ADMIT = _AdmitMarker()

PolicyOrder = list[Request | _AdmitMarker]
Policy = Callable[[Sequence[Request], int], PolicyOrder]


def fcfs(running: Sequence[Request], step: int) -> PolicyOrder:
    """Earliest admitted first, decode token or prefill chunk alike, then the queue.

    The oldest request finishes first; a long prompt admitted earlier may hold later requests'
    decodes back, up to decode_service_interval steps.
    """
    return [*running, ADMIT]


def prefill_first(running: Sequence[Request], step: int) -> PolicyOrder:
    """Prefill chunks first (running ones, then the queue's), decodes take what budget is left.

    Shortest time to first token under bursts; decoders wait up to decode_service_interval steps.
    """
    prefilling = [request for request in running if request.is_prefilling]
    decoding = [request for request in running if not request.is_prefilling]
    return [*prefilling, ADMIT, *decoding]


def decode_round_robin(running: Sequence[Request], step: int) -> PolicyOrder:
    """Every decode first, starting one request further along each step, then prefill, then the queue.

    Steadiest inter-token latency; the rotation keeps any one decoder from always being last
    when a step's budget runs out.
    """
    decoding = [request for request in running if not request.is_prefilling]
    prefilling = [request for request in running if request.is_prefilling]
    if decoding:
        offset = step % len(decoding)
        decoding = decoding[offset:] + decoding[:offset]
    return [*decoding, *prefilling, ADMIT]


POLICIES: dict[str, Policy] = {
    "fcfs": fcfs,
    "prefill_first": prefill_first,
    "decode_round_robin": decode_round_robin,
}


def policy_named(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"scheduler_policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]
