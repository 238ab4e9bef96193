"""Progress lines for the slow phases of start-up (loading weights, warming kernels up, capturing
CUDA graphs), so that whoever starts a server sees what it waits on and for how long.

    with startup_phase("capturing CUDA graphs"):
        graphs.capture_all()

logs, at INFO (`infer serve`'s default level), "capturing CUDA graphs ..." as the phase starts
and "capturing CUDA graphs: 12.3 s" when it ends.
"""

import contextlib
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def startup_phase(what: str, log: logging.Logger = logger) -> Iterator[None]:
    """Logs `what` at INFO when the block starts, and again with its seconds when it ends (not
    when it raises: the error says what happened)."""
    log.info("%s ...", what)
    started_s = time.perf_counter()
    yield
    log.info("%s: %.1f s", what, time.perf_counter() - started_s)
