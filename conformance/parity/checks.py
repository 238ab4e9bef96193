"""Checks for specs/parity: our model against transformers on the same checkpoint.

The oracle is transformers itself, loaded with eager attention in the case's dtype and device.
A case names a real checkpoint (`model`: an alias for fetch_model) or a random one (`preset`:
written once per session into a temporary folder). Bounds: tolerances.yaml by dtype, overridden
by any bound the case names.
"""

import atexit
import collections
import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from conformance.paged_batches import cached_step_logits
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_causal_lm
from infer.models.loader.fetch import fetch_model
from infer.models.random_checkpoint import make_random_checkpoint

TOLERANCES_FILE = Path(__file__).resolve().parents[2] / "specs" / "parity" / "tolerances.yaml"
BOUND_KEYS = ("max_abs", "mean_abs", "top1_agreement", "greedy_steps", "greedy_tie")
DTYPES = ("float32", "float16", "bfloat16")


def tolerance_table(case: dict, impl: str | None) -> None:
    table = tolerances_by_dtype()
    for dtype in DTYPES:
        assert set(table.get(dtype, {})) == set(BOUND_KEYS), f"{dtype} must set exactly {BOUND_KEYS}"
    for dtype in ("float16", "bfloat16"):
        looser = table[dtype]
        assert looser["max_abs"] >= table["float32"]["max_abs"], f"{dtype} max_abs tighter than fp32"
        assert looser["mean_abs"] >= table["float32"]["mean_abs"], f"{dtype} mean_abs tighter than fp32"
        assert looser["top1_agreement"] <= table["float32"]["top1_agreement"], (
            f"{dtype} top1 stricter than fp32"
        )
        assert looser["greedy_tie"] >= table["float32"]["greedy_tie"], f"{dtype} greedy_tie tighter than fp32"


def full_logits(case: dict, impl: str | None) -> None:
    """Every prompt's logits at every position: max/mean |difference| and top-1 agreement."""
    bounds = _bounds(case)
    ours, reference, tokenizer = _pair(_checkpoint(case), case["dtype"], _device(case))
    stats = LogitGaps()
    with torch.no_grad():
        for prompt in case["prompts"]:
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(_device(case))
            expected = reference(ids).logits[0].float()
            # One row of len(prompt) tokens: [T, vocab], as transformers' [1, T, vocab] batch of one.
            got = ours.compute_logits(ours(ForwardBatch.from_tokens(ids.tolist(), device=ids.device)))
            stats.add(got, expected)
    stats.assert_within(bounds, "")


def greedy_prefix(case: dict, impl: str | None) -> None:
    """Our plain (cache-free) greedy loop equals transformers' generate on the first greedy_steps
    tokens, both stopping after the first EOS of the checkpoint's generation config.

    Where the two first differ, transformers' own logits of the two chosen tokens must be within
    greedy_tie of each other (a tie that rounding may break either way); the comparison ends
    there, since the sequences legitimately diverge after a tie."""
    bounds = _bounds(case)
    ours, reference, tokenizer = _pair(_checkpoint(case), case["dtype"], _device(case))
    steps = min(bounds["greedy_steps"], case["max_new_tokens"])
    eos = reference.generation_config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    for prompt in case["prompts"]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(_device(case))
        with torch.no_grad():
            generated = reference.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=steps,
                pad_token_id=reference.generation_config.pad_token_id,
            )[0, ids.shape[1] :].tolist()  # fmt: skip
            tokens = ids[0].tolist()
            for _ in range(steps):
                hidden = ours(ForwardBatch.from_tokens([tokens], device=ids.device))
                tokens.append(int(ours.compute_logits(hidden[-1]).argmax(-1)))
                if tokens[-1] in eos_ids:
                    break
        expected = generated[: next((i + 1 for i, t in enumerate(generated) if t in eos_ids), len(generated))]
        got = tokens[ids.shape[1] :]
        if got == expected:
            continue
        first = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
            min(len(got), len(expected)),
        )
        assert first < min(len(got), len(expected)), (
            f"prompt {prompt!r}: ours {got} vs transformers {expected}: one stopped early"
        )
        prefix = torch.tensor([ids[0].tolist() + expected[:first]], device=ids.device)
        with torch.no_grad():
            logits = reference(prefix).logits[0, -1].float()
        gap = (logits[expected[first]] - logits[got[first]]).item()
        assert gap <= bounds["greedy_tie"], (
            f"prompt {prompt!r}: ours {got} vs transformers {expected} ({steps} greedy steps): at step "
            f"{first} transformers' logits of the two tokens differ by {gap:.3f}, more than the "
            f"greedy_tie bound {bounds['greedy_tie']}"
        )


def mixed_step(case: dict, impl: str | None) -> None:
    """One step holding a decode, a prompt chunk over a cached prefix and a fresh prompt, in one
    forward over one paged KV pool, gives each row the logits of its sequence run alone, and
    transformers' logits on the full sequence: max/mean |difference| and top-1 agreement.

    The case's prompts, tokenized, are the sequences: the first decodes its last token over the
    rest, the second runs its second half over its first, the third is fresh. Blocks of
    `block_size` tokens come from the pool's allocator out of order, between blocks another owner
    holds, and every block starts out holding garbage, so a read of a slot the row does not own
    shows in its logits."""
    _one_step_against_alone(case, lambda sequences: [len(sequences[0]) - 1, len(sequences[1]) // 2, 0])


def decode_step(case: dict, impl: str | None) -> None:
    """One step of decode rows only (each prompt's last token over the rest, cached) over one
    paged KV pool gives each row the logits of its sequence run alone and transformers' at that
    position, as mixed_step judges them. On a CPU this is the step that runs every block in one C
    call (infer.kernels.DecoderStackCpu), where the C kernels build."""
    _one_step_against_alone(case, lambda sequences: [len(sequence) - 1 for sequence in sequences])


def _one_step_against_alone(case: dict, num_cached_of) -> None:
    """The case's three prompts in one step over one pool, `num_cached_of(sequences)` of each
    cached before it: each row against its sequence alone, and against transformers."""
    bounds = _bounds(case)
    device = _device(case)
    ours, reference, tokenizer = _pair(_checkpoint(case), case["dtype"], device)
    sequences = [tokenizer(prompt).input_ids for prompt in case["prompts"][:3]]
    num_cached = num_cached_of(sequences)
    assert min(len(s) - c for s, c in zip(sequences, num_cached, strict=True)) >= 1 and len(sequences) == 3, (
        f"a step needs 3 prompts of 2+ tokens, got lengths {[len(s) for s in sequences]}"
    )
    stats = LogitGaps()
    with torch.no_grad():
        step = cached_step_logits(ours, sequences, num_cached, case["block_size"])
        for sequence, cached, got in zip(sequences, num_cached, step, strict=True):
            [alone] = cached_step_logits(ours, [sequence], [cached], case["block_size"])
            gap = (got - alone).abs().max().item()
            assert gap <= bounds["max_abs"], (
                f"sequence of {len(sequence)} tokens, {cached} cached: the step's logits differ from "
                f"the sequence's alone by {gap:.3g}, above max_abs {bounds['max_abs']}"
            )
            expected = reference(torch.tensor([sequence], device=device)).logits[0, cached:].float()
            stats.add(got, expected)
    stats.assert_within(bounds, "against transformers: ")


class LogitGaps:
    """Our logits against transformers' over many positions: max and mean |difference| and
    top-1 agreement, judged against a tolerance row of specs/parity/tolerances.yaml."""

    def __init__(self):
        self.max_abs, self.abs_sum, self.count, self.agree, self.positions = 0.0, 0.0, 0, 0, 0

    def add(self, got: torch.Tensor, expected: torch.Tensor) -> None:
        """`got` and `expected`: [positions, vocab] float logits of the same tokens."""
        delta = (got - expected).abs()
        self.max_abs = max(self.max_abs, delta.max().item())
        self.abs_sum, self.count = self.abs_sum + delta.sum().item(), self.count + delta.numel()
        self.agree += (got.argmax(-1) == expected.argmax(-1)).sum().item()
        self.positions += got.shape[0]

    def assert_within(self, bounds: dict, label: str) -> None:
        mean_abs, top1 = self.abs_sum / self.count, self.agree / self.positions
        summary = (
            f"{label}max_abs {self.max_abs:.3g}, mean_abs {mean_abs:.3g}, top-1 {top1:.3f} "
            f"over {self.positions} positions"
        )
        assert self.max_abs <= bounds["max_abs"], f"{summary}: max_abs above {bounds['max_abs']}"
        assert mean_abs <= bounds["mean_abs"], f"{summary}: mean_abs above {bounds['mean_abs']}"
        assert top1 >= bounds["top1_agreement"], (
            f"{summary}: top-1 agreement below {bounds['top1_agreement']}"
        )


def tolerances_by_dtype() -> dict:
    return yaml.safe_load(TOLERANCES_FILE.read_text())["defaults"]["tolerances"]


def _bounds(case: dict) -> dict:
    return {**tolerances_by_dtype()[case["dtype"]], **{k: case[k] for k in BOUND_KEYS if k in case}}


def _device(case: dict) -> str:
    if case["device"] == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return case["device"]


def _checkpoint(case: dict) -> Path:
    if "preset" in case:
        # Random weights are stored in the dtype under test, as a released checkpoint would be.
        return _random_checkpoint(case["preset"], case["dtype"])
    return fetch_model(case["model"])


# Random checkpoints written by this process, most recently used last; past _KEPT_CHECKPOINTS the
# oldest is deleted. Real shapes take gigabytes each, and every pytest-xdist worker writes its own:
# kept for the whole run they filled the 64 GiB disk of the GPU machine. A clause walks its cases
# checkpoint by checkpoint, so two cover a clause's case and the next.
_KEPT_CHECKPOINTS = 2
_checkpoints: collections.OrderedDict[tuple[str, str], Path] = collections.OrderedDict()


def _random_checkpoint(preset: str, dtype: str) -> Path:
    key = (preset, dtype)
    if key in _checkpoints:
        _checkpoints.move_to_end(key)
        return _checkpoints[key]
    folder = Path(tempfile.mkdtemp(prefix=f"parity-{preset}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    _checkpoints[key] = make_random_checkpoint(preset, folder, dtype=getattr(torch, dtype))
    while len(_checkpoints) > _KEPT_CHECKPOINTS:
        _, oldest = _checkpoints.popitem(last=False)
        shutil.rmtree(oldest, ignore_errors=True)
    return _checkpoints[key]


# Two pairs at most in memory: each clause walks its cases model by model.
@functools.lru_cache(maxsize=2)
def _pair(folder: Path, dtype: str, device: str):
    """(ours, transformers' model, transformers' tokenizer) for one checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    ours = load_causal_lm(folder, dtype=torch_dtype, device=device)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, attn_implementation="eager")
    return ours, reference.to(device).eval(), AutoTokenizer.from_pretrained(folder)


# PAR-023/024's check, in a module of its own (it reads this one's helpers).
from conformance.parity.fp8_kv import fp8_kv_cache  # noqa: E402, F401
