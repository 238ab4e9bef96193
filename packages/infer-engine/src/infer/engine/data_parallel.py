"""Data parallelism: N engine cores behind one frontend, and the router that picks one for each
request (`EngineConfig.data_parallel_size`, vLLM's --data-parallel-size).

Each replica is an engine core in a child process of its own (`ProcClient`), on GPUs of its own:
replica i sees GPUs i * tp .. i * tp + tp - 1 (CUDA_VISIBLE_DEVICES, set in its process before
CUDA starts), where tp is tensor_parallel_size, so a replica's tensor-parallel workers, which
inherit its environment, see its GPUs alone. On a CPU the replicas share the machine.
`DataParallelClient` is an EngineClient over them: the `Engine` above it, and so the server,
see one core whose statistics are the replicas' sums (`sum_stats`), and `replica_stats` for each.

Routing is cache-aware (`PrefixRouter`), after SGLang's router: a prompt's leading blocks are
hashed as a chain (block j's hash covers blocks 0..j, and the request's cache salt), and the
router remembers which replicas were sent each. A request goes to the least busy of the
replicas sent its longest such prefix, since their prefix caches most likely still hold it: the
next turn of a conversation finds its history where the previous turn ran, and a system prompt
every replica has seen decides nothing. A request whose prefix is at most CACHE_THRESHOLD of it
(or none), or whose replica is much busier than the least busy (more than
BALANCE_ABS_THRESHOLD requests in flight beyond it and BALANCE_REL_THRESHOLD times as many),
goes to the least busy instead. Load is the requests a
replica was sent and has not finished, as the frontend counts.

Faults: a replica whose process dies or hangs ends the requests it held with an error
(FinishReason.ERROR) and takes no more; the others serve on. Only when none is left does
`get_outputs` raise EngineDeadError, which stops the server (its /health then fails).
"""

import dataclasses
import logging
import multiprocessing.connection
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from infer.engine.client import EngineDeadError
from infer.engine.config import EngineConfig, EngineConfigError
from infer.engine.protocol import EngineOutput, EngineOutputs, EngineRequest, EngineStats, FinishReason

logger = logging.getLogger(__name__)

# A replica is much busier than the least busy with more than BALANCE_ABS_THRESHOLD requests in
# flight beyond it and BALANCE_REL_THRESHOLD times as many: SGLang's router has the same two
# thresholds (balance_abs_threshold, balance_rel_threshold). A small absolute one, since the
# first replica sent a shared system prompt takes every new conversation until it leads another
# by more than that: at 32, W5 at 4 clients ran every conversation on one replica of two, at 2
# on both with the same share of cached tokens within a point (CPU,
# docs/benchmarks/serving.md#data-parallel-routing). At high load the ratio decides.
BALANCE_ABS_THRESHOLD = 2
BALANCE_REL_THRESHOLD = 1.5
# A prefix decides only when it is more than this share of the prompt (SGLang's router weighs
# the same ratio against its cache_threshold): a short prefix every request shares (a system
# prompt, a chat template's header) would otherwise send all of them to one replica.
CACHE_THRESHOLD = 0.5
# Leading blocks of a prompt the router hashes (4096 tokens at block size 16), which bounds its
# work per request: a prompt longer than that is judged by its hashed part.
ROUTED_BLOCKS = 256
# Prefix hashes remembered, the least recently routed dropped first.
TABLE_CAPACITY = 1 << 20


class PrefixRouter:
    """Which replica serves each request (see the module doc); the caller reports finishes."""

    def __init__(
        self, num_replicas: int, block_size: int, capacity: int = TABLE_CAPACITY, policy: str = "cache_aware"
    ):
        """`policy`: "cache_aware", or "round_robin" (each replica in turn: the baseline)."""
        self.policy = policy
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.capacity = capacity
        self.loads = [0] * num_replicas  # requests routed and not finished
        self.alive = [True] * num_replicas
        self.num_prefix_routed = 0  # requests sent where their prefix went
        # Prefix hash -> the replicas sent it (bit r: replica r), least recently routed first.
        self._holders: OrderedDict[int, int] = OrderedDict()
        self._next = 0  # ties in load go round-robin from here

    def prefix_hashes(self, prompt_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """One hash per whole leading block (at most ROUTED_BLOCKS), each covering the blocks
        before it and the salt: equal hashes mean equal prefixes (up to a 64-bit collision)."""
        size = self.block_size
        hashes, previous = [], hash(("infer-router", cache_salt))
        for start in range(0, min(len(prompt_ids) // size, ROUTED_BLOCKS) * size, size):
            previous = hash((previous, tuple(prompt_ids[start : start + size])))
            hashes.append(previous)
        return hashes

    def route(self, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The replica for a new request; counts it in that replica's load."""
        serving = [replica for replica in range(self.num_replicas) if self.alive[replica]]
        if not serving:
            raise EngineDeadError("no data-parallel replica is left")
        if self.policy == "round_robin":
            chosen = min(serving, key=lambda r: (r - self._next) % self.num_replicas)
            self.loads[chosen] += 1
            self._next = (chosen + 1) % self.num_replicas
            return chosen

        def by_load(replica: int) -> tuple[int, int]:
            return self.loads[replica], (replica - self._next) % self.num_replicas

        least_busy = min(serving, key=by_load)
        chosen = least_busy
        hashes = self.prefix_hashes(prompt_ids, cache_salt)
        judged = min(len(prompt_ids), ROUTED_BLOCKS * self.block_size)
        for num_blocks in range(len(hashes), 0, -1):  # the longest prefix first
            holders = self._holders.get(hashes[num_blocks - 1], 0)
            if holding := [replica for replica in serving if holders >> replica & 1]:
                replica = min(holding, key=by_load)
                decides = num_blocks * self.block_size > CACHE_THRESHOLD * judged
                if decides and not self._much_busier(replica, least_busy):
                    chosen = replica
                    self.num_prefix_routed += 1
                break
        for prefix in hashes:
            self._holders[prefix] = self._holders.get(prefix, 0) | 1 << chosen
            self._holders.move_to_end(prefix)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)
        self.loads[chosen] += 1
        self._next = (chosen + 1) % self.num_replicas
        return chosen

    def finished(self, replica: int) -> None:
        self.loads[replica] -= 1

    def _much_busier(self, replica: int, least_busy: int) -> bool:
        load, least = self.loads[replica], self.loads[least_busy]
        return load - least > BALANCE_ABS_THRESHOLD and load > BALANCE_REL_THRESHOLD * least


def replica_config(config: EngineConfig, replica: int) -> EngineConfig:
    """Replica `replica`'s own config: one core, and its own rendezvous port where one is set."""
    port = None if config.master_port is None else config.master_port + replica
    return dataclasses.replace(config, data_parallel_size=1, master_port=port)


def replica_environment(config: EngineConfig, replica: int) -> dict[str, str]:
    """The variables replica `replica`'s process sets before CUDA starts: its GPUs, counted in
    the frontend's CUDA_VISIBLE_DEVICES where that is set. None needed on a CPU."""
    if config.device == "cpu":
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    tp = config.tensor_parallel_size
    wanted = range(replica * tp, (replica + 1) * tp)
    if visible is None:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(index) for index in wanted)}
    devices = [device for device in visible.split(",") if device.strip()]
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[index] for index in wanted if index < len(devices))}


def check_devices(config: EngineConfig) -> None:
    """Raises EngineConfigError when the frontend's machine has fewer GPUs than the replicas
    and their tensor-parallel groups take."""
    import torch

    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return
    wanted = config.data_parallel_size * config.tensor_parallel_size
    if torch.cuda.device_count() < wanted:
        raise EngineConfigError(
            f"data_parallel_size {config.data_parallel_size} x tensor_parallel_size "
            f"{config.tensor_parallel_size} takes {wanted} GPUs; {torch.cuda.device_count()} are visible"
        )


class DataParallelClient:
    """An EngineClient over data_parallel_size replicas, each a ProcClient (see the module doc)."""

    def __init__(self, config: EngineConfig, **client_options):
        """Starts every replica at once and waits for all (`client_options`: ProcClient's).
        Raises EngineStartError when one could not start, having stopped the others."""
        from infer.engine.engine_process import EngineStartError, ProcClient

        check_devices(config)
        num_replicas = config.data_parallel_size

        def start(replica: int) -> ProcClient:
            return ProcClient(
                replica_config(config, replica),
                environment=replica_environment(config, replica),
                name=f"infer-engine-core-{replica}",
                **client_options,
            )

        with ThreadPoolExecutor(num_replicas) as pool:
            futures = [pool.submit(start, replica) for replica in range(num_replicas)]
            started, reasons = [], []
            for replica, future in enumerate(futures):
                try:
                    started.append(future.result())
                except EngineStartError as error:
                    reasons.append(f"replica {replica}: {error}")
        if reasons:
            for client in started:
                client.shutdown()
            raise EngineStartError("; ".join(reasons))
        self.replicas = started
        limits = started[0].limits
        # The frontend sees one core: the replicas' queues together, and the config it was given.
        self.limits = dataclasses.replace(
            limits,
            max_queue_len=limits.max_queue_len * num_replicas,
            config=dataclasses.replace(limits.config, data_parallel_size=num_replicas),
        )
        self.router = PrefixRouter(num_replicas, limits.block_size, policy=config.data_parallel_routing)
        self.replica_stats: list[EngineStats] = [client.initial_stats for client in started]
        self.initial_stats = sum_stats(self.replica_stats)
        self.failure: str | None = None
        self._lock = threading.Lock()  # add and abort come from any thread, outputs from one
        # Per request in flight: its replica and prompt length (for an error output if it dies).
        self._routed: dict[str, tuple[int, int]] = {}
        self._failed_outputs: list[EngineOutput] = []

    # -- the EngineClient calls -------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        while True:
            with self._lock:
                replica = self.router.route(request.prompt_token_ids, request.cache_salt)
                self._routed[request.request_id] = (replica, len(request.prompt_token_ids))
            try:
                self.replicas[replica].add(request)
                return
            except EngineDeadError as error:  # it died just now: the others take the request
                with self._lock:
                    del self._routed[request.request_id]
                    self.router.finished(replica)
                self._replica_died(replica, str(error))

    def abort(self, request_ids: Sequence[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                if request_id in self._routed:
                    by_replica.setdefault(self._routed[request_id][0], []).append(request_id)
        for replica, ids in by_replica.items():
            if self.router.alive[replica]:
                try:
                    self.replicas[replica].abort(ids)
                except EngineDeadError as error:
                    self._replica_died(replica, str(error))

    def has_work(self) -> bool:
        return False  # the replicas know; the frontend counts its own requests

    def get_outputs(self, wait_s: float = 0.0) -> EngineOutputs | None:
        """What the replicas sent since the last call (each at most one step's), merged, with
        their summed statistics; None when none sent anything within `wait_s`. Raises
        EngineDeadError once no replica is left."""
        serving = [replica for replica in range(len(self.replicas)) if self.router.alive[replica]]
        if not serving and not self._failed_outputs:
            raise EngineDeadError(self.failure or "no data-parallel replica is left")
        if not self._failed_outputs:
            multiprocessing.connection.wait([self.replicas[r].connection for r in serving], timeout=wait_s)
        outputs, heard = [], False
        for replica in serving:
            try:
                replica_outputs = self.replicas[replica].get_outputs(0.0)
            except EngineDeadError as error:
                self._replica_died(replica, str(error))
                continue
            if replica_outputs is None:
                continue
            heard = True
            if replica_outputs.stats is not None:
                self.replica_stats[replica] = replica_outputs.stats
            for output in replica_outputs.outputs:
                if output.finished:
                    self._forget(output.request_id)
                outputs.append(output)
        with self._lock:
            outputs, self._failed_outputs = self._failed_outputs + outputs, []
        if not outputs and not heard:
            if not any(self.router.alive):
                raise EngineDeadError(self.failure or "no data-parallel replica is left")
            return None
        return EngineOutputs(outputs, sum_stats(self.replica_stats))

    def shutdown(self) -> None:
        for client in self.replicas:
            client.shutdown()

    # -- internals ------------------------------------------------------------------------------

    def _forget(self, request_id: str) -> None:
        with self._lock:
            if (routed := self._routed.pop(request_id, None)) is not None:
                self.router.finished(routed[0])

    def _replica_died(self, replica: int, reason: str) -> None:
        """Ends the requests `replica` held with an error; the router sends it no more."""
        with self._lock:
            if not self.router.alive[replica]:
                return
            self.router.alive[replica] = False
            held = [(rid, length) for rid, (r, length) in self._routed.items() if r == replica]
            for request_id, num_prompt_tokens in held:
                del self._routed[request_id]
                self.router.finished(replica)
                self._failed_outputs.append(
                    EngineOutput(
                        request_id,
                        [],
                        FinishReason.ERROR,
                        num_prompt_tokens,
                        error=f"data-parallel replica {replica} failed: {reason}",
                    )
                )
            left = sum(self.router.alive)
            if not left:
                self.failure = f"every data-parallel replica failed; the last: {reason}"
        logger.error(
            "data-parallel replica %d failed (%s): %d requests end with an error, %d replicas serve on",
            replica,
            reason,
            len(held),
            left,
        )


# How each EngineStats field of the replicas combines into the frontend's one core's: counters,
# gauges and rates add up (the replicas run side by side); these do not.
_SAME_IN_EVERY_REPLICA = {
    "memory_device",
    "spec_decode_num_speculative_tokens",
    "prefix_cache_store",
    "kv_cache_dtype",
}
_MEAN = {"decode_time_s_total"}  # side by side: the bytes add up over the same stretch of time


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """One EngineStats for the replicas together: sums, the KV usage ratio over the summed
    bytes, and the prefix-cache runs of every replica."""
    values = {}
    for field in dataclasses.fields(EngineStats):
        name, each = field.name, [getattr(one, field.name) for one in stats]
        if name in _SAME_IN_EVERY_REPLICA:
            values[name] = each[0]
        elif name in _MEAN:
            values[name] = sum(each) / len(each)
        elif name == "prefix_cache_matches":
            values[name] = {
                kind: sum(one.get(kind, 0) for one in each)
                for kind in dict.fromkeys(k for one in each for k in one)
            }
        elif name in ("prefix_cache_entries", "prefix_cache_num_entries"):
            present = [one for one in each if one is not None]
            values[name] = (
                None
                if not present
                else (
                    sum(present) if name.endswith("num_entries") else tuple(e for one in present for e in one)
                )
            )
        elif name.startswith("spec_decode_") and name.endswith("_by_position"):
            width = max((len(one) for one in each), default=0)
            values[name] = tuple(sum(one[i] for one in each if i < len(one)) for i in range(width))
        else:
            values[name] = sum(each)
    total = values["kv_bytes_total"]
    values["kv_usage_ratio"] = values["kv_bytes_used"] / total if total else 0.0
    return EngineStats(**values)
