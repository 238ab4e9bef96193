"""Workloads W1-W6: the same arguments give the same requests, and lengths stay in their ranges."""

import base64
import dataclasses
import io

import pytest
from PIL import Image

from infer.bench.serving.workloads import SHAPES, make_workload, untimed_stand_in
from infer.models.random_checkpoint import COMMON_WORDS


@pytest.mark.parametrize("name", ["W1", "W2", "W3", "W6"])
def test_same_seed_gives_the_same_requests(name):
    assert make_workload(name, seed=3).requests == make_workload(name, seed=3).requests


@pytest.mark.parametrize("name", ["W2", "W3", "W6"])
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
    from infer.bench.serving.cli import main as bench_main

    status = bench_main(
        ["serve", "--base-url", "http://127.0.0.1:9", "--workload", "W2", "--image-size", "64"]
    )
    assert status == 1
    assert "--image-size is for workloads with images (W6); W2 has none" in capsys.readouterr().err
