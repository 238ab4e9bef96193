"""Images in chat on Qwen3-VL, through a real server on 127.0.0.1 and the official `openai`
client, on the random qwen3-vl-tiny checkpoint (an image resized to between 16 x 16 and 48 x 48
pixels, 4 to 36 tokens).

The oracle is transformers: its Qwen3VLProcessor (the checkpoint's tokenizer and image processor)
widens each `<|vision_start|><|image_pad|><|vision_end|>` of the prompt text into the image's
pads, over the text that Qwen's official Qwen 3 template (infer-models' test data) renders with
each image part spelled as Qwen3-VL's template spells it; its Qwen3VLForConditionalGeneration
answers greedily. A chat with two base64 images of different sizes in one message, streamed and
not: the prompt the server feeds its engine (ids, each image's pixels and place) is the
processor's, and the answer's tokens and top logprobs are transformers' `generate`'s. Text that
types the image pad is refused with a 400 that names the text part.
"""

import io
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from conformance.vlm.chat import (
    answer,
    assert_is_references_answer,
    client_of,
    data_url,
    image_part,
    png,
    refusal,
)
from infer.models.qwen3_vl_vision import patchify
from infer.models.random_checkpoint import make_random_checkpoint

# Qwen's Qwen 3 chat template (infer-models' test data); Qwen3-VL's renders the same text for
# these chats, an image part spelled QWEN_VL_IMAGE.
QWEN3_TEMPLATE = Path(__file__).parents[2] / "infer-models/tests/data/chat_templates/qwen3-0.6b.jinja"
QWEN_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VLM = "qwen3-vl-tiny"


# png, data_url, image_part, client_of, Answer, answer, assert_is_references_answer and refusal
# are test_app_images.py's (Gemma 3), which pytest's importlib mode keeps from being imported here.


# Different sizes and aspect ratios: resized to 40 x 48 pixels (30 tokens) and 32 x 16 (8 tokens).
PICTURES = [png(50, 40, seed=11), png(20, 30, seed=12)]


class ImageQwen3VLProcessor(Qwen3VLProcessor):
    """transformers' Qwen3VLProcessor without its video processor, which needs torchvision (not
    in the test environment); the chats here hold no video."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def processor_inputs(checkpoint: Path, messages: list[dict], pictures: list[bytes]):
    """The oracle's prompt: Qwen3VLProcessor over the official template's text of `messages`
    (OpenAI's shape) and the pictures' bytes, in order."""
    spelled = [
        {
            **message,
            "content": "".join(
                QWEN_VL_IMAGE if part["type"] == "image_url" else part["text"] for part in message["content"]
            ),
        }
        if isinstance(message["content"], list)
        else message
        for message in messages
    ]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(
        spelled, chat_template=QWEN3_TEMPLATE.read_text(), add_generation_prompt=True, tokenize=False
    )
    processor = ImageQwen3VLProcessor(
        image_processor=AutoImageProcessor.from_pretrained(checkpoint), tokenizer=tokenizer
    )
    images = [Image.open(io.BytesIO(picture)) for picture in pictures]
    return processor(text=text, images=images, return_tensors="pt")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_random_checkpoint(VLM, tmp_path_factory.mktemp(VLM), dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(checkpoint):
    """A BackgroundServer on qwen3-vl-tiny; `server.fed` lists the (prompt ids, images) of each
    request its engine was given."""
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.models.load import load_model
    from infer.server.serve import BackgroundServer

    engine = Engine(
        EngineConfig(model=str(checkpoint), max_seq_len=512, max_batch_size=4),
        load_model(checkpoint, dtype=torch.float32),
    )
    fed = []
    add_request = engine.add_request

    def recording_add_request(prompt, *args, images=(), **kwargs):
        fed.append((list(prompt), list(images)))
        return add_request(prompt, *args, images=images, **kwargs)

    engine.add_request = recording_add_request
    background = BackgroundServer(engine, served_model_name=VLM, log_level="warning")
    background.fed = fed
    yield background
    background.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_two_images_of_different_sizes_in_one_message_answer_as_transformers(
    server, checkpoint, reference, stream
):
    messages = [
        {"role": "system", "content": "You compare pictures."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Is "},
                image_part(data_url(PICTURES[0])),
                {"type": "text", "text": " wider than "},
                image_part(data_url(PICTURES[1]), detail="low"),
                {"type": "text", "text": "?"},
            ],
        },
    ]
    inputs = processor_inputs(checkpoint, messages, PICTURES)
    ours = answer(client_of(server), messages, stream)

    prompt_ids, images = server.fed[-1]
    assert prompt_ids == inputs["input_ids"][0].tolist()
    image_positions = [i for image in images for i in range(image.offset, image.end)]
    assert image_positions == torch.nonzero(inputs["mm_token_type_ids"][0]).flatten().tolist()
    # Each image's pixels, cut into transformers' patches: the processor's pixel_values and grid.
    vision = reference.config.vision_config
    sizes = (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
    patches, grids = zip(*(patchify(image.pixel_values, *sizes) for image in images), strict=True)
    assert [list(grid) for grid in grids] == inputs["image_grid_thw"].tolist() == [[1, 10, 12], [1, 8, 4]]
    torch.testing.assert_close(torch.cat(patches), inputs["pixel_values"], atol=1e-6, rtol=0)

    assert_is_references_answer(ours, reference, inputs, checkpoint)


@pytest.mark.parametrize("with_image", [True, False], ids=["with-an-image", "text-only"])
def test_text_that_types_the_image_pad_is_refused_naming_the_text(server, with_image):
    forged = {"type": "text", "text": "look <|image_pad|> here"}
    content = [image_part(data_url(PICTURES[1])), forged] if with_image else [forged]
    error = refusal(client_of(server), [{"role": "user", "content": content}])
    assert error["param"] == f"messages.0.content{'.1.text' if with_image else ''}"
    assert "'<|image_pad|>'" in error["message"] and "only an image_url part may put in" in error["message"]
