"""Checks for specs/api: HTTP exchanges with an OpenAI-compatible server (httpx, no SDK).

With `--base-url URL` (the server's root, e.g. http://127.0.0.1:8000; a trailing /v1 is
dropped) they test that server; without it, our own server on the default model
(conformance/api/own_server.py, started on first use). The case vocabulary (request, expect,
fields, ...) is documented in specs/api/README.md. The checks that need a server set up for
them (overload, health_while_loading) start one of ours (own_server.extra_server); their cases
are infer_only, since a server given with --base-url cannot be restarted with other settings.
"""

import contextlib
import functools
import json
import re
import threading
import time

import httpx
import pytest

from conformance.api.own_server import (
    ALLOWED_ORIGIN,
    DEFAULT_MODEL,
    GUARDED_API_KEY,
    extra_server,
    guarded_server_url,
    own_server_url,
    wait_healthy,
)

TYPES = {"str": str, "int": int, "number": (int, float), "bool": bool, "list": list, "object": dict}


def exchange(case: dict, impl, options) -> None:
    client, model = _connect(case, options)
    response = _send(client, case["request"], model)
    expect = _materialize(case.get("expect", {}), model)
    problems = _check_response(response, expect, _materialize(case["request"], model).get("json"))
    if expect.get("then_healthy"):
        # The refusal must not have hurt the server: a small request still succeeds.
        follow_up = client.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
        if follow_up.status_code != 200:
            problems.append(f"after the refusal a 1-token completion answered {follow_up.status_code}")
    assert not problems, _report(case, response, problems)


def repeatable(case: dict, impl, options) -> None:
    client, model = _connect(case, options)
    first, second = (_send(client, case["request"], model) for _ in range(2))
    assert first.status_code == second.status_code == 200, _report(
        case, first, [f"status {first.status_code}"]
    )
    assert _texts(first.json()) == _texts(second.json()), f"{_texts(first.json())} != {_texts(second.json())}"


def same_answer(case: dict, impl, options) -> None:
    client, model = _connect(case, options)
    responses = [_send(client, request, model) for request in case["requests"]]
    for response in responses:
        assert response.status_code == 200, _report(case, response, [f"status {response.status_code}"])
    answers = [_texts(r.json()) for r in responses]
    assert all(a == answers[0] for a in answers), f"the requests gave different answers: {answers}"


def listed_models_are_served(case: dict, impl, options) -> None:
    client, _ = _connect(case, options)
    for entry in client.get("/v1/models").json()["data"]:
        response = client.post(
            "/v1/completions", json={"model": entry["id"], "prompt": "Hi", "max_tokens": 1}
        )
        assert response.status_code == 200, (
            f"model {entry['id']!r} is listed but answers {response.status_code}"
        )


def metrics_format(case: dict, impl, options) -> None:
    client, _ = _connect(case, options)
    response = client.get("/metrics")
    assert response.status_code == 200, f"/metrics answered {response.status_code}"
    assert response.headers.get("content-type", "").startswith("text/plain"), response.headers.get(
        "content-type"
    )
    sample = re.compile(
        r"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})? [-+]?(\d+\.?\d*([eE][-+]?\d+)?|NaN|[-+]?Inf)( \d+)?$"
    )
    bad = [
        line
        for line in response.text.splitlines()
        if line and not line.startswith("#") and not sample.match(line)
    ]
    assert not bad, f"lines that are not Prometheus samples: {bad[:5]}"


def metrics_names(case: dict, impl, options) -> None:
    client, _ = _connect(case, options)
    text = client.get("/metrics").text
    kinds = {"gauges": "gauge", "counters": "counter", "histograms": "histogram"}
    missing = [
        f"{name} ({kind})"
        for key, kind in kinds.items()
        for name in case.get(key, [])
        if f"# TYPE {name.removesuffix('_total')} {kind}" not in text and f"# TYPE {name} {kind}" not in text
    ]
    assert not missing, f"/metrics lacks {missing}"


def metrics_count_usage(case: dict, impl, options) -> None:
    client, model = _connect(case, options)
    counters = case["counters"]
    before = _scrape(client)
    response = _send(client, case["request"], model)
    assert response.status_code == 200, _report(case, response, [f"status {response.status_code}"])
    after = _scrape(client)
    usage = response.json()["usage"]
    for usage_key, name in (
        ("prompt_tokens", counters["prompt"]),
        ("completion_tokens", counters["generated"]),
    ):
        moved = after.get(name, 0.0) - before.get(name, 0.0)
        assert moved == usage[usage_key], f"{name} moved by {moved}, usage.{usage_key} is {usage[usage_key]}"


def stats_record_matches_usage(case: dict, impl, options) -> None:
    client, model = _connect(case, options)
    response = _send(client, case["request"], model)
    assert response.status_code == 200, _report(case, response, [f"status {response.status_code}"])
    body = response.json()
    deadline = time.monotonic() + 30.0
    while True:  # the record lands when the engine loop dispatches the final output
        snapshot = client.get("/v1/stats")
        assert snapshot.status_code == 200, f"/v1/stats answered {snapshot.status_code}"
        stats = snapshot.json()
        records = [record for record in stats.get("requests", []) if record.get("request_id") == body["id"]]
        if records or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert records, f"no record of {body['id']} in /v1/stats"
    (record,) = records
    usage, choice = body["usage"], body["choices"][0]
    assert record["prompt_tokens"] == usage["prompt_tokens"], record
    assert record["completion_tokens"] == usage["completion_tokens"], record
    assert record["finish_reason"] == choice["finish_reason"], record
    assert isinstance(record["ttft_s"], float) and record["ttft_s"] > 0, record
    for key in ("totals", "finish_reasons", "history"):
        assert isinstance(stats.get(key), dict), f"/v1/stats has no {key} object"
    for name, points in stats["history"].items():
        assert all(len(point) == 2 for point in points), f"history {name} is not [second, value] pairs"


def disconnect_aborts(case: dict, impl, options) -> None:
    client, model = _connect(case, options)
    gauge = "infer_requests_running"
    running_before = _scrape(client).get(gauge)
    if running_before is None:
        pytest.skip(f"the server exposes no {gauge} gauge to watch")
    request = _materialize(_stream_request(case), model)
    with client.stream("POST", request["path"], json=request["json"]) as response:
        assert response.status_code == 200, f"status {response.status_code}"
        data_lines = (line for line in response.iter_lines() if line.startswith("data:"))
        for _ in range(case["disconnect_after_chunks"]):
            next(data_lines)
        assert _scrape(client)[gauge] > running_before, f"{gauge} did not rise while the stream ran"
    # Leaving the block closed the connection mid-stream. Within a step (generously: 10 s on a
    # CPU) the request must be gone from the running batch.
    deadline = time.monotonic() + 10.0
    while _scrape(client)[gauge] > running_before:
        assert time.monotonic() < deadline, f"{gauge} still above {running_before} 10 s after the disconnect"
        time.sleep(0.05)


def overload(case: dict, impl, options) -> None:
    """On a server started with the case's server_args: max_batch_size streamed requests running
    and max_queue_len more waiting; then the case's request must be refused with 503, an error
    object and Retry-After, and every admitted stream must still end (one finish_reason, [DONE])."""
    _skip_if_targeted(case, options)
    args = case["server_args"]
    request = _materialize(case["request"], DEFAULT_MODEL)
    streamed = {**request["json"], "stream": True}
    with extra_server(args) as base_url, contextlib.ExitStack() as streams:
        client = streams.enter_context(httpx.Client(base_url=base_url, timeout=httpx.Timeout(120.0)))
        admitted = []
        for position in range(args["max_batch_size"] + args["max_queue_len"]):
            response = streams.enter_context(client.stream("POST", request["path"], json=streamed))
            assert response.status_code == 200, f"admitted request {position} answered {response.status_code}"
            lines = response.iter_lines()
            seen = []
            if position < args["max_batch_size"]:
                # Its first event means it runs; only then may the next one wait in the queue.
                seen.append(next(line for line in lines if line.startswith("data:")))
            admitted.append((seen, lines))
        refused = client.request(request["method"], request["path"], json=request["json"])
        problems = _check_response(refused, {"status": 503, "error": True}, request["json"])
        if not refused.headers.get("retry-after", "").isdigit():
            problems.append(
                f"the 503 has no Retry-After of whole seconds: {refused.headers.get('retry-after')!r}"
            )
        for position, (seen, lines) in enumerate(admitted):
            events = [line[len("data:") :].strip() for line in seen + list(lines) if line.startswith("data:")]
            finishes = [
                choice["finish_reason"]
                for chunk in _chunks(events)
                for choice in chunk.get("choices", [])
                if choice.get("finish_reason") is not None
            ]
            if events[-1:] != ["[DONE]"] or finishes not in (["stop"], ["length"]):
                problems.append(
                    f"admitted request {position} ended with {events[-2:]}, finish_reasons {finishes}"
                )
    assert not problems, _report(case, refused, problems)


def health_while_loading(case: dict, impl, options) -> None:
    """On a server whose model load is held back: /health and every request of the case answer
    503 within answer_within_s (generation with an error object and Retry-After); once the load
    is let go, /health turns 200 and the first request succeeds."""
    _skip_if_targeted(case, options)
    loading = threading.Event()
    problems = []
    with extra_server({}, hold_loading=loading) as base_url:
        with httpx.Client(base_url=base_url, timeout=httpx.Timeout(case["answer_within_s"])) as client:
            try:
                health = client.get("/health")
                if health.status_code != 503:
                    problems.append(f"/health answered {health.status_code} while loading")
                for request in case["requests"]:
                    response = _send(client, request, DEFAULT_MODEL)
                    problems += [
                        f"{request['path']}: {p}"
                        for p in _check_response(response, {"status": 503, "error": True}, None)
                    ]
                    if "retry-after" not in response.headers:
                        problems.append(f"{request['path']}: the 503 has no Retry-After header")
            except httpx.TimeoutException as error:
                problems.append(f"no answer within {case['answer_within_s']} s while loading: {error!r}")
        loading.set()
        wait_healthy(base_url)
        with httpx.Client(base_url=base_url, timeout=httpx.Timeout(120.0)) as client:
            after = _send(client, case["requests"][0], DEFAULT_MODEL)
            if after.status_code != 200:
                problems.append(f"after loading {case['requests'][0]['path']} answered {after.status_code}")
    assert not problems, "\n".join(problems)


# Sampling settings (issue 14): each case's request is greedy (temperature 0); the check sends it
# as it is and with the setting, and judges the setting by how the answers differ. Token ids come
# from choices[].token_ids, vLLM's extension (_greedy_ids says how they are asked for).


def logit_bias_steers(case: dict, impl, options) -> None:
    """+100 on a token id of the plain answer other than its first makes every generated token
    that id; -100 on the plain answer's first token makes the first token another one."""
    client, model = _connect(case, options)
    request = _materialize(case["request"], model)
    _, plain = _greedy_ids(client, request)
    forced_id = next((token for token in plain if token != plain[0]), None)
    assert forced_id is not None, f"case {case['id']}: the plain answer {plain} repeats one token only"
    _, forced = _greedy_ids(client, _with(request, logit_bias={str(forced_id): 100}))
    assert forced == [forced_id] * request["json"]["max_tokens"], (
        f"logit_bias +100 on {forced_id}: tokens {forced}, plain answer {plain}"
    )
    _, banned = _greedy_ids(client, _with(request, logit_bias={str(plain[0]): -100}))
    assert banned[:1] != plain[:1], (
        f"logit_bias -100 on {plain[0]}: the answer still starts with it: {banned}"
    )


def stop_token_ids_end(case: dict, impl, options) -> None:
    """The plain answer's token at position `stop_at` (or the first later one not seen before it)
    as a stop token id ends the answer there: finish_reason stop, the tokens up to and including
    it (counted in usage.completion_tokens), and a text that begins the plain text and is shorter."""
    client, model = _connect(case, options)
    request = _materialize(case["request"], model)
    plain_body, plain = _greedy_ids(client, request)
    position = next((i for i in range(case["stop_at"], len(plain) - 1) if plain[i] not in plain[:i]), None)
    assert position is not None, f"case {case['id']}: no token of {plain} to stop at"
    body, stopped = _greedy_ids(client, _with(request, stop_token_ids=[plain[position]]))
    choice, plain_text = body["choices"][0], plain_body["choices"][0]["text"]
    problems = []
    if choice["finish_reason"] != "stop":
        problems.append(f"finish_reason {choice['finish_reason']!r}, expected stop")
    if stopped != plain[: position + 1] or body["usage"]["completion_tokens"] != position + 1:
        problems.append(
            f"stop token {plain[position]} (position {position} of {plain}): tokens {stopped}, "
            f"completion_tokens {body['usage']['completion_tokens']}, expected {position + 1}"
        )
    if not (plain_text.startswith(choice["text"]) and len(choice["text"]) < len(plain_text)):
        problems.append(f"text {choice['text']!r} is not a shorter beginning of {plain_text!r}")
    assert not problems, "\n".join(problems)


def min_tokens_hold(case: dict, impl, options) -> None:
    """The case's request ends early with finish_reason stop (a stop string, the end of sequence,
    or with `stop_first_token` its greedy first token as a stop token id) after fewer than
    `min_tokens` tokens; with min_tokens added the answer has at least that many."""
    client, model = _connect(case, options)
    request = _materialize(case["request"], model)
    if case.get("stop_first_token"):
        _, plain = _greedy_ids(client, request)
        request = _with(request, stop_token_ids=plain[:1])
    wanted = case["min_tokens"]
    early = _send(client, request, model)
    assert early.status_code == 200, _report(case, early, [f"status {early.status_code}"])
    body = early.json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] < wanted, (
        f"case {case['id']}: without min_tokens the answer must stop before {wanted} tokens: {body}"
    )
    held = _send(client, _with(request, min_tokens=wanted), model)
    problems = _check_response(held, {"status": 200, "usage": True}, request["json"])
    if not problems and held.json()["usage"]["completion_tokens"] < wanted:
        problems.append(f"min_tokens {wanted}: completion_tokens {held.json()['usage']['completion_tokens']}")
    assert not problems, _report(case, held, problems)


def penalty_fewer_repeats(case: dict, impl, options) -> None:
    """The case's `penalty` settings change the greedy answer to a prompt the model repeats, and
    leave fewer repeated tokens in it (a token equal to an earlier one of the answer). Tokens are
    read from the legacy logprobs (`logprobs: 0` is added to the request)."""
    client, model = _connect(case, options)
    request = _with(_materialize(case["request"], model), logprobs=0)
    answers = []
    for sent in (request, _with(request, **case["penalty"])):
        response = _send(client, sent, model)
        assert response.status_code == 200, _report(case, response, [f"status {response.status_code}"])
        choice = response.json()["choices"][0]
        tokens = choice["logprobs"]["tokens"]
        answers.append((choice["text"], sum(token in tokens[:i] for i, token in enumerate(tokens))))
    (plain_text, plain_repeats), (text, repeats) = answers
    assert text != plain_text, f"{case['penalty']} left the answer as it was: {text!r}"
    assert repeats < plain_repeats, (
        f"{case['penalty']}: {repeats} repeated tokens in {text!r}, {plain_repeats} in {plain_text!r}"
    )


def echo_prefix(case: dict, impl, options) -> None:
    """With echo, each choice's text (joined from the chunks when streamed) starts with its
    prompt: the case's prompt is a string or a list of strings, choice i belongs to prompt i // n."""
    client, model = _connect(case, options)
    request = _materialize(case["request"], model)
    response = _send(client, request, model)
    assert response.status_code == 200, _report(case, response, [f"status {response.status_code}"])
    if request["json"].get("stream"):
        lines = response.text.splitlines()
        events = [line[len("data:") :].strip() for line in lines if line.startswith("data:")]
        texts: dict[int, str] = {}
        for chunk in _chunks(events):
            for choice in chunk.get("choices", []):
                texts[choice["index"]] = texts.get(choice["index"], "") + _piece(choice)
    else:
        texts = {choice["index"]: choice["text"] for choice in response.json()["choices"]}
    prompt = request["json"]["prompt"]
    prompts = [prompt] if isinstance(prompt, str) else prompt
    n = request["json"].get("n", 1)
    assert sorted(texts) == list(range(len(prompts) * n)), f"choice indexes {sorted(texts)}"
    problems = [
        f"choice {index} {text!r} does not start with {prompts[index // n]!r}"
        for index, text in sorted(texts.items())
        if not text.startswith(prompts[index // n])
    ]
    assert not problems, "\n".join(problems)


def echo_logprobs(case: dict, impl, options) -> None:
    """With echo and logprobs k (one prompt, one choice), OpenAI's legacy lists cover the prompt's
    tokens then the completion's: as many entries as usage's prompt + completion tokens, the first
    token's logprob and alternatives null, the others <= 0 with k or k + 1 alternatives (the token
    itself joins the k most likely), the prompt part's tokens joined ending with the prompt (after
    any BOS the tokenizer adds), text offsets adding up the tokens' texts from 0."""
    client, model = _connect(case, options)
    request = _materialize(case["request"], model)
    response = _send(client, request, model)
    assert response.status_code == 200, _report(case, response, [f"status {response.status_code}"])
    body, sent = response.json(), request["json"]
    usage, choice, k = body["usage"], body["choices"][0], sent["logprobs"]
    logprobs, num_prompt = choice["logprobs"], usage["prompt_tokens"]
    lengths = {
        name: len(logprobs[name]) for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    problems = [
        f"{name} has {length} entries, usage says {num_prompt} + {usage['completion_tokens']} tokens"
        for name, length in lengths.items()
        if length != num_prompt + usage["completion_tokens"]
    ]
    if problems:
        raise AssertionError(_report(case, response, problems))
    if logprobs["token_logprobs"][0] is not None or logprobs["top_logprobs"][0] is not None:
        problems.append("the first prompt token has a logprob or alternatives; nothing predicts it")
    for index, (value, top) in enumerate(
        zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True), 1
    ):
        if not isinstance(value, int | float) or value > 0:
            problems.append(f"token_logprobs[{index}] = {value!r}, not a number <= 0")
        if not isinstance(top, dict) or len(top) not in (k, k + 1) or k == 0 and len(top) != 1:
            problems.append(f"top_logprobs[{index}] = {top!r}, not {k} or {k + 1} alternatives")
    prompt_text = "".join(logprobs["tokens"][:num_prompt])
    if not prompt_text.endswith(sent["prompt"]):
        problems.append(f"the prompt's tokens join to {prompt_text!r}, not the prompt {sent['prompt']!r}")
    offsets = [sum(len(token) for token in logprobs["tokens"][:i]) for i in range(len(logprobs["tokens"]))]
    if logprobs["text_offset"] != offsets:
        problems.append(f"text_offset {logprobs['text_offset']} do not add up the tokens' texts {offsets}")
    if not choice["text"].startswith(sent["prompt"]):
        problems.append(f"text {choice['text']!r} does not start with the prompt")
    if sent.get("max_tokens") == 0 and (choice["text"] != sent["prompt"] or usage["completion_tokens"] != 0):
        problems.append("max_tokens 0 answers more than the prompt")
    assert not problems, _report(case, response, problems)


def prompt_logprobs_shape(case: dict, impl, options) -> None:
    """vLLM's prompt_logprobs k (one prompt): per completions choice, or on the chat response, a
    list as long as the prompt, None first, then per token a {token id: {logprob <= 0, rank >= 1,
    decoded_token}} holding ranks 1..k once each and the prompt token (k or k + 1 entries), rank
    1's logprob the largest."""
    client, model = _connect(case, options)
    request = _materialize(case["request"], model)
    response = _send(client, request, model)
    assert response.status_code == 200, _report(case, response, [f"status {response.status_code}"])
    body, k = response.json(), request["json"]["prompt_logprobs"]
    lists = (
        [body.get("prompt_logprobs")]
        if "messages" in request["json"]
        else [choice.get("prompt_logprobs") for choice in body["choices"]]
    )
    problems = []
    for entries in lists:
        if not isinstance(entries, list) or len(entries) != body["usage"]["prompt_tokens"]:
            problems.append(f"prompt_logprobs {str(entries)[:100]} is not a list of the prompt's length")
            continue
        if entries[0] is not None:
            problems.append("the first prompt token has prompt logprobs; nothing predicts it")
        for index, entry in enumerate(entries[1:], 1):
            values = list(entry.values()) if isinstance(entry, dict) else []
            ranks = sorted(value.get("rank") for value in values if isinstance(value, dict))
            if len(values) not in (k, k + 1) or [rank for rank in ranks if rank <= k] != list(
                range(1, k + 1)
            ):
                problems.append(f"entry {index} {entry!r}: not ranks 1..{k} and the prompt token")
            elif any(value["logprob"] > 0 or not isinstance(value["decoded_token"], str) for value in values):
                problems.append(f"entry {index} {entry!r}: a logprob > 0 or no decoded_token")
            elif k and max(value["logprob"] for value in values) != min(
                value["logprob"] for value in values if value["rank"] == 1
            ):
                problems.append(f"entry {index} {entry!r}: rank 1 is not the most likely")
    assert not problems, _report(case, response, problems)


def tokenize_answer(case: dict, impl, options) -> None:
    """The case's /tokenize answer agrees with itself and the server: count is len(tokens), every
    token an id >= 0, token_strs one string per token when asked for (else null or absent), and
    max_model_len the one GET /v1/models gives the model (where it gives one)."""
    client, model = _connect(case, options)
    response = _send(client, case["request"], model)
    assert response.status_code == 200, _report(case, response, [f"status {response.status_code}"])
    body, problems = response.json(), []
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and all(isinstance(t, int) and t >= 0 for t in tokens)):
        problems.append(f"tokens is not a list of token ids: {tokens!r}")
    elif body.get("count") != len(tokens):
        problems.append(f"count {body.get('count')!r} != {len(tokens)} tokens")
    token_strs = body.get("token_strs")
    if _materialize(case["request"], model)["json"].get("return_token_strs"):
        if not (isinstance(token_strs, list) and all(isinstance(t, str) for t in token_strs)):
            problems.append(f"token_strs is not a list of strings: {token_strs!r}")
        elif isinstance(tokens, list) and len(token_strs) != len(tokens):
            problems.append(f"{len(token_strs)} token_strs for {len(tokens)} tokens")
    elif token_strs is not None:
        problems.append(f"token_strs not asked for, but given: {token_strs!r}")
    listed = {entry["id"]: entry for entry in client.get("/v1/models").json()["data"]}
    listed_len = listed.get(model, {}).get("max_model_len")
    if listed_len is not None and body.get("max_model_len") != listed_len:
        problems.append(f"max_model_len {body.get('max_model_len')!r}, but /v1/models says {listed_len}")
    assert not problems, _report(case, response, problems)


def tokenize_counts_chat_prompt(case: dict, impl, options) -> None:
    """/tokenize of the case's `chat` fields (messages, tools) counts the usage.prompt_tokens of a
    one-token /v1/chat/completions answer to the same fields."""
    client, model = _connect(case, options)
    chat = _materialize(case["chat"], model)
    tokenized = client.post("/tokenize", json={"model": model, **chat})
    assert tokenized.status_code == 200, _report(case, tokenized, [f"/tokenize {tokenized.status_code}"])
    answered = client.post(
        "/v1/chat/completions", json={"model": model, **chat, "max_tokens": 1, "temperature": 0}
    )
    assert answered.status_code == 200, _report(case, answered, [f"chat {answered.status_code}"])
    count, prompt_tokens = tokenized.json()["count"], answered.json()["usage"]["prompt_tokens"]
    assert count == prompt_tokens, f"/tokenize counts {count} tokens, the chat's usage {prompt_tokens}"


def detokenize_round_trip(case: dict, impl, options) -> None:
    """/detokenize of /tokenize's tokens for the case's `prompt` (without special tokens) gives
    the prompt back."""
    client, model = _connect(case, options)
    prompt = case["prompt"]
    tokenized = client.post("/tokenize", json={"model": model, "prompt": prompt, "add_special_tokens": False})
    assert tokenized.status_code == 200, _report(case, tokenized, [f"/tokenize {tokenized.status_code}"])
    tokens = tokenized.json()["tokens"]
    detokenized = client.post("/detokenize", json={"model": model, "tokens": tokens})
    assert detokenized.status_code == 200, _report(
        case, detokenized, [f"/detokenize {detokenized.status_code}"]
    )
    text = detokenized.json()["prompt"]
    assert text == prompt, f"/detokenize of {tokens} gave {text!r}, not {prompt!r}"


# Anthropic's Messages API (specs/api/messages.yaml): bodies in Anthropic's shape.

MESSAGES_WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def messages_stop_sequence(case: dict, impl, options) -> None:
    """The greedy answer's `word`-th word as a stop sequence: the text ends before it, with
    stop_reason "stop_sequence" and stop_sequence that word."""
    client, model = _connect(case, options)
    request = _materialize(case["request"], model)
    whole = client.post("/v1/messages", json=request)
    assert whole.status_code == 200, _report(case, whole, [f"status {whole.status_code}"])
    text = _message_text(whole.json())
    words = text.split()
    assert len(words) > case["word"], f"the greedy answer {text!r} has too few words for the case"
    stop = words[case["word"]]
    stopped = client.post("/v1/messages", json={**request, "stop_sequences": [stop]})
    assert stopped.status_code == 200, _report(case, stopped, [f"status {stopped.status_code}"])
    body, problems = stopped.json(), []
    if (body.get("stop_reason"), body.get("stop_sequence")) != ("stop_sequence", stop):
        problems.append(
            f"stop_reason {body.get('stop_reason')!r}, stop_sequence {body.get('stop_sequence')!r}"
        )
    if _message_text(body) != text[: text.find(stop)]:
        problems.append(f"text {_message_text(body)!r} is not {text[: text.find(stop)]!r}")
    assert not problems, _report(case, stopped, problems)


def messages_tool_use(case: dict, impl, options) -> None:
    import jsonschema

    client, model = _connect(case, options)
    request = {
        "model": model,
        "max_tokens": 32,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [MESSAGES_WEATHER_TOOL],
        "tool_choice": case["tool_choice"],
    }
    response = client.post("/v1/messages", json=request)
    assert response.status_code == 200, _report(case, response, [f"status {response.status_code}"])
    body, problems = response.json(), []
    uses = [block for block in body.get("content", []) if block.get("type") == "tool_use"]
    if body.get("stop_reason") != "tool_use" or len(uses) != 1:
        problems.append(f"stop_reason {body.get('stop_reason')!r} with {len(uses)} tool_use blocks")
    for block in uses:
        if not str(block.get("id")).startswith("toolu_") or block.get("name") != "get_weather":
            problems.append(f"tool_use block {block}")
        try:
            jsonschema.validate(block.get("input"), MESSAGES_WEATHER_TOOL["input_schema"])
        except jsonschema.ValidationError as error:
            problems.append(f"input {block.get('input')!r}: {error.message}")
    assert not problems, _report(case, response, problems)


def messages_stream_equals_message(case: dict, impl, options) -> None:
    """The streamed events are well formed and in Anthropic's order, and assemble into the
    non-streamed message's blocks, stop_reason and usage."""
    client, model = _connect(case, options)
    request = _materialize(case["request"], model)
    whole = client.post("/v1/messages", json=request)
    assert whole.status_code == 200, _report(case, whole, [f"status {whole.status_code}"])
    streamed = client.post("/v1/messages", json={**request, "stream": True})
    assert streamed.status_code == 200, _report(case, streamed, [f"status {streamed.status_code}"])
    events, problems = _typed_events(streamed.text)
    events = [event for event in events if event.get("type") != "ping"]
    problems += _assembly_problems(events, whole.json())
    assert not problems, _report(case, streamed, problems)


def _typed_events(text: str) -> tuple[list[dict], list[str]]:
    """The events of an SSE body whose events name their type (Anthropic's and the Responses
    API's: an `event:` line and a `data:` line, the data's `type` the event's name), and what is
    wrong with their framing."""
    events, problems = [], []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        names = [line[len("event:") :].strip() for line in lines if line.startswith("event:")]
        data = [line[len("data:") :].strip() for line in lines if line.startswith("data:")]
        if len(names) != 1 or len(data) != 1 or len(lines) != 2:
            problems.append(f"event is not one event line and one data line: {block[:120]!r}")
            continue
        event = json.loads(data[0])
        if event.get("type") != names[0]:
            problems.append(f"event {names[0]!r} carries type {event.get('type')!r}")
        events.append(event)
    return events, problems


def _assembly_problems(events: list[dict], whole: dict) -> list[str]:
    kinds = [event.get("type") for event in events]
    if not kinds or kinds[0] != "message_start" or kinds[-2:] != ["message_delta", "message_stop"]:
        return [f"events {kinds} do not run message_start ... message_delta, message_stop"]
    blocks, problems, open_index = [], [], None
    for event in events[1:-2]:
        index = event.get("index")
        if event["type"] == "content_block_start":
            if open_index is not None or index != len(blocks):
                problems.append(f"block {index} starts while {open_index} is open or out of order")
            blocks.append({**event["content_block"]})
            blocks[-1]["partial_json"] = ""
            open_index = index
        elif event["type"] == "content_block_delta" and index == open_index:
            delta, block = event["delta"], blocks[index]
            # Each delta type carries its text under the block field it extends.
            fields = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
            field = fields.get(delta.get("type"))
            if field is None:
                problems.append(f"unknown delta {delta}")
            else:
                block[field] = (
                    block.get(field, "") + delta[field if field != "partial_json" else "partial_json"]
                )
        elif event["type"] == "content_block_stop" and index == open_index:
            open_index = None
        else:
            problems.append(f"event {event} outside its block")
    for block in blocks:
        partial = block.pop("partial_json")
        if block.get("type") == "tool_use":
            block["input"] = json.loads(partial) if partial else block.get("input")
            block.pop("id", None)
        block.pop("signature", None)
    expected = [
        {k: v for k, v in block.items() if k not in ("id", "signature", "citations")}
        for block in whole.get("content", [])
    ]
    if blocks != expected:
        problems.append(f"assembled blocks {blocks} != the message's {expected}")
    delta = events[-2]
    if delta.get("delta", {}).get("stop_reason") != whole.get("stop_reason"):
        problems.append(f"streamed stop_reason {delta.get('delta')} != {whole.get('stop_reason')!r}")
    if delta.get("usage", {}).get("output_tokens") != whole.get("usage", {}).get("output_tokens"):
        problems.append(f"streamed usage {delta.get('usage')} != {whole.get('usage')}")
    return problems


def messages_equal_chat(case: dict, impl, options) -> None:
    client, model = _connect(case, options)
    message = client.post("/v1/messages", json=_materialize(case["messages"]["request"], model))
    chat = client.post("/v1/chat/completions", json=_materialize(case["chat"]["request"], model))
    assert message.status_code == 200, _report(case, message, [f"status {message.status_code}"])
    assert chat.status_code == 200, _report(case, chat, [f"status {chat.status_code}"])
    message_body, chat_body, problems = message.json(), chat.json(), []
    chat_text = chat_body["choices"][0]["message"].get("content") or ""
    if _message_text(message_body) != chat_text:
        problems.append(f"text {_message_text(message_body)!r} != the chat's {chat_text!r}")
    if message_body["usage"]["input_tokens"] != chat_body["usage"]["prompt_tokens"]:
        problems.append(
            f"input_tokens {message_body['usage']['input_tokens']} != prompt_tokens "
            f"{chat_body['usage']['prompt_tokens']}"
        )
    assert not problems, _report(case, message, problems)


def messages_count_tokens(case: dict, impl, options) -> None:
    client, model = _connect(case, options)
    request = _materialize(case["request"], model)
    counted = client.post("/v1/messages/count_tokens", json=request)
    assert counted.status_code == 200, _report(case, counted, [f"status {counted.status_code}"])
    answered = client.post("/v1/messages", json={**request, "max_tokens": 1})
    assert answered.status_code == 200, _report(case, answered, [f"status {answered.status_code}"])
    count, used = counted.json().get("input_tokens"), answered.json()["usage"]["input_tokens"]
    assert count == used, f"count_tokens says {count!r}, the message's usage {used}"


def _message_text(body: dict) -> str:
    return "".join(block.get("text", "") for block in body.get("content", []) if block.get("type") == "text")


def responses_stream_events(case: dict, impl, options) -> None:
    """A streamed /v1/responses answer: every event is an `event:` line naming the type its data
    holds, sequence_numbers count from 0, response.created comes first and the case's `terminal`
    event last, and the output_text deltas join to the text of the final response's messages
    (function-call argument deltas to its calls' arguments)."""
    client, model = _connect(case, options)
    request = _materialize(case["request"], model)
    response = client.post(request["path"], json=request["json"])
    assert response.status_code == 200, f"status {response.status_code}: {response.text[:300]}"
    events, problems = _typed_events(response.text)
    assert events, "no events"
    types = [event.get("type") for event in events]
    if types[0] != "response.created":
        problems.append(f"first event is {types[0]}")
    if types[-1] != case["terminal"]:
        problems.append(f"last event is {types[-1]}, expected {case['terminal']}")
    numbers = [event.get("sequence_number") for event in events]
    if numbers != list(range(len(events))):
        problems.append(f"sequence_numbers are {numbers[:10]}..., not 0, 1, 2, ...")
    final = events[-1].get("response") or {}
    texts = [
        part.get("text", "")
        for item in final.get("output", [])
        if item.get("type") == "message"
        for part in item.get("content", [])
    ]
    deltas = "".join(event["delta"] for event in events if event.get("type") == "response.output_text.delta")
    if deltas != "".join(texts):
        problems.append(f"text deltas {deltas!r} != final text {''.join(texts)!r}")
    arguments = [
        item.get("arguments") for item in final.get("output", []) if item.get("type") == "function_call"
    ]
    streamed = [
        event["arguments"] for event in events if event.get("type") == "response.function_call_arguments.done"
    ]
    if arguments != streamed:
        problems.append(f"streamed call arguments {streamed} != final {arguments}")
    assert not problems, f"case {case['id']}: " + "; ".join(problems)


def responses_follow_up(case: dict, impl, options) -> None:
    """The case's `second` request, sent with previous_response_id naming the `first` one's
    answer: `expect: continues` wants a 200 whose input_tokens exceed the first's input and
    output tokens together (the earlier turns are part of its prompt); `expect: not_found` a 400
    naming previous_response_id with code previous_response_not_found."""
    client, model = _connect(case, options)
    first = client.post("/v1/responses", json=_materialize(case["first"], model))
    assert first.status_code == 200, _report(case, first, [f"status {first.status_code}"])
    second_json = {**_materialize(case["second"], model), "previous_response_id": first.json()["id"]}
    second = client.post("/v1/responses", json=second_json)
    if case["expect"] == "not_found":
        problems = _check_response(
            second, {"status": 400, "error": True, "names_param": "previous_response_id"}, None
        )
        code = (second.json().get("error") or {}).get("code") if not problems else None
        if not problems and code != "previous_response_not_found":
            problems.append(f"error code {code!r}, expected previous_response_not_found")
        assert not problems, _report(case, second, problems)
        return
    assert second.status_code == 200, _report(case, second, [f"status {second.status_code}"])
    earlier, now = first.json()["usage"], second.json()["usage"]
    assert now["input_tokens"] > earlier["input_tokens"] + earlier["output_tokens"], (
        f"the follow-up counts {now['input_tokens']} input tokens, the first turn alone "
        f"{earlier['input_tokens']} + {earlier['output_tokens']}"
    )


def responses_retrieve(case: dict, impl, options) -> None:
    """GET /v1/responses/{id} of the case's `request`'s answer is that answer; an id never made
    is a 404."""
    client, model = _connect(case, options)
    created = client.post("/v1/responses", json=_materialize(case["request"], model))
    assert created.status_code == 200, _report(case, created, [f"status {created.status_code}"])
    fetched = client.get(f"/v1/responses/{created.json()['id']}")
    assert fetched.status_code == 200, _report(case, fetched, [f"status {fetched.status_code}"])
    assert fetched.json() == created.json(), f"GET answered {fetched.text[:300]}"
    missing = client.get("/v1/responses/resp_never_made_here")
    problems = _check_response(missing, {"status": 404, "error": True}, None)
    assert not problems, _report(case, missing, problems)


# /v1/embeddings (specs/api/embeddings.yaml).


def embeddings_vectors(case: dict, impl, options) -> None:
    """The case's `inputs` embedded as floats and as base64: unit vectors of one width, equal for
    equal inputs and different otherwise, base64 the same float32 vector's little-endian bytes."""
    import base64
    import math
    import struct

    client, model = _connect(case, options)
    request = {"model": model, "input": case["inputs"]}
    floats = client.post("/v1/embeddings", json={**request, "encoding_format": "float"})
    packed = client.post("/v1/embeddings", json={**request, "encoding_format": "base64"})
    assert floats.status_code == 200, _report(case, floats, [f"status {floats.status_code}"])
    assert packed.status_code == 200, _report(case, packed, [f"status {packed.status_code}"])
    vectors = [item["embedding"] for item in sorted(floats.json()["data"], key=lambda item: item["index"])]
    problems = []
    if len({len(vector) for vector in vectors}) != 1:
        problems.append(f"widths {[len(vector) for vector in vectors]}")
    for index, vector in enumerate(vectors):
        norm = math.sqrt(sum(value * value for value in vector))
        if abs(norm - 1) > 1e-3:
            problems.append(f"vector {index} has length {norm}")
    for (i, a), (j, b) in ((pair[0], pair[1]) for pair in _pairs(list(enumerate(vectors)))):
        same_input = case["inputs"][i] == case["inputs"][j]
        close = max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
        if same_input != close:
            problems.append(
                f"inputs {i} and {j} are {'equal' if same_input else 'different'}, their vectors not"
            )
    for item in packed.json()["data"]:
        raw = base64.b64decode(item["embedding"])
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        expected = vectors[item["index"]]
        if (
            len(decoded) != len(expected)
            or max(abs(x - y) for x, y in zip(decoded, expected, strict=True)) > 1e-6
        ):
            problems.append(f"base64 vector {item['index']} is not the float vector")
    assert not problems, _report(case, floats, problems)


def _pairs(items: list) -> list[tuple]:
    return [(a, b) for index, a in enumerate(items) for b in items[index + 1 :]]


def _with(request: dict, **fields) -> dict:
    return {**request, "json": {**request["json"], **fields}}


def _greedy_ids(client: httpx.Client, request: dict) -> tuple[dict, list[int]]:
    """(body, the first choice's token ids) of a materialized request. The ids are vLLM's
    choices[].token_ids: ours always sends them, vLLM when asked with return_token_ids; a server
    with neither is skipped."""
    for sent in (request, _with(request, return_token_ids=True)):
        response = client.request(sent["method"], sent["path"], json=sent["json"])
        if response.status_code == 200 and isinstance(response.json()["choices"][0].get("token_ids"), list):
            return response.json(), response.json()["choices"][0]["token_ids"]
    pytest.skip(f"no choices[].token_ids from the server ({response.status_code}): {response.text[:200]}")


def _scrape(client: httpx.Client) -> dict[str, float]:
    """The unlabelled samples of /metrics, by name."""
    samples = {}
    for line in client.get("/metrics").text.splitlines():
        parts = line.split()
        if line and not line.startswith("#") and "{" not in parts[0] and len(parts) >= 2:
            samples[parts[0]] = float(parts[1])
    return samples


# Streaming: every SSE clause reads the same kind of case ({endpoint, extra}) over one stream.


def sse_framing(case: dict, impl, options) -> None:
    response, events, problems = _stream(case, options)
    assert response.headers.get("content-type", "").startswith("text/event-stream"), response.headers
    assert events, "no events"
    for payload in events[:-1]:
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            problems.append(f"payload is not JSON: {payload[:80]!r}")
            continue
        if not isinstance(chunk, dict):
            problems.append(f"payload is not a JSON object: {payload[:80]!r}")
    assert not problems, "\n".join(problems)


def sse_done_last(case: dict, impl, options) -> None:
    _, events, problems = _stream(case, options)
    assert events and events[-1] == "[DONE]", f"last event {events[-1:]!r}, expected [DONE]"
    assert events.count("[DONE]") == 1, f"[DONE] sent {events.count('[DONE]')} times"
    assert not problems, "\n".join(problems)


def sse_one_terminal_event(case: dict, impl, options) -> None:
    _, events, _ = _stream(case, options)
    finished: dict[int, int] = {}
    problems = []
    for chunk in _chunks(events):
        for choice in chunk.get("choices", []):
            index = choice["index"]
            if index in finished and _piece(choice):
                problems.append(f"choice {index} got text after its finish_reason")
            if choice.get("finish_reason") is not None:
                if choice["finish_reason"] not in ("stop", "length"):
                    problems.append(f"choice {index} finish_reason {choice['finish_reason']!r}")
                finished[index] = finished.get(index, 0) + 1
    n = case.get("extra", {}).get("n", 1)
    if finished != dict.fromkeys(range(n), 1):
        problems.append(f"terminal chunks per choice index {finished}, expected one for each of 0..{n - 1}")
    assert not problems, "\n".join(problems)


def sse_chunk_consistency(case: dict, impl, options) -> None:
    _, events, _ = _stream(case, options)
    chunks = _chunks(events)
    expected_object = "chat.completion.chunk" if case["endpoint"] == "chat" else "text_completion"
    problems = [f"object {c.get('object')!r}" for c in chunks if c.get("object") != expected_object]
    for key in ("id", "created", "model"):
        values = {json.dumps(c.get(key)) for c in chunks}
        if len(values) != 1:
            problems.append(f"chunks disagree on {key}: {sorted(values)}")
    if case["endpoint"] == "chat":
        seen: set[int] = set()
        for chunk in chunks:
            for choice in chunk.get("choices", []):
                role = choice.get("delta", {}).get("role")
                if choice["index"] not in seen and role != "assistant":
                    problems.append(f"first delta of choice {choice['index']} has role {role!r}")
                elif choice["index"] in seen and role is not None:
                    problems.append(f"a later delta of choice {choice['index']} repeats role {role!r}")
                seen.add(choice["index"])
    assert not problems, "\n".join(problems)


def sse_usage(case: dict, impl, options) -> None:
    _, events, _ = _stream(case, options)
    chunks = _chunks(events)
    with_usage = [i for i, c in enumerate(chunks) if c.get("usage")]
    wanted = case.get("extra", {}).get("stream_options", {}).get("include_usage", False)
    if not wanted:
        assert not with_usage, f"usage sent without stream_options.include_usage in chunks {with_usage}"
        return
    assert with_usage == [len(chunks) - 1], (
        f"usage in chunks {with_usage} of {len(chunks)}, expected only the last"
    )
    last = chunks[-1]
    assert last.get("choices") == [], f"the usage chunk has choices {last.get('choices')}"
    usage = last["usage"]
    request = _stream_request(case)["json"]
    limit = request.get("n", 1) * request["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    assert 0 < usage["completion_tokens"] <= limit, (
        f"completion_tokens {usage['completion_tokens']} > {limit}"
    )


def stream_equals_non_stream(case: dict, impl, options) -> None:
    client, model = _connect(case, options)
    request = _stream_request(case)
    _, events, _ = _stream(case, options)
    chunks = _chunks(events)
    streamed = "".join(_piece(choice) for chunk in chunks for choice in chunk.get("choices", []))
    finish = [
        c["finish_reason"] for chunk in chunks for c in chunk.get("choices", []) if c.get("finish_reason")
    ]
    plain_json = {k: v for k, v in request["json"].items() if k not in ("stream", "stream_options")}
    plain = _send(client, {**request, "json": plain_json}, model).json()
    assert streamed == _texts(plain)[0], f"streamed {streamed!r} != non-streamed {_texts(plain)[0]!r}"
    assert finish == [plain["choices"][0]["finish_reason"]], f"finish_reason {finish} vs {plain['choices']}"
    assert chunks[-1].get("usage") == plain["usage"], f"usage {chunks[-1].get('usage')} vs {plain['usage']}"


def stream_logprobs_equal_non_stream(case: dict, impl, options) -> None:
    """Each chunk with tokens carries their logprobs; joined, they are the non-streamed answer's."""
    client, model = _connect(case, options)
    request = _stream_request(case)
    _, events, _ = _stream(case, options)
    pieces = [
        choice["logprobs"]
        for chunk in _chunks(events)
        for choice in chunk.get("choices", [])
        if choice.get("logprobs")
    ]
    plain_json = {k: v for k, v in request["json"].items() if k not in ("stream", "stream_options")}
    plain = _send(client, {**request, "json": plain_json}, model).json()["choices"][0]["logprobs"]
    assert plain, "the non-streamed answer carries no logprobs"
    if case["endpoint"] == "chat":
        streamed = [entry for piece in pieces for entry in piece["content"]]
        assert [e["token"] for e in streamed] == [e["token"] for e in plain["content"]], "chat tokens differ"
        pairs = zip([e["logprob"] for e in streamed], [e["logprob"] for e in plain["content"]], strict=True)
    else:
        joined = {key: [value for piece in pieces for value in piece[key]] for key in plain}
        assert joined["tokens"] == plain["tokens"], f"tokens {joined['tokens']} vs {plain['tokens']}"
        assert joined["text_offset"] == plain["text_offset"], (
            f"offsets {joined['text_offset']} vs {plain['text_offset']}"
        )
        pairs = zip(joined["token_logprobs"], plain["token_logprobs"], strict=True)
    for streamed_logprob, plain_logprob in pairs:
        assert abs(streamed_logprob - plain_logprob) <= 1e-3, f"logprob {streamed_logprob} vs {plain_logprob}"


def sse_tool_calls(case: dict, impl, options) -> None:
    """A streamed answer with tools: tool-call deltas assemble (by index) into calls with an id,
    type function, a name and arguments that join to a JSON object; at least one call (to the
    named function) when tool_choice forces one; one finish_reason, tool_calls exactly when a call
    was sent; [DONE] once, last; the same calls and content as the body."""
    client, model = _connect(case, options)
    request = _materialize(case["request"], model)
    response = client.post(request["path"], json=request["json"])
    assert response.status_code == 200, f"status {response.status_code}: {response.text[:300]}"
    events = [line[len("data:") :].strip() for line in response.text.splitlines() if line.startswith("data:")]
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, f"events end {events[-2:]}"
    problems = []
    calls: dict[int, dict] = {}
    content, finishes = "", []
    for chunk in _chunks(events):
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                if not isinstance(piece.get("index"), int):
                    problems.append(f"tool call delta without an integer index: {piece}")
                    continue
                call = calls.setdefault(
                    piece["index"], {"id": None, "type": None, "name": None, "arguments": ""}
                )
                function = piece.get("function") or {}
                for key, value in (
                    ("id", piece.get("id")),
                    ("type", piece.get("type")),
                    ("name", function.get("name")),
                ):
                    if value is not None:
                        call[key] = value
                call["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason") is not None:
                finishes.append(choice["finish_reason"])
    # A named tool_choice or "required" means a call (OpenAI's own wording: "forces the model to
    # call"); without this a server that ignores tool_choice would pass.
    forced = request["json"].get("tool_choice")
    if forced == "required" or isinstance(forced, dict):
        wanted = forced["function"]["name"] if isinstance(forced, dict) else None
        names = [call["name"] for _, call in sorted(calls.items())]
        if not names or (wanted is not None and set(names) != {wanted}):
            target = f" to {wanted}" if wanted else ""
            problems.append(f"tool_choice {forced} forces a call{target}; got calls to {names}")
    if len(finishes) != 1:
        problems.append(f"finish_reason sent {len(finishes)} times: {finishes}")
    elif (finishes[0] == "tool_calls") != bool(calls):
        problems.append(f"finish_reason {finishes[0]!r} with {len(calls)} tool calls")
    if sorted(calls) != list(range(len(calls))):
        problems.append(f"tool call indexes {sorted(calls)} are not 0..{len(calls) - 1}")
    for index, call in sorted(calls.items()):
        if not isinstance(call["id"], str) or call["type"] != "function" or not isinstance(call["name"], str):
            problems.append(f"tool call {index} lacks an id, type function or a name: {call}")
        try:
            if not isinstance(json.loads(call["arguments"]), dict):
                problems.append(f"tool call {index} arguments are JSON but not an object")
        except ValueError:
            problems.append(f"tool call {index} arguments are not JSON: {call['arguments']!r}")
    plain_json = {k: v for k, v in request["json"].items() if k not in ("stream", "stream_options")}
    whole = _send(client, {**request, "json": plain_json}, model).json()["choices"][0]
    whole_calls = [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in whole["message"].get("tool_calls") or []
    ]
    streamed_calls = [
        (call["name"], json.loads(call["arguments"] or "null")) for _, call in sorted(calls.items())
    ]
    if not problems and streamed_calls != whole_calls:
        problems.append(f"streamed calls {streamed_calls} != non-streamed {whole_calls}")
    if content != (whole["message"].get("content") or ""):
        problems.append(f"streamed content {content!r} != non-streamed {whole['message'].get('content')!r}")
    assert not problems, "\n".join(problems)


# Auth and CORS (specs/api/auth.yaml): our guarded server (own_server.guarded_server_url), or the
# server given with --base-url when --api-key gives its key.

CORS_HEADERS_ASKED = "authorization, content-type"


def api_key_required(case: dict, impl, options) -> None:
    """The case's request without the right key in each way a client gets it wrong must be a 401
    (OpenAI's error object, code invalid_api_key, or with `error_shape: anthropic` Anthropic's,
    type authentication_error; WWW-Authenticate: Bearer; the key not echoed); with the key it
    must answer as `with_key` says (default 200)."""
    base_url, key = _guarded_target(case, options)
    keyed, bare = _client(base_url, key), _client(base_url, None)
    model = options.model or _first_model(keyed)
    wrong = {
        "no Authorization header": None,
        "the key in another scheme": f"Basic {key}",
        "an empty key": "Bearer",  # "Bearer " as sent: h11 drops the trailing space
        "a longer key": f"Bearer {key}x",
        "another key": "Bearer not-the-key",
    }
    problems = []
    for what, authorization in wrong.items():
        headers = {} if authorization is None else {"Authorization": authorization}
        response = _send(bare, {**case["request"], "headers": headers}, model)
        problems += [f"{what}: {problem}" for problem in _refusal_problems(response, key, case)]
    response = _send(keyed, case["request"], model)
    expect = case.get("with_key", {"status": 200})
    problems += [f"with the key: {problem}" for problem in _check_response(response, expect, None)]
    assert not problems, _report(case, response, problems)


def api_key_header_accepted(case: dict, impl, options) -> None:
    """The case's request with the key in `x-api-key` (no Authorization header) answers as with
    the Bearer header (200); with another key, a longer one or a prefix of it there, a 401."""
    base_url, key = _guarded_target(case, options)
    bare = _client(base_url, None)
    model = options.model or _first_model(_client(base_url, key))
    problems = []
    for what, sent in {"another key": "not-the-key", "a longer key": f"{key}x", "a prefix": key[:-1]}.items():
        response = _send(bare, {**case["request"], "headers": {"x-api-key": sent}}, model)
        problems += [
            f"x-api-key with {what}: {problem}" for problem in _refusal_problems(response, key, case)
        ]
    response = _send(bare, {**case["request"], "headers": {"x-api-key": key}}, model)
    problems += [f"x-api-key with the key: {p}" for p in _check_response(response, {"status": 200}, None)]
    assert not problems, _report(case, response, problems)


def open_without_key(case: dict, impl, options) -> None:
    base_url, _ = _guarded_target(case, options)
    response = _send(_client(base_url, None), case["request"], "")
    assert response.status_code == 200, _report(
        case, response, [f"status {response.status_code} without a key"]
    )


def protect_metrics(case: dict, impl, options) -> None:
    """On a server of ours with --protect-metrics (its model load held: neither path needs it),
    /metrics refuses a request without the key and answers one with it; /health stays open."""
    from infer.server.access import AccessPolicy

    _skip_if_targeted(case, options)
    access = AccessPolicy(api_key=GUARDED_API_KEY, protect_metrics=True)
    with extra_server({}, hold_loading=threading.Event(), access=access) as base_url:
        bare, keyed = _client(base_url, None), _client(base_url, GUARDED_API_KEY)
        refused, answered, health = bare.get("/metrics"), keyed.get("/metrics"), bare.get("/health")
    problems = [
        f"/metrics without the key: {problem}" for problem in _refusal_problems(refused, GUARDED_API_KEY)
    ]
    if answered.status_code != 200:
        problems.append(f"/metrics with the key answered {answered.status_code}")
    if health.status_code == 401:
        problems.append("/health asks for the key")
    assert not problems, "\n".join(problems)


def cors_preflight(case: dict, impl, options) -> None:
    _skip_if_targeted(case, options)
    response = _preflight(guarded_server_url(), case["path"], ALLOWED_ORIGIN, case["method"])
    allowed_methods = {m.strip() for m in response.headers.get("access-control-allow-methods", "").split(",")}
    allowed_headers = {
        h.strip().lower() for h in response.headers.get("access-control-allow-headers", "").split(",")
    }
    problems = []
    if response.status_code != 200:
        problems.append(f"status {response.status_code}")
    if response.headers.get("access-control-allow-origin") != ALLOWED_ORIGIN:
        problems.append(
            f"Access-Control-Allow-Origin is {response.headers.get('access-control-allow-origin')!r}"
        )
    if case["method"] not in allowed_methods:
        problems.append(f"{case['method']} is not in Access-Control-Allow-Methods {sorted(allowed_methods)}")
    if not {"authorization", "content-type"} <= allowed_headers:
        problems.append(
            f"Access-Control-Allow-Headers {sorted(allowed_headers)} lacks authorization or content-type"
        )
    assert not problems, _report(case, response, problems)


def cors_refused(case: dict, impl, options) -> None:
    _skip_if_targeted(case, options)
    base_url = guarded_server_url() if case["server"] == "guarded" else own_server_url()
    response = _preflight(base_url, "/v1/chat/completions", case["origin"], "POST")
    cors = _cors_headers(response)
    assert not cors, _report(case, response, [f"CORS headers for {case['origin']}: {cors}"])


def cors_response(case: dict, impl, options) -> None:
    _skip_if_targeted(case, options)
    base_url = guarded_server_url()
    keyed, bare = _client(base_url, GUARDED_API_KEY), _client(base_url, None)
    problems = []
    for what, client, origin, status in (
        ("with the key", keyed, ALLOWED_ORIGIN, 200),
        ("without the key", bare, ALLOWED_ORIGIN, 401),
        ("from another origin", keyed, "http://elsewhere.example", 200),
    ):
        response = _send(client, {**case["request"], "headers": {"Origin": origin}}, DEFAULT_MODEL)
        wanted = {"access-control-allow-origin": origin} if origin == ALLOWED_ORIGIN else {}
        got = {k: v for k, v in _cors_headers(response).items() if k == "access-control-allow-origin"}
        if response.status_code != status or got != wanted:
            problems.append(
                f"{what}: status {response.status_code}, CORS headers {got}, expected {status}, {wanted}"
            )
    assert not problems, "\n".join(problems)


def _guarded_target(case: dict, options) -> tuple[str, str]:
    """(base URL, its API key): the --base-url server with --api-key, else our guarded server."""
    _skip_if_targeted(case, options)
    if not options.base_url:
        return guarded_server_url(), GUARDED_API_KEY
    if not options.api_key:
        pytest.skip("needs --api-key: the key the server at --base-url requires")
    return _root(options.base_url), options.api_key


def _refusal_problems(response: httpx.Response, key: str, case: dict | None = None) -> list[str]:
    if (case or {}).get("error_shape") == "anthropic":
        expect = {
            "status": 401,
            "error": True,
            "fields": {"type": "error", "error.type": "authentication_error"},
        }
    else:
        expect = {"status": 401, "error": True, "fields": {"error.code": "invalid_api_key"}}
    problems = _check_response(response, expect, None)
    if not response.headers.get("www-authenticate", "").lower().startswith("bearer"):
        problems.append(f"WWW-Authenticate is {response.headers.get('www-authenticate')!r}, not Bearer")
    if key in response.text:
        problems.append("the answer quotes the key")
    return problems


def _preflight(base_url: str, path: str, origin: str, method: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": CORS_HEADERS_ASKED,
    }
    return _client(base_url, None).options(path, headers=headers)


def _cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k.lower(): v for k, v in response.headers.items() if k.lower().startswith("access-control-")}


# Plumbing.


def _skip_if_targeted(case: dict, options) -> None:
    if options.base_url and case.get("infer_only"):
        pytest.skip("infer-specific behaviour; not checked against a server given with --base-url")


def _connect(case: dict, options) -> tuple[httpx.Client, str]:
    _skip_if_targeted(case, options)
    client = _client(_root(options.base_url) if options.base_url else own_server_url(), options.api_key)
    return client, options.model or _first_model(client)


def _root(base_url: str) -> str:
    """A --base-url without its trailing / or /v1."""
    return base_url.rstrip("/").removesuffix("/v1")


@functools.cache
def _client(base_url: str, api_key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=httpx.Timeout(120.0))


@functools.cache
def _first_model(client: httpx.Client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def _materialize(value, model: str):
    """Replaces "$MODEL" and expands {"$repeat": text, "times": n} (the text n times over) and
    {"$repeat_list": item, "times": n} (a list of n items) anywhere in a case value."""
    if value == "$MODEL":
        return model
    if isinstance(value, dict):
        if "$repeat" in value:
            return value["$repeat"] * value["times"]
        if "$repeat_list" in value:
            return [value["$repeat_list"]] * value["times"]
        return {k: _materialize(v, model) for k, v in value.items()}
    if isinstance(value, list):
        return [_materialize(v, model) for v in value]
    return value


def _send(client: httpx.Client, request: dict, model: str) -> httpx.Response:
    request = _materialize(request, model)
    kwargs = {"headers": request.get("headers", {})}
    if "json" in request:
        kwargs["json"] = request["json"]
    elif "body_text" in request:
        kwargs["content"] = request["body_text"]
    return client.request(request["method"], request["path"], **kwargs)


def _check_response(response: httpx.Response, expect: dict, request_json) -> list[str]:
    problems = []
    allowed = expect.get("status", 200)
    allowed = allowed if isinstance(allowed, list) else [allowed]
    if response.status_code not in allowed:
        return [f"status {response.status_code}, expected {allowed}"]
    try:
        body = response.json()
    except ValueError:
        return [] if not (expect.get("error") or expect.get("fields")) else ["body is not JSON"]
    if expect.get("error"):
        error = body.get("error") if isinstance(body, dict) else None
        if not (isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error):
            problems.append(f"not an OpenAI error object: {body}")
        elif "names_param" in expect:
            param = expect["names_param"]
            if error.get("param") != param and param not in error["message"]:
                problems.append(f"error names neither param nor message {param!r}: {error}")
        if "message_contains" in expect and expect["message_contains"] not in json.dumps(body).lower():
            problems.append(f"error message lacks {expect['message_contains']!r}: {body}")
    for path, expected in expect.get("fields", {}).items():
        problems += _match(_get(body, path), expected, path)
    if expect.get("usage"):
        problems += _usage_problems(body, request_json)
    for stop in expect.get("text_excludes", []):
        problems += [f"text {t!r} contains stop {stop!r}" for t in _texts(body) if stop in t]
    for path in expect.get("json_strings", []):
        try:
            if not isinstance(json.loads(_get(body, path)), dict):
                problems.append(f"{path} is JSON but not an object")
        except (TypeError, ValueError):
            problems.append(f"{path} is not a JSON string: {_get(body, path)!r}")
    for validation in expect.get("validates", []):
        problems += _validation_problems(_get(body, validation["path"]), validation)
    return problems


def _validation_problems(value, validation: dict) -> list[str]:
    """`validates` items: the text at `path` fully matches `regex` (ECMA's ASCII `\\d`), parses
    with the `lark` package under the Lark grammar `lark` (its Earley parser, whole text), or is
    JSON that `json_schema` validates (by jsonschema, with formats checked)."""
    path = validation["path"]
    if not isinstance(value, str):
        return [f"{path} is not a string: {value!r}"]
    if "lark" in validation:
        import lark

        try:
            lark.Lark(validation["lark"]).parse(value)
        except lark.exceptions.LarkError as error:
            return [f"{path} = {value!r} does not parse with the lark grammar: {error}"]
        return []
    if "regex" in validation:
        matched = re.fullmatch(validation["regex"], value, re.ASCII)
        return [] if matched else [f"{path} = {value!r} does not match {validation['regex']!r}"]
    import jsonschema

    try:
        decoded = json.loads(value)
    except ValueError:
        return [f"{path} is not JSON: {value!r}"]
    checker = jsonschema.Draft202012Validator(
        validation["json_schema"], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    return [f"{path} = {value!r}: {error.message}" for error in checker.iter_errors(decoded)]


_MISSING = object()


def _get(body, dotted: str):
    value = body
    for part in dotted.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return _MISSING
    return value


def _match(value, expected, path: str) -> list[str]:
    if value is _MISSING:
        return [f"{path} is missing"]
    if not isinstance(expected, dict):
        return [] if value == expected else [f"{path} = {value!r}, expected {expected!r}"]
    problems = []
    if "type" in expected and (
        not isinstance(value, TYPES[expected["type"]])
        or isinstance(value, bool)
        and expected["type"] != "bool"
    ):
        problems.append(f"{path} = {value!r} is not {expected['type']}")
    if "in" in expected and value not in expected["in"]:
        problems.append(f"{path} = {value!r}, expected one of {expected['in']}")
    if "prefix" in expected and not str(value).startswith(expected["prefix"]):
        problems.append(f"{path} = {value!r} does not start with {expected['prefix']!r}")
    if "min" in expected and not value >= expected["min"]:
        problems.append(f"{path} = {value!r} < {expected['min']}")
    if "max" in expected and not value <= expected["max"]:
        problems.append(f"{path} = {value!r} > {expected['max']}")
    if "len" in expected and len(value) != expected["len"]:
        problems.append(f"{path} has {len(value)} items, expected {expected['len']}")
    if "min_len" in expected and len(value) < expected["min_len"]:
        problems.append(f"{path} has {len(value)} items, expected at least {expected['min_len']}")
    return problems


def _usage_problems(body: dict, request: dict) -> list[str]:
    usage = body.get("usage") or {}
    prompt, completion, total = (usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    if not all(isinstance(v, int) for v in (prompt, completion, total)):
        return [f"usage is not three integers: {usage}"]
    problems = [] if total == prompt + completion else [f"total_tokens {total} != {prompt} + {completion}"]
    max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
    choices = body.get("choices", [])
    if max_tokens is not None and completion > max_tokens * len(choices):
        problems.append(f"completion_tokens {completion} > max_tokens {max_tokens} x {len(choices)} choices")
    all_at_length = bool(choices) and all(c.get("finish_reason") == "length" for c in choices)
    if max_tokens is not None and all_at_length and completion != max_tokens * len(choices):
        problems.append(
            f"every choice stopped at length but completion_tokens {completion} != {max_tokens} each"
        )
    return problems


def _texts(body: dict) -> list[str]:
    return [c.get("text", (c.get("message") or {}).get("content")) for c in body.get("choices", [])]


def _piece(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _stream_request(case: dict) -> dict:
    request = case["requests"][case["endpoint"]]
    return {**request, "json": {**request["json"], **case.get("extra", {})}}


def _stream(case: dict, options) -> tuple[httpx.Response, list[str], list[str]]:
    """(response, event payloads in order, framing problems) of one streamed request. The clauses
    that judge the same request (SSE-001..005 on a case, SSE-009..013 on another) judge one
    exchange of it, as each would judge its own."""
    client, model = _connect(case, options)
    request = _materialize(_stream_request(case), model)
    response = _post_once(client, request["path"], json.dumps(request["json"], sort_keys=True))
    assert response.status_code == 200, f"status {response.status_code}: {response.text[:300]}"
    events, problems = [], []
    for block in response.text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        data = [line[len("data:") :].strip() for line in block.split("\n") if line.startswith("data:")]
        others = [line for line in block.split("\n") if line and not line.startswith(("data:", ":"))]
        if len(data) != 1 or others:
            problems.append(f"event is not one data line: {block[:120]!r}")
        events += data
    return response, events, problems


@functools.cache
def _post_once(client: httpx.Client, path: str, body_json: str) -> httpx.Response:
    return client.post(path, json=json.loads(body_json))


def _chunks(events: list[str]) -> list[dict]:
    return [json.loads(e) for e in events if e != "[DONE]"]


def _report(case: dict, response: httpx.Response, problems: list[str]) -> str:
    return (
        f"case {case['id']}: "
        + "; ".join(problems)
        + f"\nresponse {response.status_code}: {response.text[:500]}"
    )
