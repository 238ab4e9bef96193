"""THE acceptance test of the models package: greedy continuations through our own model code
equal transformers' `generate(do_sample=False)`, token for token, with and without our KV cache.

Two loops drive our model: a plain one that re-runs the whole sequence every step (no cache),
and one that prefills once and then feeds one token at a time through a paged KV cache (an
infer.cache.PagedKVPool, blocks taken from its allocator as the sequence grows), for several
block sizes; "contiguous" is one block holding the whole sequence, the slotted layout.

The cached batches are built by hand from forward_batch.py's layout rules
(`conformance/paged_batches.py`), not by the engine, so these tests check the models' addressing
against the documented contract.
The last test runs one mixed step (a decode, a prompt chunk over a cached prefix and a fresh
prompt in one forward) against each sequence alone and against transformers.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conformance.paged_batches import PagedRow, cached_step_logits, grow, paged_batch, scrambled_pool
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_causal_lm, load_model
from infer.models.random_checkpoint import make_random_checkpoint

MAX_NEW_TOKENS = 20
# Tokens per block of the cached loops; "contiguous": the whole sequence in one block.
BLOCK_SIZES = [1, 4, 16, "contiguous"]


def greedy_without_cache(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    tokens = list(prompt_ids)
    for _ in range(max_new_tokens):
        hidden = model(ForwardBatch.from_tokens([tokens]))
        next_id = int(model.compute_logits(hidden[-1]).argmax(-1))
        tokens.append(next_id)
        if next_id in eos_ids:
            break
    return tokens[len(prompt_ids) :]


def greedy_with_cache(
    model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int], block_size: int | str
) -> list[int]:
    pool = scrambled_pool(model, block_size, len(prompt_ids) + max_new_tokens)
    block_ids: list[int] = []
    step_ids, num_cached, generated = list(prompt_ids), 0, []
    for _ in range(max_new_tokens):
        grow(pool, block_ids, num_cached + len(step_ids), "sequence")
        hidden = model(paged_batch(pool, [PagedRow(block_ids, num_cached, step_ids)]))
        next_id = int(model.compute_logits(hidden[-1]).argmax(-1))
        generated.append(next_id)
        if next_id in eos_ids:
            break
        num_cached, step_ids = num_cached + len(step_ids), [next_id]
    return generated


def transformers_greedy(reference, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    output = reference.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=reference.generation_config.pad_token_id,
    )
    new = output[0, len(prompt_ids) :].tolist()
    eos_ids = _eos_ids(reference)
    # generate pads after an EOS; keep up to and including the first one.
    end = next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))
    return new[:end]


def _eos_ids(reference) -> set[int]:
    eos = reference.generation_config.eos_token_id
    return set(eos) if isinstance(eos, list) else {eos}


class Case:
    """Our model, transformers' model, the prompt, and transformers' greedy answer."""

    def __init__(self, ours, folder, prompt_ids, tokenizer=None):
        self.ours = ours
        self.reference = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.prompt_ids = prompt_ids
        self.tokenizer = tokenizer
        self.eos_ids = _eos_ids(self.reference)
        with torch.no_grad():
            self.expected = transformers_greedy(self.reference, prompt_ids, MAX_NEW_TOKENS)


def _smollm2_chat():
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    assert loaded.chat_template.family == "chatml"
    prompt = loaded.chat_template.render([{"role": "user", "content": "What is the capital of France?"}])
    prompt_ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    return Case(loaded.model, loaded.path, prompt_ids, loaded.tokenizer)


def _gemma3_completion():
    loaded = load_model("gemma-3-270m", dtype=torch.float32)
    prompt_ids = loaded.tokenizer.encode("The capital of France is", add_special_tokens=True)
    return Case(loaded.model, loaded.path, prompt_ids, loaded.tokenizer)


def _tiny(preset, folder):
    make_random_checkpoint(preset, folder, dtype=torch.float32)
    return Case(load_causal_lm(folder, dtype=torch.float32), folder, [5, 91, 200, 17, 300, 42, 7])


@pytest.fixture(
    scope="module",
    params=[
        # The real checkpoints take ~10-30 s each on a CPU core (load both sides, 20 full forwards).
        pytest.param("smollm2-chat", marks=pytest.mark.slow),
        pytest.param("gemma3-270m-completion", marks=pytest.mark.slow),
        "qwen3-tiny",
        # Window 4 < prompt + continuation: the cached path must drop keys that slide out.
        "gemma3-tiny",
    ],
)
def case(request, tmp_path_factory):
    if request.param == "smollm2-chat":
        return _smollm2_chat()
    if request.param == "gemma3-270m-completion":
        return _gemma3_completion()
    return _tiny(request.param, tmp_path_factory.mktemp(request.param))


@torch.no_grad()
def test_plain_loop_equals_transformers_generate(case):
    ours = greedy_without_cache(case.ours, case.prompt_ids, MAX_NEW_TOKENS, case.eos_ids)
    assert ours == case.expected
    if case.tokenizer is not None and case.ours.config.model_type == "llama":
        assert "Paris" in case.tokenizer.decode(ours)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@torch.no_grad()
def test_kv_cache_loop_equals_transformers_generate(case, block_size):
    ours = greedy_with_cache(case.ours, case.prompt_ids, MAX_NEW_TOKENS, case.eos_ids, block_size)
    assert ours == case.expected


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@torch.no_grad()
def test_kv_cache_step_logits_equal_full_forward_logits(case, block_size):
    """Stronger than token equality where a random model repeats itself: every cached decode
    step's logits equal those of one cache-free forward over the same sequence."""
    sequence = case.prompt_ids + case.expected
    model = case.ours
    full = model.compute_logits(model(ForwardBatch.from_tokens([sequence])))
    pool = scrambled_pool(model, block_size, len(sequence))
    block_ids: list[int] = []
    prompt_len = len(case.prompt_ids)
    steps = [(0, case.prompt_ids)] + [(p, [sequence[p]]) for p in range(prompt_len, len(sequence))]
    for start, step_ids in steps:
        grow(pool, block_ids, start + len(step_ids), "sequence")
        logits = model.compute_logits(model(paged_batch(pool, [PagedRow(block_ids, start, step_ids)])))
        torch.testing.assert_close(logits, full[start : start + len(step_ids)], atol=1e-4, rtol=1e-4)


# The mixed step: (tokens already cached, tokens this step) per sequence, decode row first. Against
# the tiny Gemma's window of 4, the chunk's window reaches back into its cached prefix and its 6
# tokens cross it; the fresh prompt is longer than the window too.
MIXED_STEP = {"decode": (9, 1), "prompt chunk": (6, 6), "fresh prompt": (0, 7)}


@pytest.fixture(scope="module", params=["llama-tiny", "qwen3-tiny", "gemma3-tiny"])
def tiny_pair(request, tmp_path_factory):
    """(ours, transformers) for one tiny random checkpoint, both fp32."""
    folder = make_random_checkpoint(
        request.param, tmp_path_factory.mktemp(request.param), dtype=torch.float32
    )
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return load_causal_lm(folder, dtype=torch.float32), reference.eval()


def _mixed_step_sequences(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = [cached + new for cached, new in MIXED_STEP.values()]
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@torch.no_grad()
def test_mixed_step_logits_equal_each_sequence_alone(tiny_pair, block_size):
    """A decode, a prompt chunk over a cached prefix and a fresh prompt in one forward give each
    row the logits its sequence gets when it runs alone (its own pool, prefix, then its step)."""
    ours, _ = tiny_pair
    sequences = _mixed_step_sequences(ours.config.vocab_size)
    num_cached = [cached for cached, _ in MIXED_STEP.values()]
    mixed = cached_step_logits(ours, sequences, num_cached, block_size)
    for name, sequence, cached, got in zip(MIXED_STEP, sequences, num_cached, mixed, strict=True):
        [alone] = cached_step_logits(ours, [sequence], [cached], block_size)
        torch.testing.assert_close(
            got, alone, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name} row: {m}"
        )


@torch.no_grad()
def test_mixed_step_logits_equal_transformers_on_each_full_sequence(tiny_pair):
    ours, reference = tiny_pair
    sequences = _mixed_step_sequences(ours.config.vocab_size)
    num_cached = [cached for cached, _ in MIXED_STEP.values()]
    mixed = cached_step_logits(ours, sequences, num_cached, block_size=4)
    for name, sequence, cached, got in zip(MIXED_STEP, sequences, num_cached, mixed, strict=True):
        expected = reference(torch.tensor([sequence])).logits[0, cached:]
        torch.testing.assert_close(
            got, expected, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name} row: {m}"
        )
