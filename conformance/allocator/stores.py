"""ALLOC-017: a PagedKVPool with a store (the second tier the prefix tree offloads into) moves
blocks in and out of it as a model of their contents says, whatever the order of operations.

A hypothesis state machine writes random K/V into blocks (a new owner's forward), and sends
random lists of COPY, OFFLOAD and RESTORE operations through `run_block_ops`, each list run as
one step's. The model is a dict of what every block and slot should hold, updated one operation
at a time (so a slot or block that one operation frees and a later one takes again is
modelled as the step must run it). After each list, every block and slot the model knows equals
it: bit for bit for a store in the pool's dtype (host memory: a block is its bytes, every
layer's K and V and an fp8 pool's scales), and within the int8 bound for a QuantizedKVStore (a
restored element within 1% of its group's largest magnitude).
"""

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conformance.state_machines import run_machine
from infer.cache import (
    COPY,
    OFFLOAD,
    RESTORE,
    BlockOp,
    HostKVStore,
    KVCacheShape,
    PagedKVPool,
    QuantizedKVStore,
)
from infer.cache.kv_quant import group_size_for

SHAPE = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, block_size=4)
FP8_SHAPE = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float8_e4m3fn, block_size=4)
STORES = {
    "host": (SHAPE, HostKVStore),
    "host-fp8": (FP8_SHAPE, HostKVStore),
    "int8": (SHAPE, QuantizedKVStore),
}


def store_round_trips(case: dict, impl: str | None) -> None:
    run_machine(_machine(case), case)


def _machine(case: dict) -> type:
    num_blocks, num_slots = case["num_blocks"], case["num_slots"]
    shape, store = STORES[case["store"]]
    device = case.get("device", "cpu")
    exact = store is HostKVStore

    class StoreMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            if device == "cuda":  # pinned host memory: the copies run on the store's own streams
                self.pool = PagedKVPool(
                    shape, num_blocks, device, store=store(shape, num_slots, pin_memory=True)
                )
            else:
                self.pool = PagedKVPool(shape, num_blocks, store=store(shape, num_slots))
            self.generator = torch.Generator().manual_seed(0)
            # What each block and slot holds: a block's bytes (exact stores), or its values
            # [num_layers, 2, block_size, heads, head_dim] (int8).
            self.blocks: dict[int, torch.Tensor] = {}
            self.slots: dict[int, torch.Tensor] = {}

        def block(self, block: int) -> torch.Tensor:
            if exact:
                return torch.cat([t.view(torch.uint8)[block].flatten() for t in self.tensors()]).cpu()
            return torch.stack([torch.stack((k[block], v[block])) for k, v in self.pool.kv_layers])

        def tensors(self) -> list[torch.Tensor]:
            return [t for layer in self.pool.layer_tensors for t in layer]

        @rule(block=st.integers(0, num_blocks - 1))
        def write(self, block):
            """A new owner's forward writes the block (random bytes, or random values for int8)."""
            if exact:
                for t in self.tensors():
                    target = t.view(torch.uint8)[block]
                    target.copy_(
                        torch.randint(0, 256, target.shape, generator=self.generator, dtype=torch.uint8)
                    )
                self.blocks[block] = self.block(block)
                return
            values = torch.randn(self.block(block).shape, generator=self.generator).to(shape.dtype)
            for layer, (k, v) in enumerate(self.pool.kv_layers):
                k[block], v[block] = values[layer, 0], values[layer, 1]
            self.blocks[block] = values

        @rule(
            ops=st.lists(
                st.tuples(
                    st.sampled_from([COPY, OFFLOAD, RESTORE]),
                    st.integers(0, max(num_blocks, num_slots) - 1),
                    st.integers(0, max(num_blocks, num_slots) - 1),
                ),
                min_size=1,
                max_size=6,
            )
        )
        def step(self, ops):
            """One step's operations; each reads what the model holds and writes what it read (a
            COPY's source and target differ, as the manager's do)."""
            runnable = []
            for kind, source, target in ops:
                sources, targets = (self.slots, self.blocks) if kind == RESTORE else (self.blocks, None)
                limit_source = num_slots if kind == RESTORE else num_blocks
                limit_target = num_slots if kind == OFFLOAD else num_blocks
                if source >= limit_source or target >= limit_target or source not in sources:
                    continue
                if kind == COPY and source == target:
                    continue
                runnable.append(BlockOp(kind, source, target))
                value = sources[source]
                (self.slots if kind == OFFLOAD else self.blocks)[target] = value
            if runnable:
                self.pool.run_block_ops(runnable)
                if not exact:  # int8: what came back is the model from here on, once within the bound
                    self.check()
                    for block in {op.target for op in runnable if op.kind != OFFLOAD}:
                        self.blocks[block] = self.block(block)

        @invariant()
        def check(self):
            for block, want in self.blocks.items():
                got = self.block(block)
                if exact:
                    assert torch.equal(got, want), f"block {block} is not what the operations left in it"
                else:
                    bound = _int8_bound(want)
                    assert ((got.float() - want.float()).abs() <= bound).all(), (
                        f"block {block} is off by more than the int8 bound"
                    )
            if exact:
                self.pool.store.synchronize()  # a host reader waits for the copies in flight
                for slot, want in self.slots.items():
                    got = self.pool.store.slots[slot]
                    assert torch.equal(got, want), f"slot {slot} is not the block offloaded into it"

    return StoreMachine


def _int8_bound(values: torch.Tensor) -> torch.Tensor:
    """1% of each group's largest magnitude (kv_quant's bound), per element."""
    group = group_size_for(SHAPE.head_dim)
    groups = values.float().unflatten(-1, (-1, group))
    return (0.01 * groups.abs().amax(-1, keepdim=True)).expand_as(groups).flatten(-2) + 1e-6
