"""Logprobs on a real server, through the real `openai` client: chat's `logprobs` /
`top_logprobs` (choices[].logprobs.content) and completions' `logprobs` (OpenAI's legacy
tokens / token_logprobs / top_logprobs / text_offset), streamed and not.

Oracle: transformers' model on the same folder, run once over prompt + generated tokens; each
generated token's logprob and its top-k must be that forward's log-softmax at its position.
"""

import openai
import pytest
import torch

# float32 on CPU: our kernels and transformers' eager attention agree to about 1e-5 in logits.
LOGPROB_ATOL = 1e-3
QUESTION = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The three largest cities of France are"


def expected_logprobs(reference, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab]: transformers' log-softmax at each generated token's position."""
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt_ids + generated])).logits[0]
    return logits[len(prompt_ids) - 1 : -1].double().log_softmax(dim=-1)


def chat_prompt_ids(smollm2_loaded) -> list[int]:
    prompt = smollm2_loaded.chat_template.render(QUESTION, add_generation_prompt=True)
    return smollm2_loaded.tokenizer.encode(prompt, add_special_tokens=False)


def chat(server, **fields):
    """Greedy, 8 tokens, unless `fields` say otherwise."""
    fields = {"max_tokens": 8, "temperature": 0, **fields}
    return server.openai_client().chat.completions.create(model=server.model, messages=QUESTION, **fields)


def complete(server, **fields):
    """Greedy, 8 tokens, unless `fields` say otherwise."""
    fields = {"max_tokens": 8, "temperature": 0, **fields}
    return server.openai_client().completions.create(model=server.model, prompt=PROMPT, **fields)


def test_chat_logprobs_are_transformers_log_softmax_with_top_alternatives(
    server, smollm2_transformers, smollm2_loaded
):
    choice = chat(server, logprobs=True, top_logprobs=3).choices[0]
    decode = smollm2_loaded.tokenizer.decode
    expected = expected_logprobs(smollm2_transformers, chat_prompt_ids(smollm2_loaded), choice.token_ids)
    content = choice.logprobs.content
    assert len(content) == len(choice.token_ids)
    for position, (entry, token_id) in enumerate(zip(content, choice.token_ids, strict=True)):
        row = expected[position]
        top = row.topk(3)
        assert entry.token == decode([token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == pytest.approx(float(row[token_id]), abs=LOGPROB_ATOL)
        assert [alt.token for alt in entry.top_logprobs] == [decode([i]) for i in top.indices.tolist()]
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx(
            top.values.tolist(), abs=LOGPROB_ATOL
        )
    # Greedy: each token is its position's most likely one.
    assert [entry.token for entry in content] == [entry.top_logprobs[0].token for entry in content]


def test_chat_logprobs_streamed_are_the_bodys_split_over_the_chunks(server):
    body = chat(server, logprobs=True, top_logprobs=2).choices[0]
    chunks = list(chat(server, logprobs=True, top_logprobs=2, stream=True))
    streamed = [
        entry for chunk in chunks if chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content
    ]
    assert [entry.token for entry in streamed] == [entry.token for entry in body.logprobs.content]
    assert [entry.logprob for entry in streamed] == pytest.approx(
        [entry.logprob for entry in body.logprobs.content], abs=LOGPROB_ATOL
    )
    assert all(len(entry.top_logprobs) == 2 for entry in streamed)
    # Each chunk's logprobs are those of its own tokens.
    for chunk in chunks:
        choice = chunk.choices[0]
        if choice.logprobs is not None:
            assert len(choice.logprobs.content) == len(choice.token_ids)


def test_chat_without_logprobs_answers_null_logprobs(server):
    assert chat(server).choices[0].logprobs is None
    assert chat(server, logprobs=False).choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_format_are_transformers_log_softmax(
    server, smollm2_transformers, smollm2_loaded
):
    choice = complete(server, logprobs=2).choices[0]
    decode = smollm2_loaded.tokenizer.decode
    prompt_ids = smollm2_loaded.tokenizer.encode(PROMPT, add_special_tokens=True)
    expected = expected_logprobs(smollm2_transformers, prompt_ids, choice.token_ids)
    logprobs = choice.logprobs
    assert logprobs.tokens == [decode([token_id]) for token_id in choice.token_ids]
    for position, token_id in enumerate(choice.token_ids):
        row = expected[position]
        top = row.topk(2)
        assert logprobs.token_logprobs[position] == pytest.approx(float(row[token_id]), abs=LOGPROB_ATOL)
        # The two most likely tokens and the sampled one (here, greedy: among them).
        alternatives = logprobs.top_logprobs[position]
        assert set(alternatives) == {decode([i]) for i in top.indices.tolist()}
        assert sorted(alternatives.values(), reverse=True) == pytest.approx(
            top.values.tolist(), abs=LOGPROB_ATOL
        )
    offsets = [sum(len(token) for token in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == offsets
    assert "".join(logprobs.tokens) == choice.text


def test_completion_logprobs_zero_still_gives_each_sampled_tokens_logprob(server):
    logprobs = (
        complete(server, logprobs=0, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
        .choices[0]
        .logprobs
    )
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == 8
    assert all(value <= 0 for value in logprobs.token_logprobs)
    assert [list(top) for top in logprobs.top_logprobs] == [[token] for token in logprobs.tokens]


def test_completion_logprobs_streamed_join_to_the_body_with_running_offsets(server):
    body = complete(server, logprobs=1).choices[0].logprobs
    chunks = list(complete(server, logprobs=1, stream=True))
    pieces = [chunk.choices[0].logprobs for chunk in chunks if chunk.choices[0].logprobs is not None]
    assert [token for piece in pieces for token in piece.tokens] == body.tokens
    assert [offset for piece in pieces for offset in piece.text_offset] == body.text_offset
    assert [value for piece in pieces for value in piece.token_logprobs] == pytest.approx(
        body.token_logprobs, abs=LOGPROB_ATOL
    )


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("completions", {"logprobs": 6}, "logprobs"),
        ("completions", {"logprobs": 2, "echo": True, "stream": True}, "logprobs"),
    ],
    ids=["top-without-logprobs", "top-with-logprobs-false", "top-above-20", "above-5", "with-echo-streamed"],
)
def test_logprobs_outside_openais_rules_answer_400_naming_the_field(server, endpoint, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        (chat if endpoint == "chat" else complete)(server, **fields)
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == param
