"""`n` choices, batches of prompts and `echo` on a real server, through the real `openai` client.

Oracle: `n > 1` is defined as n independent requests, choice i seeded with seed + i (vLLM's
rule), and a batch as one request per prompt. So each choice must be exactly the answer of a
single-prompt `n = 1` request with its seed, which the same server computes on its own; the
usage counts each prompt once and every choice's tokens. `echo` is checked against the same
request without it and the tokenizer's own decoding of a token-id prompt.
"""

import collections

import httpx

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


def test_every_chat_choice_message_carries_refusal_null(server):
    """OpenAI's schema requires `refusal` in every message (null: no refusal); read raw, as the
    `openai` client fills a missing key with None itself."""
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 2,
        "n": 3,
        "seed": SEED,
    }
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    messages = [choice["message"] for choice in response.json()["choices"]]
    assert len(messages) == 3
    assert all("refusal" in message and message["refusal"] is None for message in messages), messages


def test_a_batch_of_prompts_is_each_prompts_single_answers_in_order(server):
    """Prompt i's choice j is the answer of prompt i alone with seed + j, at index i x n + j;
    usage counts each prompt once."""
    client = server.openai_client()
    prompts = ["Hello", [504, 3213, 314], "The sky is"]
    settings = dict(model=server.model, max_tokens=5, temperature=1.0, seed=SEED)
    answer = client.completions.create(prompt=prompts, n=2, **settings)
    assert [choice.index for choice in answer.choices] == list(range(6))
    prompt_tokens = completion_tokens = 0
    for i, prompt in enumerate(prompts):
        singles = [
            client.completions.create(prompt=prompt, **{**settings, "seed": SEED + j}) for j in range(2)
        ]
        for j, single in enumerate(singles):
            choice = answer.choices[i * 2 + j]
            assert (choice.text, choice.token_ids) == (single.choices[0].text, single.choices[0].token_ids)
            completion_tokens += single.usage.completion_tokens
        prompt_tokens += singles[0].usage.prompt_tokens
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, completion_tokens)


def test_echo_puts_each_prompts_text_before_its_answer(server, smollm2_loaded):
    client = server.openai_client()
    token_prompt = [504, 3213, 314, 3316]
    settings = dict(model=server.model, max_tokens=6, temperature=0)
    plain = client.completions.create(prompt=["The capital of France is", token_prompt], **settings)
    echoed = client.completions.create(
        prompt=["The capital of France is", token_prompt], echo=True, **settings
    )
    token_text = smollm2_loaded.tokenizer.decode(token_prompt)
    assert echoed.choices[0].text == "The capital of France is" + plain.choices[0].text
    assert echoed.choices[1].text == token_text + plain.choices[1].text
    # The generated tokens and their count are the answer's alone.
    assert echoed.choices[0].token_ids == plain.choices[0].token_ids
    assert echoed.usage == plain.usage
    streamed = collections.defaultdict(str)
    for chunk in client.completions.create(
        prompt=["The capital of France is", token_prompt], echo=True, stream=True, **settings
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert dict(streamed) == {choice.index: choice.text for choice in echoed.choices}
