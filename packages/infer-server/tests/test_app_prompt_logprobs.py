"""The prompt's logprobs on a real server, through the real `openai` client: completions' `echo`
with `logprobs` (OpenAI's legacy format over prompt then completion; `max_tokens: 0` is
lm-eval's loglikelihood request) and vLLM's `prompt_logprobs` on completions (per choice) and
chat (on the response).

Oracle: transformers' model on the same folder, run once over the prompt; prompt token p's
logprob is that forward's log-softmax at position p - 1, its rank 1 + the tokens above it.
"""

import openai
import pytest
import torch

LOGPROB_ATOL = 1e-3
PROMPT = "The three largest cities of France are"
QUESTION = [{"role": "user", "content": "Name three colours."}]


def prompt_logprobs(reference, prompt_ids: list[int]) -> torch.Tensor:
    """[len(prompt_ids) - 1, vocab]: the log-softmax at the positions that predict tokens 1.."""
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt_ids])).logits[0]
    return logits[:-1].double().log_softmax(dim=-1)


def complete(server, **fields):
    fields = {"max_tokens": 8, "temperature": 0, **fields}
    return server.openai_client().completions.create(model=server.model, prompt=PROMPT, **fields)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_loaded) -> list[int]:
    return smollm2_loaded.tokenizer.encode(PROMPT, add_special_tokens=True)


def test_echo_with_logprobs_and_no_tokens_answers_the_prompts_logprobs(
    server, smollm2_transformers, smollm2_loaded, prompt_ids
):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0."""
    answer = complete(server, echo=True, logprobs=2, max_tokens=0)
    choice, decode = answer.choices[0], smollm2_loaded.tokenizer.decode
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(prompt_ids)
    logprobs = choice.logprobs
    assert logprobs.tokens == [decode([token_id]) for token_id in prompt_ids]
    assert "".join(logprobs.tokens) == PROMPT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = prompt_logprobs(smollm2_transformers, prompt_ids)
    for position, token_id in enumerate(prompt_ids[1:]):
        row = expected[position]
        assert logprobs.token_logprobs[position + 1] == pytest.approx(float(row[token_id]), abs=LOGPROB_ATOL)
        # The two most likely tokens there and the prompt's own.
        top = row.topk(2)
        alternatives = logprobs.top_logprobs[position + 1]
        assert set(alternatives) == {decode([i]) for i in top.indices.tolist()} | {decode([token_id])}
        assert alternatives[decode([top.indices[0]])] == pytest.approx(float(top.values[0]), abs=LOGPROB_ATOL)
    offsets = [sum(len(token) for token in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == offsets


def test_a_batch_of_token_id_prompts_scores_each_choice_against_its_own_prompt(
    server, smollm2_transformers, prompt_ids
):
    """lm-eval sends its loglikelihood requests as a batch of token-id prompts."""
    prompts = [prompt_ids, prompt_ids[:4] + [28, 2564]]
    answer = server.openai_client().completions.create(
        model=server.model, prompt=prompts, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    assert answer.usage.prompt_tokens == sum(len(prompt) for prompt in prompts)
    for prompt, choice in zip(prompts, answer.choices, strict=True):
        expected = prompt_logprobs(smollm2_transformers, prompt).gather(1, torch.tensor(prompt[1:])[:, None])
        assert len(choice.logprobs.tokens) == len(prompt)
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            expected.squeeze(1).tolist(), abs=LOGPROB_ATOL
        )


def test_echo_with_logprobs_covers_the_prompt_then_the_completion(server, prompt_ids):
    plain = complete(server, logprobs=1).choices[0]
    echoed = complete(server, echo=True, logprobs=1).choices[0]
    assert echoed.text == PROMPT + plain.text
    logprobs = echoed.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + len(plain.logprobs.tokens)
    assert logprobs.tokens[len(prompt_ids) :] == plain.logprobs.tokens
    assert logprobs.token_logprobs[len(prompt_ids) :] == pytest.approx(
        plain.logprobs.token_logprobs, abs=LOGPROB_ATOL
    )
    # The completion's offsets run on from the prompt's text.
    assert logprobs.text_offset[len(prompt_ids)] == len("".join(logprobs.tokens[: len(prompt_ids)]))
    assert "".join(logprobs.tokens) == echoed.text


def test_prompt_logprobs_on_completions_give_each_choice_vllms_shape(
    server, smollm2_transformers, smollm2_loaded, prompt_ids
):
    answer = complete(server, n=2, temperature=1.0, seed=3, extra_body={"prompt_logprobs": 3})
    expected = prompt_logprobs(smollm2_transformers, prompt_ids)
    decode = smollm2_loaded.tokenizer.decode
    for choice in answer.choices:
        entries = choice.model_extra["prompt_logprobs"]
        assert len(entries) == len(prompt_ids) and entries[0] is None
        for position, (token_id, entry) in enumerate(zip(prompt_ids[1:], entries[1:], strict=True)):
            row = expected[position]
            own = entry[str(token_id)]
            assert own["logprob"] == pytest.approx(float(row[token_id]), abs=LOGPROB_ATOL)
            assert own["rank"] == 1 + int((row > row[token_id]).sum())
            assert own["decoded_token"] == decode([token_id])
            top = row.topk(3)
            ranked = {int(token): value["rank"] for token, value in entry.items() if value["rank"] <= 3}
            assert ranked == {i: rank for rank, i in enumerate(top.indices.tolist(), 1)}
            assert len(entry) in (3, 4)  # the top 3, and the prompt's token when not one of them
    # The completion is what it is without them.
    assert choice.logprobs is None


def test_prompt_logprobs_on_chat_are_on_the_response(server, smollm2_transformers, smollm2_loaded):
    prompt = smollm2_loaded.chat_template.render(QUESTION, add_generation_prompt=True)
    chat_ids = smollm2_loaded.tokenizer.encode(prompt, add_special_tokens=False)
    answer = server.openai_client().chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    entries = answer.model_extra["prompt_logprobs"]
    assert len(entries) == len(chat_ids) and entries[0] is None
    expected = prompt_logprobs(smollm2_transformers, chat_ids)
    values = [
        entry[str(token_id)]["logprob"] for token_id, entry in zip(chat_ids[1:], entries[1:], strict=True)
    ]
    assert values == pytest.approx(
        expected.gather(1, torch.tensor(chat_ids[1:])[:, None]).squeeze(1).tolist(), abs=LOGPROB_ATOL
    )
    plain = server.openai_client().chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=2, temperature=0
    )
    assert "prompt_logprobs" not in (plain.model_extra or {})
    assert plain.choices[0].message.content == answer.choices[0].message.content


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("completions", {"echo": True, "logprobs": 1, "stream": True}, "logprobs"),
        ("completions", {"extra_body": {"prompt_logprobs": 1}, "stream": True}, "prompt_logprobs"),
        ("chat", {"extra_body": {"prompt_logprobs": 1}, "stream": True}, "prompt_logprobs"),
        ("completions", {"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("completions", {"max_tokens": 0, "echo": True, "stream": True}, "max_tokens"),
    ],
    ids=[
        "echo-logprobs-streamed",
        "streamed",
        "chat-streamed",
        "above-20",
        "no-tokens-no-echo",
        "no-tokens-streamed",
    ],
)
def test_prompt_logprobs_we_do_not_give_answer_400_naming_the_field(server, endpoint, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        if endpoint == "chat":
            server.openai_client().chat.completions.create(model=server.model, messages=QUESTION, **fields)
        else:
            complete(server, **fields)
    assert raised.value.body["param"] == param
