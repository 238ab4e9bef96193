"""Settings that steer greedy decoding, on a real server through the official `openai` client:
the presence, frequency and repetition penalties, and `min_tokens` holding the end of sequence
back.

Oracle: transformers' model on the same folder, run over prompt + generated tokens at each step,
its last logits adjusted in plain PyTorch by the setting's published definition, then argmax.
OpenAI's presence and frequency penalties count the generated tokens only; the repetition penalty
(CTRL's, as transformers and vLLM apply it) every token of prompt and answer. logit_bias,
stop_token_ids and min_tokens before a stop token are checked in test_app_openai_inputs.py.
"""

import pytest
import torch

# Greedy SmolLM2 goes on with a loop of four tokens here: every penalty has repeats to bite on.
PROMPT = "one one one one one one one one"
NUM_TOKENS = 12


def reference_greedy(model, prompt_ids: list[int], num_tokens: int, adjust=None, end_ids=()) -> list[int]:
    """transformers' greedy tokens (up to the first of `end_ids`, included), each step's logits
    first passed through `adjust(logits, prompt_ids, generated)` when given."""
    generated: list[int] = []
    with torch.inference_mode():
        step = model(torch.tensor([prompt_ids]), use_cache=True)
        while len(generated) < num_tokens:
            logits = step.logits[0, -1].double()
            if adjust is not None:
                logits = adjust(logits, prompt_ids, generated)
            generated.append(int(logits.argmax()))
            if generated[-1] in end_ids:
                break
            step = model(torch.tensor([generated[-1:]]), past_key_values=step.past_key_values, use_cache=True)
    return generated


@pytest.fixture(scope="module")
def prompt_ids(smollm2_loaded) -> list[int]:
    return smollm2_loaded.tokenizer.encode(PROMPT, add_special_tokens=True)


@pytest.fixture(scope="module")
def unsteered(smollm2_transformers, prompt_ids) -> list[int]:
    """The greedy answer to PROMPT with no setting."""
    return reference_greedy(smollm2_transformers, prompt_ids, NUM_TOKENS)


def openai_penalties(presence: float, frequency: float):
    """logit - frequency x count - presence x (count > 0), count over the generated tokens."""

    def adjust(logits, prompt_ids, generated):
        for token_id in set(generated):
            logits[token_id] -= frequency * generated.count(token_id) + presence
        return logits

    return adjust


def repetition_penalty(penalty: float):
    """Every token seen in prompt or answer: a positive logit / penalty, a negative one x penalty."""

    def adjust(logits, prompt_ids, generated):
        for token_id in set(prompt_ids + generated):
            logit = logits[token_id]
            logits[token_id] = logit / penalty if logit > 0 else logit * penalty
        return logits

    return adjust


@pytest.mark.parametrize(
    ("settings", "adjust"),
    [
        ({"frequency_penalty": 1.5}, openai_penalties(presence=0.0, frequency=1.5)),
        ({"presence_penalty": 1.5}, openai_penalties(presence=1.5, frequency=0.0)),
        # Opposite signs: presence and frequency swapped would steer elsewhere.
        (
            {"presence_penalty": -1.0, "frequency_penalty": 1.0},
            openai_penalties(presence=-1.0, frequency=1.0),
        ),
        ({"extra_body": {"repetition_penalty": 1.3}}, repetition_penalty(1.3)),
    ],
    ids=["frequency", "presence", "presence-and-frequency", "repetition"],
)
def test_a_penalty_steers_greedy_as_its_definition_does(
    server, smollm2_transformers, prompt_ids, unsteered, settings, adjust
):
    extra_body = {"ignore_eos": True, **settings.pop("extra_body", {})}
    answer = server.openai_client().completions.create(
        model=server.model,
        prompt=prompt_ids,
        max_tokens=NUM_TOKENS,
        temperature=0,
        extra_body=extra_body,
        **settings,
    )
    expected = reference_greedy(smollm2_transformers, prompt_ids, NUM_TOKENS, adjust)
    assert answer.choices[0].token_ids == expected
    # The setting changes this answer, so the check tells it from no setting at all.
    assert expected != unsteered


def test_min_tokens_holds_the_end_of_sequence_back_as_greedy_with_it_masked(
    server, smollm2_transformers, smollm2_loaded
):
    """The question's greedy answer ends (EOS) after a few tokens; with min_tokens beyond that the
    answer is transformers' greedy with the EOS ids masked until min_tokens are out, then ends at
    the first EOS."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    client = server.openai_client()
    settings = dict(model=server.model, messages=messages, max_tokens=32, temperature=0)
    natural = client.chat.completions.create(**settings).choices[0]
    assert natural.finish_reason == "stop"
    min_tokens = len(natural.token_ids) + 4
    held = client.chat.completions.create(**settings, extra_body={"min_tokens": min_tokens}).choices[0]

    # The checkpoint's own end of sequence and the end-of-turn token the answer ended with.
    eos_ids = [natural.token_ids[-1], smollm2_transformers.generation_config.eos_token_id]
    prompt = smollm2_loaded.chat_template.render(messages, add_generation_prompt=True)
    prompt_ids = smollm2_loaded.tokenizer.encode(prompt, add_special_tokens=False)

    def mask_eos(logits, prompt_ids, generated):
        if len(generated) < min_tokens:
            logits[eos_ids] = -torch.inf
        return logits

    expected = reference_greedy(smollm2_transformers, prompt_ids, 32, mask_eos, end_ids=eos_ids)
    assert held.token_ids == expected
    assert len(held.token_ids) >= min_tokens
