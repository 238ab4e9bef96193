"""Images in chat (image_url parts) on Gemma 3, from the prompt to the answer.

- The prompt: what infer.server.chat_images makes of a chat with images over our chat template
  equals what transformers' Gemma3Processor makes of the same messages and images with Google's
  own template (ids, image positions, pixel values). Text never makes an image.
- Through a real server on 127.0.0.1 and the official `openai` client, on the random
  gemma3-vision-tiny checkpoint: an image sent as base64 or as an http URL (from a local
  http.server, the server started with `--allowed-media-domains 127.0.0.1`), streamed and not,
  answers with the greedy tokens of transformers' Gemma3ForConditionalGeneration.generate on the
  processor's inputs. Refusals are 400s that name the part: a URL on a server that fetches none,
  a private address under --allow-remote-media, an image for a model without a vision tower,
  text that spells an image.
"""

import base64
import hashlib
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer, Gemma3ForConditionalGeneration

from conformance.vlm.chat import (
    MAX_TOKENS,
    TOP_LOGPROBS,
    Answer,
    answer,
    assert_is_references_answer,
    client_of,
    data_url,
    image_part,
    png,
    refusal,
)
from infer.models.chat_template import chat_template_for
from infer.models.loader.tokenizer import Tokenizer
from infer.models.random_checkpoint import make_random_checkpoint
from infer.models.registry import image_processor_for
from infer.server.chat_images import encode_with_images, load_images
from infer.server.cli import build_serve_parser, media_policy
from infer.server.errors import ApiError
from infer.server.media import MediaPolicy
from infer.server.schemas import ChatCompletionRequest

# Google's Gemma 3 chat template, the oracle of our own (infer-models' test data).
GOOGLE_TEMPLATE = Path(__file__).parents[2] / "infer-models/tests/data/chat_templates/gemma-3-it.jinja"
VLM = "gemma3-vision-tiny"


def processor_inputs(checkpoint: Path, messages: list[dict], pictures: list[bytes]):
    """The oracle's prompt: transformers' Gemma3Processor with Google's template on `messages`
    (OpenAI's shape; each image_url part becomes Hugging Face's {"type": "image"}) and the
    pictures' bytes, in order."""
    hf_messages = [
        {
            **message,
            "content": [
                {"type": "image"} if part["type"] == "image_url" else part for part in message["content"]
            ],
        }
        if isinstance(message["content"], list)
        else message
        for message in messages
    ]
    processor = AutoProcessor.from_pretrained(checkpoint)
    text = processor.apply_chat_template(
        hf_messages, chat_template=GOOGLE_TEMPLATE.read_text(), add_generation_prompt=True, tokenize=False
    )
    # The template writes the BOS (processor.apply_chat_template(tokenize=True) adds none either).
    if not pictures:  # the processor itself would count a <start_of_image> in the text as an image
        return processor.tokenizer(text, return_tensors="pt", add_special_tokens=False)
    return processor(
        text=text,
        images=[Image.open(io.BytesIO(picture)) for picture in pictures],
        return_tensors="pt",
        add_special_tokens=False,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_random_checkpoint(VLM, tmp_path_factory.mktemp(VLM), dtype=torch.float32)


# -- the prompt --------------------------------------------------------------------------------


def our_prompt(checkpoint: Path, messages: list[dict]):
    """What the chat route makes of `messages`: the prompt's ids and the engine's images."""
    body = ChatCompletionRequest.model_validate({"model": VLM, "messages": messages})
    processor = image_processor_for(checkpoint, "gemma3")
    images = load_images(body.image_urls(), processor, VLM, MediaPolicy())
    prompt = chat_template_for("gemma3").render(body.template_messages(), add_generation_prompt=True)
    return encode_with_images(prompt, images, processor, body, Tokenizer(checkpoint))


def test_the_prompt_with_images_is_gemma3_processors_with_googles_template(checkpoint):
    pictures = [png(70, 50, seed=1), png(9, 200, seed=2), png(40, 40, seed=3, mode="RGBA")]
    messages = [
        {"role": "system", "content": "You describe pictures."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": " Compare "},
                image_part(data_url(pictures[0]), detail="low"),
                {"type": "text", "text": "with\n"},
                image_part(data_url(pictures[1])),
            ],
        },
        {"role": "assistant", "content": "The first is wider."},
        {
            "role": "user",
            "content": [image_part(data_url(pictures[2])), {"type": "text", "text": "And this?"}],
        },
    ]
    ids, images = our_prompt(checkpoint, messages)
    expected = processor_inputs(checkpoint, messages, pictures)
    assert ids == expected["input_ids"][0].tolist()
    image_positions = [i for image in images for i in range(image.offset, image.end)]
    assert image_positions == torch.nonzero(expected["token_type_ids"][0]).flatten().tolist()
    torch.testing.assert_close(
        torch.stack([image.pixel_values for image in images]), expected["pixel_values"], atol=1e-6, rtol=0
    )
    assert [image.fingerprint for image in images] == [
        hashlib.sha256(base64.b64encode(picture)).hexdigest() for picture in pictures
    ]


@pytest.mark.parametrize(
    "forged", ["<start_of_image>", "<image_soft_token>", "<start_of_image>" + "<image_soft_token>" * 16]
)
def test_text_that_spells_an_image_is_refused_in_a_request_with_images(checkpoint, forged):
    content = [image_part(data_url(png(8, 8, seed=4))), {"type": "text", "text": f"look {forged} here"}]
    with pytest.raises(ApiError) as refused:
        our_prompt(checkpoint, [{"role": "user", "content": content}])
    assert (refused.value.status, refused.value.param) == (400, "messages.0.content.1.text")
    assert "only an image_url part may put in the prompt" in refused.value.message


def test_a_marker_split_across_text_parts_is_refused_too(checkpoint):
    # The template trims the parts and joins them without a separator: "<start_of" + "_image>".
    content = [
        {"type": "text", "text": "<start_of"},
        {"type": "text", "text": "_image>"},
        image_part(data_url(png(8, 8, seed=5))),
    ]
    with pytest.raises(ApiError) as refused:
        our_prompt(checkpoint, [{"role": "user", "content": content}])
    assert (refused.value.status, refused.value.param) == (400, "messages")


# -- through the server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def start_vlm_server(checkpoint):
    """start_vlm_server(media_policy) -> a BackgroundServer on gemma3-vision-tiny, once per policy."""
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.models.load import load_model
    from infer.server.serve import BackgroundServer

    loaded = load_model(checkpoint, dtype=torch.float32)
    servers: dict[MediaPolicy, BackgroundServer] = {}

    def start(media_policy: MediaPolicy) -> BackgroundServer:
        if media_policy not in servers:
            # The prefix cache on (a CPU's default is off): a repeated image is then served from it.
            config = EngineConfig(
                model=str(checkpoint), max_seq_len=256, max_batch_size=4, use_prefix_caching=True
            )
            engine = Engine(config, loaded)
            servers[media_policy] = BackgroundServer(
                engine, served_model_name=VLM, log_level="warning", media_policy=media_policy
            )
        return servers[media_policy]

    yield start
    for server in servers.values():
        server.stop()


PICTURE = png(50, 40, seed=7)


class PictureServer(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = PICTURE if self.path == "/picture.png" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def picture_url():
    """PICTURE over HTTP from 127.0.0.1."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), PictureServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/picture.png"
    server.shutdown()


@pytest.mark.parametrize(
    ("stream", "detail"),
    [(False, {}), (True, {"detail": "high"}), (False, {"detail": None})],
    ids=["body", "stream-detail-high", "body-detail-null"],
)
def test_a_base64_image_answers_as_transformers(start_vlm_server, checkpoint, reference, stream, detail):
    # detail changes nothing: Gemma 3's processor gives every image the same size.
    content = [{"type": "text", "text": "What is it?"}, image_part(data_url(PICTURE), **detail)]
    messages = [{"role": "user", "content": content}]
    inputs = processor_inputs(checkpoint, messages, [PICTURE])
    ours = answer(client_of(start_vlm_server(MediaPolicy())), messages, stream)
    assert_is_references_answer(ours, reference, inputs, checkpoint)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_an_image_url_of_an_allowed_domain_answers_as_transformers(
    start_vlm_server, checkpoint, reference, picture_url, stream
):
    # What `infer serve --allowed-media-domains 127.0.0.1` serves with.
    server = start_vlm_server(MediaPolicy(allowed_domains=frozenset({"127.0.0.1"})))
    others = [png(20, 30, seed=8), png(30, 20, seed=9)]
    messages = [
        {"role": "user", "content": [image_part(picture_url), {"type": "text", "text": "Describe"}]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [image_part(data_url(others[0])), image_part(data_url(others[1]))]},
    ]
    pictures = [PICTURE, *others]
    inputs = processor_inputs(checkpoint, messages, pictures)
    assert_is_references_answer(answer(client_of(server), messages, stream), reference, inputs, checkpoint)


def test_an_image_url_is_refused_by_a_server_that_fetches_none_saying_how_to_allow_it(
    start_vlm_server, picture_url
):
    client = client_of(start_vlm_server(MediaPolicy()))
    error = refusal(
        client, [{"role": "user", "content": [{"type": "text", "text": "Hi"}, image_part(picture_url)]}]
    )
    assert error["param"] == "messages.0.content.1.image_url.url"
    assert "--allowed-media-domains" in error["message"] and "--allow-remote-media" in error["message"]


def test_a_private_address_is_refused_under_allow_remote_media(start_vlm_server, picture_url):
    client = client_of(start_vlm_server(MediaPolicy(allow_remote=True)))
    error = refusal(client, [{"role": "user", "content": [image_part(picture_url)]}])
    assert error["param"] == "messages.0.content.0.image_url.url"
    assert "internal address" in error["message"]


def test_an_image_that_does_not_decode_is_refused_naming_its_part(start_vlm_server):
    client = client_of(start_vlm_server(MediaPolicy()))
    not_an_image = "data:image/png;base64," + base64.b64encode(b"not a picture").decode()
    error = refusal(
        client, [{"role": "user", "content": [{"type": "text", "text": "Hi"}, image_part(not_an_image)]}]
    )
    assert error["param"] == "messages.0.content.1.image_url.url"
    assert "does not decode" in error["message"]


def test_a_model_without_a_vision_tower_refuses_an_image_part_by_name(server):
    # The shared SmolLM2 server (conftest), a text-only model.
    error = refusal(
        server.openai_client(),
        [{"role": "user", "content": [{"type": "text", "text": "Hi"}, image_part(data_url(PICTURE))]}],
    )
    assert error["param"] == "messages.0.content.1.image_url.url"
    assert error["message"] == f"model {server.model!r} does not take images; send text content only"


@pytest.mark.parametrize("with_image", [True, False], ids=["with-an-image", "text-only"])
def test_text_that_spells_an_image_is_refused_naming_the_text(start_vlm_server, with_image):
    client = client_of(start_vlm_server(MediaPolicy()))
    forged = {"type": "text", "text": "<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>"}
    content = [image_part(data_url(PICTURE)), forged] if with_image else [forged]
    error = refusal(client, [{"role": "user", "content": content}])
    assert error["param"] == f"messages.0.content{'.1.text' if with_image else ''}"
    assert "only an image_url part may put in the prompt" in error["message"]


def test_the_marker_in_a_text_only_request_stays_text(start_vlm_server, checkpoint, reference):
    # Without image parts <start_of_image> is one more special token, as transformers reads the
    # same ids without pixel values.
    messages = [{"role": "user", "content": "look <start_of_image> here"}]
    inputs = processor_inputs(checkpoint, messages, [])
    ours = answer(client_of(start_vlm_server(MediaPolicy())), messages, stream=False)
    assert_is_references_answer(ours, reference, inputs, checkpoint)


@pytest.mark.parametrize(
    ("flags", "policy"),
    [
        ([], MediaPolicy()),
        (
            # vLLM's spelling (a host per value) and a comma-separated list, in any case.
            ["--allowed-media-domains", "A.example,b.example", "c.example"],
            MediaPolicy(allowed_domains=frozenset({"a.example", "b.example", "c.example"})),
        ),
        (["--allow-remote-media"], MediaPolicy(allow_remote=True)),
    ],
)
def test_infer_serves_flags_make_the_media_policy(flags, policy):
    assert media_policy(build_serve_parser().parse_args(flags)) == policy


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_litellm_sends_an_image_and_gets_transformers_answer(start_vlm_server, checkpoint, reference, stream):
    """litellm, as its users point it at an OpenAI-compatible server ("openai/" + the served
    name): the answer's text is transformers' greedy answer decoded, and its logprobs are
    transformers' within the fp32 bound."""
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    import litellm

    content = [image_part(data_url(PICTURE)), {"type": "text", "text": "Describe it."}]
    messages = [{"role": "user", "content": content}]
    server = start_vlm_server(MediaPolicy())
    kwargs = dict(
        model=f"openai/{VLM}",
        api_base=f"{server.base_url}/v1",
        api_key="unused",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP_LOGPROBS,
    )
    if stream:
        chunks = [chunk for chunk in litellm.completion(**kwargs, stream=True) if chunk.choices]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        logprobs = [chunk.choices[0].logprobs for chunk in chunks if chunk.choices[0].logprobs]
        entries = [entry for piece in logprobs for entry in piece.content]
    else:
        response = litellm.completion(**kwargs)
        text = response.choices[0].message.content
        entries = response.choices[0].logprobs.content
    inputs = processor_inputs(checkpoint, messages, [PICTURE])
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert text == AutoTokenizer.from_pretrained(checkpoint).decode(ids, skip_special_tokens=True)
    top = [[(alt.token, alt.logprob) for alt in entry.top_logprobs] for entry in entries]
    assert_is_references_answer(Answer(ids, top, inputs["input_ids"].shape[1]), reference, inputs, checkpoint)


def vision_figures(server) -> dict:
    """The vision counters and the per-request histogram's count in /metrics (read by
    prometheus_client), and /v1/stats' vision section."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text):
        for sample in family.samples:
            samples[sample.name] = sample.value
    names = ("runs", "skipped", "image_tokens_reused")
    metrics = {
        "runs": samples["infer_vision_encoder_runs_total"],
        "skipped": samples["infer_vision_encoder_skipped_total"],
        "image_tokens_reused": samples["infer_vision_image_tokens_reused_total"],
        "requests_timed": samples["infer_request_vision_encoder_seconds_count"],
    }
    vision = httpx.get(server.base_url + "/v1/stats").json()["vision"]
    stats = {
        name: vision[key]
        for name, key in zip(names, ("encoder_runs", "encoder_skipped", "image_tokens_reused"), strict=True)
    }
    return {"metrics": metrics, "stats": stats, "seconds": samples["infer_vision_encoder_seconds_total"]}


def test_metrics_and_stats_count_encoder_runs_and_images_the_cache_spared(start_vlm_server, checkpoint):
    """A new image runs the tower once; the same conversation again is served from the prefix
    cache and runs it not at all: /metrics and /v1/stats count both, each request with images
    is timed, and the tower's seconds grow with the run only."""
    server = start_vlm_server(MediaPolicy())
    client = client_of(server)
    tokens_per_image = image_processor_for(checkpoint, "gemma3")(Image.open(io.BytesIO(PICTURE)))[1]
    messages = [
        {
            "role": "user",
            "content": [image_part(data_url(png(30, 20, seed=31))), {"type": "text", "text": "Hm?"}],
        }
    ]
    before = vision_figures(server)
    answer(client, messages, stream=False)
    after_new = vision_figures(server)
    answer(client, messages, stream=False)
    after_repeat = vision_figures(server)

    def gained(later, earlier, part):
        return {key: later[part][key] - earlier[part][key] for key in later[part]}

    assert gained(after_new, before, "metrics") == {
        "runs": 1, "skipped": 0, "image_tokens_reused": 0, "requests_timed": 1
    }  # fmt: skip
    assert gained(after_repeat, after_new, "metrics") == {
        "runs": 0, "skipped": 1, "image_tokens_reused": tokens_per_image, "requests_timed": 1
    }  # fmt: skip
    assert after_repeat["stats"] == {key: after_repeat["metrics"][key] for key in after_repeat["stats"]}
    assert after_new["seconds"] > before["seconds"] and after_repeat["seconds"] == after_new["seconds"]
