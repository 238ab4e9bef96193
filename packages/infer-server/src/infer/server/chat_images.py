"""A chat request's images, from its image_url parts to the engine's `PromptImage`s.

1. `load_images`: each part's URL is decoded (infer.server.media, under the server's
   MediaPolicy) and run through the model's ImageProcessor (infer.models.vision): pixel values
   and a placeholder count. A model without a vision tower, too many images, or an image the
   server will not take: a 400 naming the part.
2. `encode_with_images` (every chat prompt; a text model's is only tokenized): the chat template
   wrote the model's marker (`layout.marker`) for each image part, in order; each is widened into
   the text the model's own processor puts there (`layout.expansion(num_tokens)`: for Gemma 3, a
   blank line, `<start_of_image>`, the placeholders, `<end_of_image>`, a blank line), the text is
   tokenized, and each image is paired with its run of placeholder tokens (`image_runs`): the
   prompt's ids and the engine's images.

Text never makes an image. The placeholder token belongs to images (the engine refuses a prompt
that holds it elsewhere), so text that spells it is refused, naming the text; in a request with
images, so is text that spells the marker, which the rendered prompt could not tell from an image
part's. Without images the marker is only text.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.engine.images import PromptImage
from infer.models.vision import ImageLayout, ImageProcessor, image_runs
from infer.server import errors
from infer.server.errors import ApiError
from infer.server.media import MediaError, MediaPolicy, check_image_count, load_image
from infer.server.schemas import ChatMessages, TextPart


@dataclass(frozen=True)
class ChatImage:
    """One image part, ready for the prompt: its tower input and how many tokens it takes."""

    fingerprint: str  # infer.server.media's: keys the prefix cache
    pixel_values: torch.Tensor
    num_tokens: int


def load_images(
    image_urls: Sequence[tuple[str, str]], processor: ImageProcessor | None, model: str, policy: MediaPolicy
) -> list[ChatImage]:
    """Each (param, URL) of `ChatMessages.image_urls()` decoded and preprocessed, in order.
    Blocks (decoding, and fetching where the policy allows it): run it off the event loop."""
    if not image_urls:
        return []
    if processor is None:
        first_param = image_urls[0][0]
        message = f"model {model!r} does not take images; send text content only"
        raise ApiError(400, message, errors.INVALID_REQUEST, first_param, "unsupported_value")
    try:
        check_image_count(len(image_urls))
        return [_load_image(param, url, processor, policy) for param, url in image_urls]
    except MediaError as error:
        raise ApiError(400, error.message, errors.INVALID_REQUEST, error.param, "invalid_value") from None


def _load_image(param: str, url: str, processor: ImageProcessor, policy: MediaPolicy) -> ChatImage:
    decoded = load_image(url, param, policy)
    try:
        pixel_values, num_tokens = processor(decoded.image)
    except (ValueError, OSError) as error:  # Pillow read the pixels but could not resize them
        raise MediaError(f"the image does not decode: {error}", param) from None
    return ChatImage(decoded.fingerprint, pixel_values, num_tokens)


def encode_with_images(
    prompt: str,
    images: Sequence[ChatImage],
    processor: ImageProcessor | None,
    body: ChatMessages,
    tokenizer,
    *,
    add_special_tokens: bool = False,
) -> tuple[list[int], list[PromptImage]]:
    """The ids of a rendered chat prompt (`tokenizer`: infer.models' Tokenizer) with its images
    widened, and the images over their placeholder runs; for a model without a vision tower
    (`processor` None) the prompt's ids alone. ApiError 400 when the request's text spells an
    image. The rendered text holds the BOS the template wants: `add_special_tokens` (the
    tokenizer's own on top, as /tokenize may ask) is off by default."""
    if processor is None:  # load_images refused any image part already
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens), []
    layout = processor.layout
    # The template writes one marker per image part: any more came from text. Outside them the
    # placeholder is text's (a marker may hold it: Qwen's does).
    outside_markers = prompt.replace(layout.marker, "") if images else prompt
    if layout.image_token in outside_markers or (images and prompt.count(layout.marker) > len(images)):
        raise _spelled_in_text(body, layout, bool(images))
    if images:
        pieces = prompt.split(layout.marker)
        widened = zip(images, pieces[1:], strict=True)
        prompt = pieces[0] + "".join(layout.expansion(image.num_tokens) + piece for image, piece in widened)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return prompt_ids, _prompt_images(prompt_ids, images, layout)


def _prompt_images(
    prompt_ids: list[int], images: Sequence[ChatImage], layout: ImageLayout
) -> list[PromptImage]:
    """The engine's images: each one's run of placeholder tokens in `prompt_ids`, in order."""
    runs = image_runs(prompt_ids, layout.image_token_id)
    if [length for _, length in runs] != [image.num_tokens for image in images]:
        # The text spells no placeholder (checked above), so the tokenizer does not spell it as
        # its one token: a checkpoint whose images this server cannot place.
        raise RuntimeError(
            f"the prompt's placeholder runs {runs} do not match the images' token counts "
            f"{[image.num_tokens for image in images]}: does the tokenizer spell {layout.image_token!r} "
            f"as token {layout.image_token_id}?"
        )
    return [
        PromptImage(offset, image.num_tokens, image.pixel_values, image.fingerprint)
        for (offset, _), image in zip(runs, images, strict=True)
    ]


def _spelled_in_text(body: ChatMessages, layout: ImageLayout, with_images: bool) -> ApiError:
    """The 400 for text that spells an image, naming the first message text that does."""
    spellings = [layout.image_token, layout.marker] if with_images else [layout.image_token]

    def spells(text: str) -> bool:
        return any(spelling in text for spelling in spellings)

    # Text parts can also spell it together (the template joins them): then no one part is named.
    param = "messages"
    for message_index, message in enumerate(body.messages):
        if isinstance(message.content, str) and spells(message.content):
            param = f"messages.{message_index}.content"
            break
        parts = message.content if isinstance(message.content, list) else []
        spelled = [
            index for index, part in enumerate(parts) if isinstance(part, TextPart) and spells(part.text)
        ]
        if spelled:
            param = f"messages.{message_index}.content.{spelled[0]}.text"
            break
    return ApiError(
        400,
        f"the text spells {' or '.join(map(repr, spellings))}, which only an image_url part may put in "
        "the prompt; remove it from the text",
        errors.INVALID_REQUEST,
        param,
        "invalid_value",
    )
