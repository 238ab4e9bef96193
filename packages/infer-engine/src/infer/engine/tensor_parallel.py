"""Tensor parallelism in the engine (`EngineConfig.tensor_parallel_size`): the engine core's
process is rank 0, and it starts ranks 1..N-1 as worker processes. Every rank builds the same
parts over its shard of the model (infer.models.tensor_parallel: its slice of the weights, its
KV heads, a KV pool of as many blocks); only rank 0 schedules. Rank 0's runner
(`MirroredRunner`) sends each call to the workers before making it, so every rank runs the same
launch, sample and collect in the same order, and the forward's all-reduces meet:

    rank 0 (the core)                         rank r (a worker)
    runner.launch(decision)      -- call -->  runner.launch(decision)
    runner.sample(launch, masks) -- call -->  runner.sample(its own launch, masks)
    runner.collect()             -- call -->  runner.collect()  (the same tokens, dropped)

Every rank samples the same tokens: the logits are gathered whole on each rank, and each
request's generator is seeded from the decision; so each worker's rows hold the tokens rank 0's
do. Calls travel pickled over a gloo group (torch.distributed.broadcast_object_list), which
reaches ranks on other hosts as well as this one. A worker that exits (killed, or a call that
raised there) makes the next call raise WorkerDiedError, which ends the engine (its requests fail
with that error).
"""

import base64
import logging
import os
import pickle
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from infer.models.tensor_parallel import TensorParallel, free_local_port

logger = logging.getLogger(__name__)

# How long a collective waits for a rank that is alive but silent before it raises: start-up
# (loading a shard, warming up) happens between the first collectives.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# NVLink multicast (NVLS) is off on the machines this runs on (their notes say why); set in
# every rank before NCCL starts.
NCCL_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited: the ranks can no longer run a step together."""


def init_rank(config, rank: int, init_method: str, device_type: str) -> tuple[TensorParallel, object]:
    """Joins the ranks: NCCL for the model's collectives on CUDA (each rank its host's GPU of
    its local rank), gloo on a CPU; returns this rank's TensorParallel and the gloo group that
    carries runner calls."""
    for name, value in NCCL_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    size = config.tensor_parallel_size
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank % ranks_per_node(config))
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return TensorParallel(rank, size), control


def ranks_per_node(config) -> int:
    return config.tensor_parallel_size // config.nnodes


def start_workers(config, device_type: str) -> tuple[TensorParallel, "MirroredRunnerLink"]:
    """On node 0: starts this host's ranks 1..R-1 (R ranks a node) and joins all the ranks as
    rank 0; the other nodes run theirs (infer.engine.tensor_parallel_worker.run_node)."""
    init_method = init_method_of(config)
    processes = start_ranks(config, range(1, ranks_per_node(config)), init_method, device_type)
    tp, control = init_rank(config, 0, init_method, device_type)
    logger.info("tensor parallel: %d ranks on %d hosts over %s", tp.size, config.nnodes, dist.get_backend())
    return tp, MirroredRunnerLink(processes, control)


def init_method_of(config) -> str:
    port = config.master_port if config.master_port is not None else free_local_port()
    return f"tcp://{config.master_addr}:{port}"


def start_ranks(config, ranks, init_method: str, device_type: str) -> list[subprocess.Popen]:
    """Worker processes for `ranks`: plain subprocesses (tensor_parallel_worker.worker_main),
    since the engine core's own process is a daemon, which multiprocessing forbids children."""
    encoded = base64.b64encode(pickle.dumps(config)).decode()
    entry = "from infer.engine.tensor_parallel_worker import worker_main; worker_main()"
    return [
        subprocess.Popen([sys.executable, "-c", entry, encoded, str(rank), init_method, device_type])
        for rank in ranks
    ]


class MirroredRunnerLink:
    """Rank 0's line to the workers: sends each runner call, notices a worker that exited."""

    def __init__(self, processes: list, control):
        self.processes = processes
        self.control = control

    def send(self, name: str, *args) -> None:
        self.check_alive()
        try:
            dist.broadcast_object_list([(name, args)], src=0, group=self.control)
        except RuntimeError as error:
            self.check_alive()
            raise WorkerDiedError(f"a tensor-parallel worker stopped answering: {error}") from error

    def check_alive(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                raise WorkerDiedError(
                    f"tensor-parallel worker rank {rank} exited (exit code {process.returncode})"
                )

    def stop(self) -> None:
        """Ends the workers (each leaves its loop) and the ranks' group."""
        if all(process.poll() is None for process in self.processes):
            self.send("stop")
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


class MirroredRunner:
    """Rank 0's runner: each launch, sample and collect goes to the workers first, then runs
    here; everything else is the local runner's."""

    def __init__(self, runner, link: MirroredRunnerLink):
        self._runner = runner
        self.link = link

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def launch(self, decision):
        self.link.send("launch", decision)
        try:
            return self._runner.launch(decision)
        except RuntimeError:
            self.link.check_alive()  # a collective that failed because a worker went
            raise

    def sample(self, launch, masks=None) -> None:
        self.link.send("sample", masks)
        self._runner.sample(launch, masks)

    def collect(self):
        self.link.send("collect")
        try:
            return self._runner.collect()
        except RuntimeError:
            self.link.check_alive()
            raise

    def shutdown(self) -> None:
        self.link.stop()
