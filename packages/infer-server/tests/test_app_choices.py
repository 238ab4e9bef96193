"""`n` choices on a real server, through the real `openai` client.

Oracle: `n > 1` is defined as n independent requests, choice i seeded with seed + i (vLLM's
rule). So each choice of an n-choice answer must be exactly the answer of an `n = 1` request with
seed + i, which the same server computes on its own; the usage counts the prompt once and every
choice's tokens.
"""

import collections

SEED = 11


def test_each_completion_choice_is_the_single_answer_of_its_seed(server):
    client = server.openai_client()
    settings = dict(model=server.model, prompt="Once upon a time", max_tokens=8, temperature=1.0)
    answer = client.completions.create(n=3, seed=SEED, **settings)
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    singles = [client.completions.create(seed=SEED + i, **settings) for i in range(3)]
    for choice, single in zip(answer.choices, singles, strict=True):
        assert (choice.text, choice.token_ids) == (single.choices[0].text, single.choices[0].token_ids)
        assert choice.finish_reason == single.choices[0].finish_reason
    # Three seeds, three different draws: the choices are not one answer copied.
    assert len({choice.text for choice in answer.choices}) > 1
    assert answer.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert answer.usage.completion_tokens == sum(single.usage.completion_tokens for single in singles)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_streamed_choices_join_to_the_answer_in_one_body(server):
    client = server.openai_client()
    settings = dict(
        model=server.model, prompt="The weather today", max_tokens=10, temperature=0.9, seed=SEED, n=2
    )
    body = client.completions.create(**settings)
    texts, finishes = collections.defaultdict(str), collections.defaultdict(list)
    usage_chunks = []
    stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **settings)
    for chunk in stream:
        if chunk.usage is not None:
            usage_chunks.append(chunk.usage)
        for choice in chunk.choices:
            assert not finishes[choice.index], "text after the choice's finish_reason"
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert dict(texts) == {choice.index: choice.text for choice in body.choices}
    assert dict(finishes) == {choice.index: [choice.finish_reason] for choice in body.choices}
    assert len(usage_chunks) == 1 and usage_chunks[0].completion_tokens == body.usage.completion_tokens


def test_each_chat_choice_is_the_single_answer_of_its_seed(server):
    client = server.openai_client()
    settings = dict(
        model=server.model,
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=6,
        temperature=1.0,
    )
    answer = client.chat.completions.create(n=2, seed=SEED, **settings)
    assert [choice.index for choice in answer.choices] == [0, 1]
    for i, choice in enumerate(answer.choices):
        single = client.chat.completions.create(seed=SEED + i, **settings)
        assert choice.message.role == "assistant"
        assert choice.message.content == single.choices[0].message.content
        assert choice.finish_reason == single.choices[0].finish_reason
    streamed = collections.defaultdict(str)
    for chunk in client.chat.completions.create(n=2, seed=SEED, stream=True, **settings):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert dict(streamed) == {choice.index: choice.message.content for choice in answer.choices}
