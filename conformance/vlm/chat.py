"""Chats with images against a real server, for the vision-language server tests: PNG pictures
as data: URLs, the official openai client's greedy answers with their logprobs, and the check
that an answer is transformers' (`assert_is_references_answer`)."""

import base64
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from PIL import Image

MAX_TOKENS = 8
TOP_LOGPROBS = 20
# specs/parity/tolerances.yaml's float32 max_abs: a logprob against transformers' log-softmax.
FP32_MAX_ABS = 1e-3


def png(width: int, height: int, seed: int, mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: str, **image_url) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **image_url}}


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"{server.base_url}/v1", max_retries=0, timeout=120.0)


def served_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@dataclass
class Answer:
    token_ids: list[int]
    # Per token, the TOP_LOGPROBS most likely tokens: (the token decoded alone, its logprob).
    top_logprobs: list[list[tuple[str, float]]]
    prompt_tokens: int


def answer(client: openai.OpenAI, messages: list[dict], stream: bool) -> Answer:
    """A greedy chat answer with its logprobs, from one body or a stream's chunks."""
    kwargs = dict(model=served_model(client), messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    kwargs |= dict(logprobs=True, top_logprobs=TOP_LOGPROBS)
    if stream:
        *pieces, usage_chunk = client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        choices, prompt_tokens = [chunk.choices[0] for chunk in pieces], usage_chunk.usage.prompt_tokens
    else:
        body = client.chat.completions.create(**kwargs)
        choices, prompt_tokens = body.choices, body.usage.prompt_tokens
    token_ids = [token for choice in choices for token in getattr(choice, "token_ids", None) or []]
    entries = [entry for choice in choices for entry in (choice.logprobs.content if choice.logprobs else [])]
    top_logprobs = [[(top.token, top.logprob) for top in entry.top_logprobs] for entry in entries]
    return Answer(token_ids, top_logprobs, prompt_tokens)


def assert_is_references_answer(answer: Answer, reference, inputs, checkpoint: Path) -> None:
    """The answer is transformers' greedy one to the processor's `inputs`: the same prompt length,
    tokens, and log-softmax at each of the answer's alternatives within the fp32 parity bound. A
    random model's greedy tokens hardly depend on the images (its tied embeddings make it repeat
    the prompt's last token); the alternatives' logprobs do."""
    from transformers import AutoTokenizer

    with torch.no_grad():
        out = reference.generate(
            **inputs,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert answer.prompt_tokens == inputs["input_ids"].shape[1]
    assert answer.token_ids == out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids_of = {}
    for token_id in range(len(tokenizer)):
        ids_of.setdefault(tokenizer.decode([token_id]), []).append(token_id)
    for step, (alternatives, logits) in enumerate(zip(answer.top_logprobs, out.logits, strict=True)):
        expected = logits[0].log_softmax(-1)
        assert len(alternatives) == TOP_LOGPROBS
        for text, logprob in alternatives:
            # A lone byte of a multi-byte character reads U+FFFD for any of them: the nearest.
            gap = min(abs(logprob - expected[token_id].item()) for token_id in ids_of[text])
            assert gap <= FP32_MAX_ABS, f"step {step}, token {text!r}: {logprob} against {expected}"


def refusal(client: openai.OpenAI, messages: list[dict]) -> dict:
    """The 400 body the server answers `messages` with."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=served_model(client), messages=messages, max_tokens=2)
    assert refused.value.status_code == 400
    return refused.value.body
