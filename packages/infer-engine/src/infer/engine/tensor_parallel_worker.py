"""The worker side of tensor parallelism (infer.engine.tensor_parallel): a rank other than 0
builds its parts and runs the runner calls rank 0 sends. A worker process on node 0 is started by
rank 0 (`worker_main`); another host runs its ranks with `run_node` (`infer serve --node-rank K`,
or `python -m infer.engine.node`)."""

import base64
import logging
import pickle
import sys
from collections import deque

import torch.distributed as dist

from infer.engine.build import build_engine_parts
from infer.engine.tensor_parallel import init_method_of, init_rank, ranks_per_node, start_ranks

logger = logging.getLogger(__name__)


def run_node(config, device_type: str) -> int:
    """On node k > 0 (config.node_rank): runs this host's ranks for node 0, the first in this
    process, until node 0 stops them; returns the exit code (0: stopped, else a rank's)."""
    first = config.node_rank * ranks_per_node(config)
    init_method = init_method_of(config)
    processes = start_ranks(
        config, range(first + 1, first + ranks_per_node(config)), init_method, device_type
    )
    logger.info(
        "node %d: ranks %d..%d, meeting node 0 at %s",
        config.node_rank,
        first,
        first + len(processes),
        init_method,
    )
    try:
        run_worker(config, first, init_method, device_type)
    finally:
        codes = [process.wait() for process in processes]
    return next((code for code in codes if code), 0)


def run_worker(config, rank: int, init_method: str, device_type: str) -> None:
    """A worker's life: join the ranks, build the parts over this rank's shard, then run each
    call rank 0 sends until it sends "stop"."""
    logging.basicConfig(level=logging.WARNING)
    tp, control = init_rank(config, rank, init_method, device_type)
    runner = build_engine_parts(config, tensor_parallel=tp).runner
    launches = deque()
    while True:
        received = [None]
        dist.broadcast_object_list(received, src=0, group=control)
        name, args = received[0]
        if name == "stop":
            break
        # A call that raises ends this worker (its exit ends the engine): rank 0 may have met
        # the error too, or not, and a worker that skipped a call would leave the ranks' next
        # collective waiting.
        if name == "launch":
            launches.append(runner.launch(*args))
        elif name == "sample":
            runner.sample(launches.popleft(), *args)
        else:
            runner.collect()
    dist.destroy_process_group()


def worker_main() -> None:
    """A worker process's entry: its arguments are CONFIG (pickled, base64) RANK INIT_METHOD
    DEVICE_TYPE."""
    config_b64, rank, init_method, device_type = sys.argv[1:5]
    run_worker(pickle.loads(base64.b64decode(config_b64)), int(rank), init_method, device_type)


def node_main(argv: list[str] | None = None) -> int:
    """`python -m infer.engine.node [engine flags]` (and `infer serve` with --node-rank > 0):
    runs this host's ranks of a multi-host engine (`run_node`)."""
    import argparse

    from infer.engine.config import add_cli_arguments, from_cli_args, resolve_device

    parser = argparse.ArgumentParser(prog="infer node", description=node_main.__doc__)
    add_cli_arguments(parser)
    config = from_cli_args(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO)
    return run_node(config, resolve_device(config.device).type)
