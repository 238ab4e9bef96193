"""THE acceptance test of the models package: greedy continuations through our own model code
equal transformers' `generate(do_sample=False)`, token for token, with and without our KV cache.

Two loops drive our model: a plain one that re-runs the whole sequence every step (no cache),
and one that prefills once and then feeds one token at a time through ForwardBatch.kv_layers
backed by infer.cache.ContiguousKVCache.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from infer.cache import ContiguousKVCache, KVCacheShape
from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_causal_lm, load_model
from infer.models.random_checkpoint import make_random_checkpoint

MAX_NEW_TOKENS = 20


def greedy_without_cache(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    tokens = list(prompt_ids)
    for _ in range(max_new_tokens):
        hidden = model(ForwardBatch.from_tokens([tokens]))
        next_id = int(model.compute_logits(hidden[:, -1]).argmax(-1))
        tokens.append(next_id)
        if next_id in eos_ids:
            break
    return tokens[len(prompt_ids) :]


def greedy_with_cache(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    config = model.config
    shape = KVCacheShape(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_seq_len=len(prompt_ids) + max_new_tokens,
        dtype=model.embed_tokens.weight.dtype,
    )
    cache = ContiguousKVCache(shape, num_slots=1)
    step_ids, start, generated = list(prompt_ids), 0, []
    for _ in range(max_new_tokens):
        positions = torch.arange(start, start + len(step_ids))[None]
        batch = ForwardBatch(
            input_ids=torch.tensor([step_ids]),
            positions=positions,
            kv_layers=cache.kv_layers,
            context_len=start + len(step_ids),
        )
        next_id = int(model.compute_logits(model(batch)[:, -1]).argmax(-1))
        generated.append(next_id)
        if next_id in eos_ids:
            break
        start, step_ids = start + len(step_ids), [next_id]
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


@torch.no_grad()
def test_kv_cache_loop_equals_transformers_generate(case):
    ours = greedy_with_cache(case.ours, case.prompt_ids, MAX_NEW_TOKENS, case.eos_ids)
    assert ours == case.expected


@torch.no_grad()
def test_kv_cache_step_logits_equal_full_forward_logits(case):
    """Stronger than token equality where a random model repeats itself: every cached decode
    step's logits equal those of one cache-free forward over the same sequence."""
    sequence = case.prompt_ids + case.expected
    model, config = case.ours, case.ours.config
    full = model.compute_logits(model(ForwardBatch.from_tokens([sequence])))[0]
    dims = (config.num_layers, config.num_kv_heads, config.head_dim, len(sequence))
    shape = KVCacheShape(*dims, torch.float32)
    cache = ContiguousKVCache(shape, num_slots=1)
    prompt_len = len(case.prompt_ids)
    steps = [(0, case.prompt_ids)] + [(p, [sequence[p]]) for p in range(prompt_len, len(sequence))]
    for start, step_ids in steps:
        batch = ForwardBatch(
            input_ids=torch.tensor([step_ids]),
            positions=torch.arange(start, start + len(step_ids))[None],
            kv_layers=cache.kv_layers,
            context_len=start + len(step_ids),
        )
        logits = model.compute_logits(model(batch))[0]
        torch.testing.assert_close(logits, full[start : start + len(step_ids)], atol=1e-4, rtol=1e-4)
