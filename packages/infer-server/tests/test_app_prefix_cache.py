"""usage.prompt_tokens_details.cached_tokens through the real server and the `openai` client:
the prompt tokens a prefix-cache hit served, streamed and not, on both endpoints; cache_salt
keeps requests apart; a server without the cache leaves the field out."""

import pytest

SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, and never use more words than the "
    "question needs. If the question is unclear, say so plainly."
)
GREEDY = dict(temperature=0, max_tokens=3)


@pytest.fixture(scope="module")
def cached_server(start_server):
    return start_server(max_batch_size=4, use_chunked_prefill=True, use_prefix_caching=True)


def ask(client, model, question, **extra):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return client.chat.completions.create(model=model, messages=messages, **GREEDY, **extra)


def test_a_second_chat_with_the_same_system_prompt_reports_cached_tokens(cached_server):
    client = cached_server.openai_client()
    first = ask(client, cached_server.model, "What is two and two?", extra_body={"cache_salt": "chat-test"})
    second = ask(client, cached_server.model, "Name a colour.", extra_body={"cache_salt": "chat-test"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The system prompt and the template's framing up to the user's words, not all of the prompt.
    assert 30 < cached < second.usage.prompt_tokens


def test_streamed_usage_and_completions_report_cached_tokens(cached_server):
    client = cached_server.openai_client()
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    client.completions.create(
        model=cached_server.model, prompt=prompt, **GREEDY, extra_body={"cache_salt": "s"}
    )
    again = client.completions.create(
        model=cached_server.model, prompt=prompt, **GREEDY, extra_body={"cache_salt": "s"}
    )
    # The same prompt again: all but its last token come from the cache.
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    stream = client.completions.create(
        model=cached_server.model,
        prompt=prompt + "Again.",
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
        extra_body={"cache_salt": "s"},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1


def test_a_different_cache_salt_shares_nothing(cached_server):
    client = cached_server.openai_client()
    question = "What is the capital of France?"
    ask(client, cached_server.model, question, extra_body={"cache_salt": "tenant-a"})
    other = ask(client, cached_server.model, question, extra_body={"cache_salt": "tenant-b"})
    same = ask(client, cached_server.model, question, extra_body={"cache_salt": "tenant-a"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens == same.usage.prompt_tokens - 1


def test_an_empty_cache_salt_is_refused_by_name(cached_server):
    import openai

    client = cached_server.openai_client()
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, cached_server.model, "Hi", extra_body={"cache_salt": ""})
    assert "cache_salt" in str(error.value)


def test_without_the_cache_usage_has_no_prompt_tokens_details(server):
    client = server.openai_client()
    answer = ask(client, server.model, "Hi")
    assert answer.usage.prompt_tokens_details is None


def test_metrics_count_matches_tokens_saved_and_cache_bytes(start_server):
    """/metrics after one miss and one hit on a server of its own: matches by kind, cached vs
    prefilled prompt tokens of finished requests, the cache's size, all read by prometheus_client."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    server = start_server(max_batch_size=2, use_chunked_prefill=True, use_prefix_caching=True)
    client = server.openai_client()
    first = ask(client, server.model, "What is two and two?")
    second = ask(client, server.model, "Name a colour.")
    samples = {}
    for family in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
            samples[key] = sample.value
    cached = second.usage.prompt_tokens_details.cached_tokens
    total_prompt = first.usage.prompt_tokens + second.usage.prompt_tokens
    assert samples["infer_prefix_cache_matches_total{kind=miss}"] == 1
    assert samples["infer_prefix_cache_matches_total{kind=lcp}"] == 1  # same system prompt, new question
    assert samples["infer_prompt_tokens_cached_total"] == cached
    assert samples["infer_prompt_tokens_prefilled_total"] == total_prompt - cached
    assert samples["infer_prefix_cache_cached_tokens_count"] == 2
    assert samples["infer_prefix_cache_cached_tokens_sum"] == cached
    assert samples["infer_prefix_cache_blocks"] > 0
    assert samples["infer_prefix_cache_entries"] > 0
    assert samples["infer_prefix_cache_used_bytes"] > 0
