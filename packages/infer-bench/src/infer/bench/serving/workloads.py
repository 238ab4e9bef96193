"""The benchmark workloads W1-W7: seeded request lists that any OpenAI-compatible server can run.

W1  one request: a 256-token prompt, 256 output tokens (latency of one stream).
W2  mixed lengths: prompts of 32-1024 tokens and outputs of 64-256, uniform in each range.
W3  chat sharing one long system prompt (~768 words) with a short user turn each (8-64 words),
    outputs of 64-256 tokens: what a prefix cache is for.
W4  long-prompt pressure: streams of short prompts (64-128 tokens) decoding 256 tokens each, while
    every 4th request is a 4096-token prompt wanting 16 tokens. What chunked prefill is for: the
    inter-token latency of the streams while long prompts keep arriving.
W4-decode  the same streams with no long prompts: W4's decode-only baseline.
W5  multi-turn conversations (4-8 turns) over one system prompt (~300 words): each turn sends the
    whole conversation so far, the server's own earlier replies included, plus a new user turn
    (8-32 words), or, every 3rd turn, a tool result: the previous reply is taken to have called a
    tool (an assistant message with `tool_calls`) and a `tool` message answers it. Outputs of
    32-96 tokens. What a prefix cache's reuse across turns is for; the report counts the prompt
    tokens the server says it served from its cache (`usage.prompt_tokens_details.cached_tokens`).
W6  vision chat: one user message each, an image (a PNG `data:` URL of 896 x 896 pixels, its
    own per request) then a short question (8-16 words), outputs of 64-128 tokens. What the
    vision tower and the image-keyed prefix cache are for: `--passes 2` sends the same requests
    again, and the second pass should encode no image (infer.bench.vision).
W7  agent sessions (the issue's "W6, agent sessions"; W6 was taken by vision): `concurrency`
    sessions at once (8 or 32), each from one shared system-and-tools prompt of ~3000 tokens (tool
    definitions as JSON, then instructions) and a task of 16-64 words, then turn after turn a tool
    result of 500-2000 tokens, as W5's tool turns answer a call the previous reply is taken to
    have made; answers of 100-300 tokens a turn. A session grows until its next turn would pass
    `max_context_tokens` (32768), and pauses before each turn for a think time of its own
    (exponential, mean `think_time_s`, 2 s; 0: a closed loop), so a server's cache must keep the
    sessions that are idle. What a prefix cache holding many long, idle sessions is for.

Completion prompts are token id lists (the server takes a list of ints as `prompt`), so their
lengths are exact. The ids are uniform in [0, vocab_size); every supported family has at least
49152 ids, so the default 32000 is valid everywhere. They may include special tokens, which is
harmless: the model just runs them and `ignore_eos` keeps the output length fixed. Chat prompts
are text (words from a fixed list), so their token counts depend on the tokenizer; the client
reads them back from the server's `usage`.

A W6 image is an 8 x 8 grid of seeded random colours scaled up to the size (nearest neighbour):
it compresses to a few kB as PNG, so 128 of them are no burden on the client, while the server
decodes and preprocesses a full-size image. The pixels are seeded; the PNG bytes are Pillow's
encoding of them. The image comes before the question, so the text after it fills the image's
last KV block and a prefix-cache hit can cover the whole image.

A W5 or W7 request is a whole conversation: its client sends the turns one after another, each
when the previous reply has ended (W7: and its think time has passed), and every turn is timed as
a request of its own.

W7 sizes its text in tokens by `estimated_tokens`: one a word (each of COMMON_WORDS is one token
in real tokenizers and in the random checkpoints' but the tiny presets', which spell words byte by
byte) and one a punctuation mark (BPE vocabularies merge some, so JSON is overcounted), plus
TEMPLATE_TOKENS_PER_MESSAGE for each message's chat-template wrapping. A tool result of n tokens
is n words. A session's turns are planned with the estimate: one more while the next turn's
context (every prompt token, and max_tokens for every answer) stays within the cap. While it
runs, the client ends a session sooner where the server's own count says the next turn would
pass the cap: the previous turn's `usage.prompt_tokens` and output tokens, plus the new turn's
estimate (scaled where the server's tokenizer spells words in pieces) and max_tokens
(client.passes_context_cap).

Concurrency: a workload of `num_requests` requests is run by `concurrency` clients, each sending
its next request when its previous one has finished (a closed loop), so at most `concurrency`
requests are in flight. `num_requests` defaults to 2 x concurrency (W7: 1 x, a session per
client); with `num_requests == concurrency` every request is sent at once ("N concurrent"). W1 is
always 1 client, 1 request.

Everything is drawn from `random.Random(seed)`: the same (name, concurrency, num_requests, seed)
gives the same requests on every machine and Python version.
"""

import base64
import io
import json
import random
import re
from dataclasses import dataclass, field

from infer.models.random_checkpoint import COMMON_WORDS

DEFAULT_VOCAB_SIZE = 32000
REQUESTS_PER_CLIENT = 2
# Cells per side of a W6 image (see the module docstring).
IMAGE_GRID_CELLS = 8
# W7: the tokens a chat template wraps a message in (role markers, separators), as the estimate
# counts them: Llama 3 and ChatML spend 4-5; the rest is margin for a reply re-encoded as text.
TEMPLATE_TOKENS_PER_MESSAGE = 8
# W7's tools: (name, its one string parameter), described to the model as JSON in the system prompt.
AGENT_TOOLS = (
    ("search", "query"),
    ("open", "path"),
    ("run", "command"),
    ("list", "path"),
    ("fetch", "url"),
    ("edit", "change"),
)
_TOKEN_PIECES = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class WorkloadShape:
    """The length ranges of a workload; all ranges are inclusive (low, high)."""

    kind: str  # "completion": token-id prompts; "chat": messages
    prompt_tokens: tuple[int, int] = (0, 0)  # completion prompts
    output_tokens: tuple[int, int] = (1, 1)
    system_prompt_words: int = 0  # chat: one system prompt shared by every request
    user_words: tuple[int, int] = (0, 0)  # chat: each request's own user turn
    # Completion: every `long_prompt_every`-th request (0: none) has `long_prompt_tokens` prompt
    # tokens and `long_output_tokens` outputs instead of the ranges above.
    long_prompt_every: int = 0
    long_prompt_tokens: int = 0
    long_output_tokens: int = 1
    # Conversation: turns per conversation, and every `tool_turn_every`-th turn (0: none) a tool
    # result instead of a user turn.
    turns: tuple[int, int] = (1, 1)
    tool_turn_every: int = 0
    # Chat: each request's user message starts with an image of image_size x image_size pixels
    # (0: no image).
    image_size: int = 0
    # Agent sessions (kind "agent"): the shared system-and-tools prompt's tokens, each tool
    # result's, the context a session must stay within, and the mean pause before each turn.
    system_prompt_tokens: int = 0
    tool_result_tokens: tuple[int, int] = (0, 0)
    max_context_tokens: int = 0
    think_time_s: float = 0.0
    # num_requests by default: this many per client.
    requests_per_client: int = REQUESTS_PER_CLIENT

    @property
    def is_conversation(self) -> bool:
        """Each request is turns that send the server's replies back (W5, W7): no batch of
        independent prompts can stand for it."""
        return self.kind in ("conversation", "agent")


SHAPES: dict[str, WorkloadShape] = {
    "W1": WorkloadShape("completion", prompt_tokens=(256, 256), output_tokens=(256, 256)),
    "W2": WorkloadShape("completion", prompt_tokens=(32, 1024), output_tokens=(64, 256)),
    "W3": WorkloadShape("chat", output_tokens=(64, 256), system_prompt_words=768, user_words=(8, 64)),
    "W4": WorkloadShape(
        "completion",
        prompt_tokens=(64, 128),
        output_tokens=(256, 256),
        long_prompt_every=4,
        long_prompt_tokens=4096,
        long_output_tokens=16,
    ),
    "W4-decode": WorkloadShape("completion", prompt_tokens=(64, 128), output_tokens=(256, 256)),
    "W5": WorkloadShape(
        "conversation",
        output_tokens=(32, 96),
        system_prompt_words=300,
        user_words=(8, 32),
        turns=(4, 8),
        tool_turn_every=3,
    ),
    "W6": WorkloadShape("chat", output_tokens=(64, 128), user_words=(8, 16), image_size=896),
    "W7": WorkloadShape(
        "agent",
        output_tokens=(100, 300),
        user_words=(16, 64),
        system_prompt_tokens=3000,
        tool_result_tokens=(500, 2000),
        max_context_tokens=32768,
        think_time_s=2.0,
        requests_per_client=1,
    ),
}
# The concurrency levels the matrix runs for each workload.
CONCURRENCY_LEVELS: dict[str, tuple[int, ...]] = {
    "W1": (1,),
    "W2": (16, 64),
    "W3": (16, 64),
    "W4": (16, 64),
    "W4-decode": (16, 64),
    "W5": (16, 64),
    "W6": (16, 64),
    "W7": (8, 32),
}


@dataclass(frozen=True)
class BenchRequest:
    """One request: token ids for /v1/completions or messages for /v1/chat/completions (a
    message's content: text, or a list of OpenAI content parts)."""

    index: int
    max_tokens: int
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    # A conversation: the messages each turn adds (a `tool` message carries the `call` the
    # previous reply is taken to have made), and each turn's max_tokens (max_tokens: the first's).
    turns: tuple[tuple[dict, ...], ...] | None = None
    turn_max_tokens: tuple[int, ...] = ()
    # An agent session (W7): the tokens each turn adds to the prompt besides the replies (by
    # `estimated_tokens`, template wrapping included), the pause before each turn (the first's 0),
    # and the context the session stays within (None: no cap).
    turn_num_tokens: tuple[int, ...] = ()
    turn_think_s: tuple[float, ...] = ()
    max_context_tokens: int | None = None

    @property
    def endpoint(self) -> str:
        return "/v1/completions" if self.prompt_token_ids is not None else "/v1/chat/completions"

    @property
    def num_prompt_tokens(self) -> int | None:
        """Exact for token-id prompts; None for chat (the server's usage says)."""
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else None


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    seed: int
    requests: list[BenchRequest] = field(repr=False)
    shape: WorkloadShape = field(repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": self.shape.kind,
            "concurrency": self.concurrency,
            "num_requests": self.num_requests,
            "seed": self.seed,
            "prompt_tokens_range": list(self.shape.prompt_tokens),
            "output_tokens_range": list(self.shape.output_tokens),
            "system_prompt_words": self.shape.system_prompt_words,
            "user_words_range": list(self.shape.user_words),
            "turns_range": list(self.shape.turns),
            "tool_turn_every": self.shape.tool_turn_every,
            "image_size": self.shape.image_size,
            "system_prompt_tokens": self.shape.system_prompt_tokens,
            "tool_result_tokens_range": list(self.shape.tool_result_tokens),
            "max_context_tokens": self.shape.max_context_tokens,
            "think_time_s": self.shape.think_time_s,
            "planned_turns": sum(len(r.turns or ()) for r in self.requests),
            "total_max_tokens": sum(sum(r.turn_max_tokens) or r.max_tokens for r in self.requests),
        }


def make_workload(
    name: str,
    *,
    concurrency: int | None = None,
    seed: int = 0,
    num_requests: int | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    shape: WorkloadShape | None = None,
) -> Workload:
    """The requests of workload `name` (a key of SHAPES, or any name with an explicit `shape`).

    `concurrency` defaults to the workload's first level; `num_requests` to
    `shape.requests_per_client` x concurrency (W1: 1).
    """
    if shape is None:
        if name not in SHAPES:
            raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(SHAPES)}")
        shape = SHAPES[name]
    if name == "W1" and (concurrency or 1) != 1:
        raise ValueError(
            f"W1 is one request on its own; got concurrency {concurrency}, use 1 or leave it out"
        )
    concurrency = concurrency if concurrency is not None else CONCURRENCY_LEVELS.get(name, (1,))[0]
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if num_requests is None:
        num_requests = 1 if name == "W1" else shape.requests_per_client * concurrency
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    _check_range("output_tokens", shape.output_tokens, minimum=1)
    rng = random.Random(f"{name}:{seed}")
    if shape.kind == "completion":
        _check_range("prompt_tokens", shape.prompt_tokens, minimum=1)
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        requests = []
        for i in range(num_requests):
            is_long = (
                shape.long_prompt_every > 0 and i % shape.long_prompt_every == shape.long_prompt_every - 1
            )
            num_prompt = shape.long_prompt_tokens if is_long else rng.randint(*shape.prompt_tokens)
            prompt = [rng.randrange(vocab_size) for _ in range(num_prompt)]
            max_tokens = shape.long_output_tokens if is_long else rng.randint(*shape.output_tokens)
            requests.append(BenchRequest(index=i, prompt_token_ids=prompt, max_tokens=max_tokens))
    elif shape.kind == "chat":
        _check_range("user_words", shape.user_words, minimum=1)
        if shape.image_size < 0:
            raise ValueError(f"image_size must be >= 0 (0: no image), got {shape.image_size}")
        system_prompt = _words(rng, shape.system_prompt_words)
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        requests = []
        for i in range(num_requests):
            user = f"Request {i}: " + _words(rng, rng.randint(*shape.user_words))
            if shape.image_size:
                image = {"type": "image_url", "image_url": {"url": _image_url(rng, shape.image_size)}}
                content = [image, {"type": "text", "text": user}]
                messages = [*system, {"role": "user", "content": content}]
            else:
                messages = [*system, {"role": "user", "content": user}]
            requests.append(
                BenchRequest(index=i, messages=messages, max_tokens=rng.randint(*shape.output_tokens))
            )
    elif shape.kind == "conversation":
        _check_range("user_words", shape.user_words, minimum=1)
        _check_range("turns", shape.turns, minimum=1)
        system_prompt = _words(rng, shape.system_prompt_words)
        requests = [_conversation(rng, i, shape, system_prompt) for i in range(num_requests)]
    elif shape.kind == "agent":
        _check_agent_shape(shape)
        system_prompt = _agent_system_prompt(rng, shape.system_prompt_tokens)
        requests = [_agent_session(rng, i, shape, system_prompt) for i in range(num_requests)]
    else:
        raise ValueError(
            f"workload kind must be 'completion', 'chat', 'conversation' or 'agent', got {shape.kind!r}"
        )
    return Workload(name=name, concurrency=concurrency, seed=seed, requests=requests, shape=shape)


def _conversation(rng: random.Random, index: int, shape: WorkloadShape, system_prompt: str) -> BenchRequest:
    turns = []
    for turn in range(rng.randint(*shape.turns)):
        words = _words(rng, rng.randint(*shape.user_words))
        if turn and shape.tool_turn_every and turn % shape.tool_turn_every == 0:
            call = {"name": "lookup", "arguments": json.dumps({"query": words.split()[0]})}
            turns.append(({"role": "tool", "content": f"Result: {words}", "call": call},))
        else:
            user = {"role": "user", "content": f"Conversation {index}, turn {turn}: {words}"}
            system = ({"role": "system", "content": system_prompt},) if turn == 0 else ()
            turns.append((*system, user))
    max_tokens = tuple(rng.randint(*shape.output_tokens) for _ in turns)
    return BenchRequest(index=index, max_tokens=max_tokens[0], turns=tuple(turns), turn_max_tokens=max_tokens)


def estimated_tokens(text: str) -> int:
    """W7's token estimate of `text`: one a word, one a punctuation mark (see the module)."""
    return len(_TOKEN_PIECES.findall(text))


def _check_agent_shape(shape: WorkloadShape) -> None:
    _check_range("user_words", shape.user_words, minimum=1)
    _check_range("tool_result_tokens", shape.tool_result_tokens, minimum=1)
    if shape.think_time_s < 0:
        raise ValueError(f"think_time_s must be >= 0 (0: no pause), got {shape.think_time_s}")
    if shape.max_context_tokens < 1:
        raise ValueError(f"max_context_tokens must be >= 1, got {shape.max_context_tokens}")


def _agent_system_prompt(rng: random.Random, num_tokens: int) -> str:
    """The tool definitions as JSON, then instructions: words up to `num_tokens` by the estimate."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": _words(rng, rng.randint(12, 24)),
                "parameters": {
                    "type": "object",
                    "properties": {parameter: {"type": "string", "description": _words(rng, 6)}},
                    "required": [parameter],
                },
            },
        }
        for name, parameter in AGENT_TOOLS
    ]
    tools_section = "You may call these tools:\n" + json.dumps(tools) + "\n\n"
    return tools_section + _words(rng, max(0, num_tokens - estimated_tokens(tools_section)))


def _agent_session(rng: random.Random, index: int, shape: WorkloadShape, system_prompt: str) -> BenchRequest:
    """Turn 0: the system prompt and a task; then tool results, planned while the next turn's
    estimated context stays within the cap (see the module)."""
    task = f"Session {index}: " + _words(rng, rng.randint(*shape.user_words))
    turns = [({"role": "system", "content": system_prompt}, {"role": "user", "content": task})]
    # The system and user messages, and the generation prompt.
    num_tokens = [estimated_tokens(system_prompt) + estimated_tokens(task) + 3 * TEMPLATE_TOKENS_PER_MESSAGE]
    max_tokens = [rng.randint(*shape.output_tokens)]
    think_s = [0.0]
    context = num_tokens[0] + max_tokens[0]
    if context > shape.max_context_tokens:
        raise ValueError(
            f"max_context_tokens {shape.max_context_tokens} is below a session's first turn ({context} "
            f"tokens by the estimate: the system prompt, a task and {max_tokens[0]} to answer); raise it"
        )
    while True:
        name, parameter = rng.choice(AGENT_TOOLS)
        call = {"name": name, "arguments": json.dumps({parameter: rng.choice(COMMON_WORDS)})}
        result_tokens = rng.randint(*shape.tool_result_tokens)
        result = {"role": "tool", "content": _words(rng, result_tokens), "call": call}
        # The call, rendered in the previous reply's message, and the tool message.
        added = result_tokens + estimated_tokens(json.dumps(call)) + 2 * TEMPLATE_TOKENS_PER_MESSAGE
        answer_tokens = rng.randint(*shape.output_tokens)
        # Drawn as a unit exponential and scaled: the other draws are the same at any mean.
        pause_s = shape.think_time_s * rng.expovariate(1.0)
        if context + added + answer_tokens > shape.max_context_tokens:
            break
        turns.append((result,))
        num_tokens.append(added)
        max_tokens.append(answer_tokens)
        think_s.append(pause_s)
        context += added + answer_tokens
    return BenchRequest(
        index=index,
        max_tokens=max_tokens[0],
        turns=tuple(turns),
        turn_max_tokens=tuple(max_tokens),
        turn_num_tokens=tuple(num_tokens),
        turn_think_s=tuple(think_s),
        max_context_tokens=shape.max_context_tokens,
    )


def untimed_stand_in(workload: Workload) -> Workload:
    """What a benchmark's untimed requests (the client's warm-up: the first; its probe: the median
    by length) draw from: the workload itself, unless its requests carry images. A server's prefix
    cache keys an image by its bytes, so a warm-up with a timed request's image would start the
    timed run with that image cached. Such a workload gets a twin of three requests of another
    seed (-1 - seed, which no run draws): its shape, other images; the warm-up's and the probe's
    differ too (chat requests tie on length: the median is the second), so the probe prefills an
    image the server has not seen, as on an idle server."""
    if not workload.shape.image_size:
        return workload
    return make_workload(
        workload.name, shape=workload.shape, concurrency=1, seed=-1 - workload.seed, num_requests=3
    )


def _image_url(rng: random.Random, size: int) -> str:
    """A PNG data: URL of a `size` x `size` image: a grid of random colours, scaled up."""
    from PIL import Image  # infer-server's dependency (it decodes images): only W6 needs it here

    cells = bytes(rng.randrange(256) for _ in range(3 * IMAGE_GRID_CELLS**2))
    grid = Image.frombytes("RGB", (IMAGE_GRID_CELLS, IMAGE_GRID_CELLS), cells)
    png = io.BytesIO()
    grid.resize((size, size), Image.Resampling.NEAREST).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode("ascii")


def _check_range(name: str, bounds: tuple[int, int], *, minimum: int) -> None:
    low, high = bounds
    if not minimum <= low <= high:
        raise ValueError(f"{name} range must satisfy {minimum} <= low <= high, got {bounds}")


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(COMMON_WORDS) for _ in range(count))
