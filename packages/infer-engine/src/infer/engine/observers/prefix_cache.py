"""The prefix cache seen from the core: its counters, its entries for the dashboard, and the
eviction of entries idle longer than prefix_cache_ttl_s."""

import math
import time
from collections.abc import Callable

from infer.cache import PagedKVPool, PrefixTree, QuantizedKVStore
from infer.engine.decision import ScheduleDecision
from infer.engine.kv_manager import KVCacheManager
from infer.engine.observers import StepObserver
from infer.engine.protocol import ENTRIES_SENT, EngineOutput, PrefixCacheEntry

# The prefix cache's entries are walked once a second while the engine works, and never for more
# than this share of the time: a walk costs about 0.15 us a block held (14 ms for 93k blocks on
# this project's 2-core CI machine), and the next one then waits 1.4 s.
ENTRIES_PERIOD_S = 1.0
ENTRIES_MAX_TIME_SHARE = 0.01
# How often the tree evicts entries idle past prefix_cache_ttl_s.
IDLE_EVICTION_PERIOD_S = 1.0


class PrefixCacheObserver(StepObserver):
    def __init__(
        self,
        prefix_tree: PrefixTree,
        kv_pool: PagedKVPool,
        kv_manager: KVCacheManager,
        ttl_s: float | None,
        idle: Callable[[], bool],
    ):
        """`idle()`: whether the core has nothing left to step."""
        self.tree = prefix_tree
        self.kv_pool = kv_pool
        self.kv_manager = kv_manager
        self.ttl_s = ttl_s
        self.idle = idle
        self._last_idle_eviction_s = time.perf_counter()
        # Walks of the tree's entries (`entries`): when the last began and how long it took, and
        # whether the tree has been walked since the engine last fell idle.
        self._entries_walked_s = -math.inf
        self._entries_walk_s = 0.0
        self._entries_idle_walked = False

    def on_step(
        self, decision: ScheduleDecision, outputs: list[EngineOutput], started_s: float
    ) -> list[EngineOutput]:
        if started_s - self._last_idle_eviction_s >= IDLE_EVICTION_PERIOD_S:
            self._last_idle_eviction_s = started_s
            self.kv_manager.evict_idle(self.ttl_s)
        return outputs

    def stats(self) -> dict:
        tree = self.tree
        block_bytes = self.kv_pool.shape.bytes_per_block()
        return dict(
            prefix_cache_matches=dict(self.kv_manager.match_counts),
            prefix_cache_blocks=tree.num_blocks,
            prefix_cache_bytes=tree.num_blocks * block_bytes,
            prefix_cache_budget_bytes=(tree.max_blocks or 0) * block_bytes,
            prefix_cache_evicted_blocks=tree.num_evicted_blocks,
            prefix_cache_evicted_bytes=tree.num_evicted_blocks * block_bytes,
            **self.store_stats(),
            **self.entries(),
        )

    def store_stats(self) -> dict:
        """The second tier's counters: int8 (prefix_cache_quantized_*) and host memory
        (kv_host_*); a host tier in int8 counts in both."""
        store, tree = self.kv_pool.store, self.tree
        if store is None:
            return {}
        slot_bytes = self._slot_bytes()
        int8 = isinstance(store, QuantizedKVStore)
        stats = {"prefix_cache_store": " ".join(["host"] * store.on_host + ["int8"] * int8)}
        if int8:
            stats.update(
                prefix_cache_quantized_blocks=tree.num_stored_blocks,
                prefix_cache_quantized_bytes=tree.num_stored_blocks * slot_bytes,
                prefix_cache_quantized_total=tree.num_offloaded_total,
                prefix_cache_restored_total=tree.num_restored_total,
            )
        if store.on_host:
            stats.update(
                kv_host_blocks=tree.num_stored_blocks,
                kv_host_bytes=tree.num_stored_blocks * slot_bytes,
                kv_host_budget_bytes=store.num_slots * slot_bytes,
                kv_host_offloaded_bytes_total=tree.num_offloaded_total * slot_bytes,
                kv_host_restored_bytes_total=tree.num_restored_total * slot_bytes,
                kv_host_dropped_bytes_total=tree.num_dropped_total * slot_bytes,
                kv_host_transfer_time_s_total=self.kv_manager.store_transfer_s,
            )
        return stats

    def _slot_bytes(self) -> int:
        store = self.kv_pool.store
        return type(store).bytes_per_slot(self.kv_pool.shape) if store is not None else 0

    def entries(self) -> dict:
        """The tree's entries when a walk is due, else nothing. A walk is due once a second while
        the engine works, and once when it falls idle (so that the last entries shown are the
        tree as it stays); never sooner after the last one than ENTRIES_MAX_TIME_SHARE allows."""
        now = time.monotonic()  # the tree's clock (PrefixTree's default)
        since = now - self._entries_walked_s
        idle = self.idle()
        if not idle:
            self._entries_idle_walked = False
        due = since >= ENTRIES_PERIOD_S or (idle and not self._entries_idle_walked)
        if not due or since < self._entries_walk_s / ENTRIES_MAX_TIME_SHARE:
            return {}
        entries = self.tree.entries()
        self._entries_walked_s, self._entries_walk_s = now, time.monotonic() - now
        self._entries_idle_walked = idle
        entries.sort(key=lambda entry: entry.last_used_s, reverse=True)
        block_bytes = self.kv_pool.shape.bytes_per_block()
        slot_bytes = self._slot_bytes()
        unix = time.time() - now  # monotonic -> Unix seconds
        return dict(
            prefix_cache_num_entries=len(entries),
            prefix_cache_entries=tuple(
                PrefixCacheEntry(
                    start=entry.start,
                    num_tokens=entry.num_tokens,
                    bytes=entry.num_blocks * block_bytes,
                    stored_bytes=entry.num_stored_blocks * slot_bytes,
                    hits=entry.hits,
                    created_at=unix + entry.created_s,
                    last_used_at=unix + entry.last_used_s,
                    in_use=entry.in_use,
                )
                for entry in entries[:ENTRIES_SENT]
            ),
        )
