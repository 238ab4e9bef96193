"""move_to_huge_pages against two oracles: the model before the move (the same logits, bit for
bit; a tied embedding and LM head still one tensor) and the kernel's own account of the process's
memory, /proc/self/smaps, whose VmFlags carry "hg" for a mapping advised MADV_HUGEPAGE."""

import pytest
import torch

from conformance.memory_maps import advised_huge
from infer.models.forward_batch import ForwardBatch
from infer.models.huge_pages import huge_pages_unavailable, move_to_huge_pages
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint

pytestmark = pytest.mark.skipif(huge_pages_unavailable() is not None, reason=str(huge_pages_unavailable()))


def tensors(model) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny"])
def test_a_moved_model_computes_what_it_did(tmp_path, preset):
    """llama-tiny's head is its own, qwen3-tiny's is tied to the embedding."""
    model = load_model(make_random_checkpoint(preset, tmp_path, dtype=torch.float32)).model
    batch = ForwardBatch.from_tokens([[1, 5, 9, 200, 3]])
    before = model.compute_logits(model(batch))
    tied = model.lm_head.weight is model.embed_tokens.weight
    addresses = {t.data_ptr() for t in tensors(model)}
    moved = move_to_huge_pages(model)
    assert moved >= sum(t.numel() * t.element_size() for t in tensors(model)) > 0
    # Not "advised nowhere before": in CI's long-lived workers some fresh tensors already lay in an
    # advised mapping (why is not known). So: every tensor now lies elsewhere, in a mapping advised
    # so, in a storage of its own bytes.
    assert not addresses & {t.data_ptr() for t in tensors(model)}
    assert all(advised_huge(t.data_ptr()) for t in tensors(model))
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors(model))
    assert (model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()) == tied
    assert torch.equal(model.compute_logits(model(batch)), before)


def test_moving_again_moves_nothing(tmp_path):
    """A model that a second engine is built over stays where the first put it."""
    model = load_model(make_random_checkpoint("llama-tiny", tmp_path, dtype=torch.float32)).model
    move_to_huge_pages(model)
    addresses = [t.data_ptr() for t in tensors(model)]
    assert move_to_huge_pages(model) == 0
    assert [t.data_ptr() for t in tensors(model)] == addresses
