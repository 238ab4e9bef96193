"""Workloads W1-W7: the same arguments give the same requests, and lengths stay in their ranges."""

import base64
import dataclasses
import io
import json

import pytest
from PIL import Image

from infer.bench.serving.cli import main as bench_main
from infer.bench.serving.workloads import SHAPES, make_workload, untimed_stand_in
from infer.models.random_checkpoint import COMMON_WORDS


@pytest.mark.parametrize("name", ["W1", "W2", "W3", "W6", "W7"])
def test_same_seed_gives_the_same_requests(name):
    assert make_workload(name, seed=3).requests == make_workload(name, seed=3).requests


@pytest.mark.parametrize("name", ["W2", "W3", "W6", "W7"])
def test_another_seed_gives_other_requests(name):
    assert make_workload(name, seed=0).requests != make_workload(name, seed=1).requests


def test_w1_is_one_request_of_256_prompt_and_256_output_tokens():
    workload = make_workload("W1")
    assert workload.concurrency == 1
    assert [(r.num_prompt_tokens, r.max_tokens) for r in workload.requests] == [(256, 256)]


@pytest.mark.parametrize("concurrency", [16, 64])
def test_w2_lengths_lie_in_their_ranges_and_ids_in_the_vocabulary(concurrency):
    workload = make_workload("W2", concurrency=concurrency, seed=0, vocab_size=1000)
    shape = SHAPES["W2"]
    assert workload.num_requests == 2 * concurrency
    prompt_lengths = [r.num_prompt_tokens for r in workload.requests]
    outputs = [r.max_tokens for r in workload.requests]
    assert shape.prompt_tokens[0] <= min(prompt_lengths) and max(prompt_lengths) <= shape.prompt_tokens[1]
    assert shape.output_tokens[0] <= min(outputs) and max(outputs) <= shape.output_tokens[1]
    assert all(0 <= token_id < 1000 for r in workload.requests for token_id in r.prompt_token_ids)
    assert all(r.endpoint == "/v1/completions" for r in workload.requests)


def test_w2_spreads_over_its_ranges():
    # Uniform draws over 256 requests reach both ends of each range to within 10 %.
    requests = make_workload("W2", concurrency=64, num_requests=256).requests
    low, high = SHAPES["W2"].prompt_tokens
    assert min(r.num_prompt_tokens for r in requests) < low + (high - low) // 10
    assert max(r.num_prompt_tokens for r in requests) > high - (high - low) // 10


def test_w2_at_64_starts_with_the_requests_of_w2_at_16():
    # One seeded stream per workload: a larger run extends the smaller one.
    assert make_workload("W2", concurrency=64).requests[:32] == make_workload("W2", concurrency=16).requests


def test_w3_requests_share_one_system_prompt_and_differ_in_the_user_turn():
    workload = make_workload("W3", concurrency=16)
    system_prompts = {r.messages[0]["content"] for r in workload.requests}
    user_turns = {r.messages[1]["content"] for r in workload.requests}
    assert len(system_prompts) == 1
    assert len(next(iter(system_prompts)).split()) == SHAPES["W3"].system_prompt_words
    assert len(user_turns) == workload.num_requests
    assert [m["role"] for m in workload.requests[0].messages] == ["system", "user"]
    assert all(r.endpoint == "/v1/chat/completions" for r in workload.requests)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "W9"}, "unknown workload"),
        ({"name": "W1", "concurrency": 4}, "W1 is one request"),
        ({"name": "W2", "concurrency": 0}, "concurrency must be >= 1"),
        ({"name": "W2", "num_requests": 0}, "num_requests must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_workload(**kwargs)


def test_w4_sends_a_long_prompt_every_fourth_request_and_w4_decode_never():
    pressure = make_workload("W4", concurrency=16)
    shape = SHAPES["W4"]
    lengths = [len(r.prompt_token_ids) for r in pressure.requests]
    long_rows = [i for i, n in enumerate(lengths) if n == shape.long_prompt_tokens]
    assert long_rows == list(range(3, pressure.num_requests, 4))
    assert all(pressure.requests[i].max_tokens == shape.long_output_tokens for i in long_rows)
    short = [r for i, r in enumerate(pressure.requests) if i not in long_rows]
    low, high = shape.prompt_tokens
    assert all(low <= len(r.prompt_token_ids) <= high and r.max_tokens == 256 for r in short)
    decode_only = make_workload("W4-decode", concurrency=16)
    assert max(len(r.prompt_token_ids) for r in decode_only.requests) <= high


def test_w5_conversations_have_4_to_8_turns_and_a_tool_result_every_third():
    workload = make_workload("W5", concurrency=16)
    assert {request.endpoint for request in workload.requests} == {"/v1/chat/completions"}
    for request in workload.requests:
        assert 4 <= len(request.turns) <= 8 and len(request.turn_max_tokens) == len(request.turns)
        assert all(32 <= tokens <= 96 for tokens in request.turn_max_tokens)
        assert [m["role"] for m in request.turns[0]] == ["system", "user"]
        for turn, messages in enumerate(request.turns[1:], start=1):
            roles = [m["role"] for m in messages]
            assert roles == (["tool"] if turn % 3 == 0 else ["user"]), (turn, roles)
    # One system prompt for all: what the cache keeps across conversations too.
    assert len({request.turns[0][0]["content"] for request in workload.requests}) == 1


def _decoded_image(request) -> Image.Image:
    url = request.messages[0]["content"][0]["image_url"]["url"]
    header, data = url.split(",", 1)
    assert header == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data, validate=True)))


def test_w6_is_one_user_message_of_an_image_then_a_short_question():
    workload = make_workload("W6", concurrency=16)
    assert workload.num_requests == 32 and workload.describe()["image_size"] == 896
    for request in workload.requests:
        (message,) = request.messages
        image_part, text_part = message["content"]
        assert message["role"] == "user" and image_part["type"] == "image_url" and text_part["type"] == "text"
        words = text_part["text"].split(": ", 1)[1].split()
        assert 8 <= len(words) <= 16 and set(words) <= set(COMMON_WORDS)
        assert 64 <= request.max_tokens <= 128
        assert request.endpoint == "/v1/chat/completions"


@pytest.mark.parametrize("image_size", [896, 48])
def test_w6_images_decode_to_their_size_and_differ_between_requests(image_size):
    shape = dataclasses.replace(SHAPES["W6"], image_size=image_size)
    workload = make_workload("W6", shape=shape, concurrency=16)
    images = [_decoded_image(request) for request in workload.requests]
    assert {(image.format, image.mode, image.size) for image in images} == {
        ("PNG", "RGB", (image_size, image_size))
    }
    assert len({image.tobytes() for image in images}) == workload.num_requests
    # Small enough that 64 concurrent clients' requests weigh little: a few kB each.
    assert max(len(r.messages[0]["content"][0]["image_url"]["url"]) for r in workload.requests) < 16_000


def test_the_untimed_stand_in_of_w6_sends_images_no_timed_request_sends():
    """The warm-up (the first) and the probe (the median by length: chat requests tie, so the
    second) each get an image of their own; a text workload warms up on its own requests."""
    workload = make_workload("W6", concurrency=16)
    stand_in = untimed_stand_in(workload)
    timed = {_decoded_image(request).tobytes() for request in workload.requests}
    untimed = [_decoded_image(request).tobytes() for request in stand_in.requests[:2]]
    assert len(set(untimed)) == 2 and not timed & set(untimed)
    text_workload = make_workload("W3", concurrency=16)
    assert untimed_stand_in(text_workload) is text_workload


def test_a_negative_image_size_is_refused_by_name():
    with pytest.raises(ValueError, match="image_size must be >= 0"):
        make_workload("W6", shape=dataclasses.replace(SHAPES["W6"], image_size=-1))


def test_image_size_on_a_text_workload_is_refused_by_name(capsys):
    status = bench_main(
        ["serve", "--base-url", "http://127.0.0.1:9", "--workload", "W2", "--image-size", "64"]
    )
    assert status == 1
    assert "--image-size is for workloads with images (W6); W2 has none" in capsys.readouterr().err


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_w7_sessions_start_from_one_system_and_tools_prompt_and_grow_by_tool_results(word_tokenizer):
    """One session per client; every session the same ~3000-token system prompt (tool
    definitions as JSON, then words), a task, then tool results of 500-2000 tokens by a tokenizer
    that spells each common word as one token, each answering a call to a tool the system prompt
    defines; answers of 100-300 tokens."""
    workload = make_workload("W7", concurrency=8)
    assert workload.num_requests == 8 and workload.describe()["max_context_tokens"] == 32768
    systems = {request.turns[0][0]["content"] for request in workload.requests}
    assert len(systems) == 1
    (system,) = systems
    # Byte-level spellings of JSON keys cost the random vocabulary more than real ones (one or two
    # tokens a key there): the prompt is 3000 tokens by the estimate and within a quarter above.
    assert 3000 <= _tokens(word_tokenizer, system) <= 3750
    header, tools_json, _ = system.split("\n", 2)
    tools = {tool["function"]["name"]: tool["function"]["parameters"] for tool in json.loads(tools_json)}
    assert header == "You may call these tools:" and len(tools) == 6
    result_tokens = []
    for request in workload.requests:
        assert [message["role"] for message in request.turns[0]] == ["system", "user"]
        assert request.turns[0][1]["content"].startswith(f"Session {request.index}: ")
        assert len(request.turns) > 10  # a 32k context holds many turns of ~1.5k tokens
        for (message,) in request.turns[1:]:
            assert message["role"] == "tool"
            result_tokens.append(_tokens(word_tokenizer, message["content"]))
            arguments = json.loads(message["call"]["arguments"])
            assert list(arguments) == tools[message["call"]["name"]]["required"]
        assert all(100 <= tokens <= 300 for tokens in request.turn_max_tokens)
        assert len(request.turn_max_tokens) == len(request.turn_think_s) == len(request.turns)
    assert min(result_tokens) >= 500 and max(result_tokens) <= 2000
    # Uniform over the range: both ends are reached to within 10%.
    assert min(result_tokens) < 650 and max(result_tokens) > 1850


@pytest.mark.parametrize("max_context_tokens", [32768, 8192])
def test_w7_plans_sessions_that_fill_the_cap_by_less_than_a_turn(max_context_tokens):
    """By the plan's own estimate (prompt tokens each turn adds, and the answers' max_tokens), a
    session stays within the cap, and the room left is less than the largest turn could take."""
    shape = dataclasses.replace(SHAPES["W7"], max_context_tokens=max_context_tokens)
    workload = make_workload("W7", shape=shape, concurrency=8)
    largest_turn = shape.tool_result_tokens[1] + shape.output_tokens[1] + 64  # + the call and template
    for request in workload.requests:
        context = sum(request.turn_num_tokens) + sum(request.turn_max_tokens)
        assert max_context_tokens - largest_turn < context <= max_context_tokens
        assert request.max_context_tokens == max_context_tokens


def test_w7_think_times_are_seeded_exponential_draws_that_leave_the_rest_alone():
    """The pause before each turn (none before the first): the same draws scaled by the mean, so
    another mean changes nothing else; their mean is near the mean asked for; 0 is a closed loop."""
    shapes = {mean: dataclasses.replace(SHAPES["W7"], think_time_s=mean) for mean in (0.0, 2.0, 4.0)}
    runs = {mean: make_workload("W7", shape=shape, concurrency=8).requests for mean, shape in shapes.items()}
    for request, closed, doubled in zip(runs[2.0], runs[0.0], runs[4.0], strict=True):
        assert request.turns == closed.turns == doubled.turns
        assert request.turn_max_tokens == closed.turn_max_tokens == doubled.turn_max_tokens
        assert request.turn_think_s[0] == 0 and set(closed.turn_think_s) == {0.0}
        assert doubled.turn_think_s == pytest.approx([2 * pause for pause in request.turn_think_s])
    draws = [pause for request in runs[2.0] for pause in request.turn_think_s[1:]]
    assert len(draws) > 100 and min(draws) > 0
    # An exponential's mean over n draws has a standard deviation of mean / sqrt(n): 3 of them.
    assert abs(sum(draws) / len(draws) - 2.0) < 3 * 2.0 / len(draws) ** 0.5


@pytest.mark.parametrize(
    "change, message",
    [
        ({"max_context_tokens": 2000}, "max_context_tokens 2000 is below a session's first turn"),
        ({"think_time_s": -1.0}, "think_time_s must be >= 0"),
        ({"tool_result_tokens": (0, 10)}, "tool_result_tokens range must satisfy 1 <= low"),
    ],
)
def test_w7_bad_shapes_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        make_workload("W7", shape=dataclasses.replace(SHAPES["W7"], **change))


def test_w7_flags_on_another_workload_are_refused_by_name(capsys):
    status = bench_main(
        ["serve", "--base-url", "http://127.0.0.1:9", "--workload", "W5", "--think-time-s", "1"]
    )
    assert status == 1
    assert "--think-time-s is for agent sessions (W7); W5 has none" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["W5", "W7"])
def test_engine_only_refuses_conversations_before_loading_anything(name, tmp_path, capsys):
    """Their turns send the server's replies back as chat text: `bench serve` runs them. The
    engine config is not even read (the file does not exist)."""
    argv = ["engine-only", "--engine-config", str(tmp_path / "absent.json"), "--workload", name]
    assert bench_main(argv) == 1
    error = capsys.readouterr().err
    assert f"{name} is a conversation workload" in error and "infer bench serve" in error
