"""What crosses between the frontend and the engine core: plain, picklable data, no text.

The frontend (the server, `infer generate`) tokenizes, sends an `EngineRequest` per request and
an abort by request id; the core answers once per step with `EngineOutputs`: for each request
that got tokens or ended, an `EngineOutput` with its new token ids (and their logprobs, when
the request asked), and the core's statistics after that step. Text (detokenization, stop
strings) is the frontend's (`infer.engine.output_processor`). The core runs in the frontend's
process or in a child process of its own (`infer.engine.client`); these types are all that
travels either way.

Errors are outputs: a request the core refuses or whose forward failed ends with
`FinishReason.ERROR` and `error` set; no exception crosses.
"""

import enum
import operator
from dataclasses import dataclass, field, fields

import numpy as np

from infer.engine.config import EngineConfig
from infer.engine.decision import PromptLogprobs, TokenLogprobs
from infer.engine.images import PromptImage, check_images
from infer.engine.request import InvalidParamError, RequestTooLongError
from infer.engine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request ended: the one vocabulary from the core to the API's finish_reason."""

    STOP = 0  # an EOS token or a stop token id (the core), a stop string (the frontend)
    LENGTH = 1  # max_new_tokens
    ABORT = 2  # asked for by the frontend (client gone, drain, a stop string found)
    ERROR = 3  # refused by the core, or its step's forward raised: `error` says why

    def __str__(self) -> str:
        """The API's finish_reason: "stop", "length", "abort", "error"."""
        return self.name.lower()


# The finish_reason strings the frontend and the server speak, each str() of its FinishReason:
# the one mapping from the core's vocabulary to the API's (the chat API adds "tool_calls").
FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = (str(reason) for reason in FinishReason)


@dataclass(frozen=True)
class EngineRequest:
    """Frontend -> core: one request, already tokenized and checked."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # time.monotonic() when the frontend took the request (its queue time starts there).
    arrival_s: float
    cache_salt: str | None = None
    # Computed from scratch and left out of the prefix cache (the shadow check's re-runs).
    bypass_prefix_cache: bool = False
    # A vision-language model's images, in prompt order (infer.engine.images).
    images: tuple[PromptImage, ...] = ()


# EngineOutput and EngineOutputs are made on the core's loop every step, one per running
# request: slots and no frozen __setattr__ make that about 5x cheaper, and EngineOutputs crosses
# the process boundary as plain rows (`__reduce__`), pickled in half the time and bytes.


@dataclass(slots=True)
class EngineOutput:
    """Core -> frontend: what one request got in one step."""

    request_id: str
    # Tokens sampled this step (0 or 1 today; 1 + k with speculative decoding). When
    # finish_reason is STOP, the last one is the stop token (EOS or a stop token id).
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    # Prompt tokens whose KV came from a cache instead of a forward.
    num_cached_tokens: int = 0
    error: str | None = None
    # On a request's first token: seconds from arrival to the step that first scheduled it.
    queue_time_s: float | None = None
    # One per new token when the request asked for logprobs (SamplingParams.logprobs), else None.
    logprobs: list[TokenLogprobs] | None = None
    # On the first token of a request with images: seconds the vision tower spent on them.
    vision_encoder_s: float | None = None
    # A pooling request's (SamplingParams.pooling) pooled hidden state, [hidden_size] float32,
    # on its one token's output (left out of ==, which an array cannot answer as one bool).
    embedding: np.ndarray | None = field(default=None, compare=False)
    # A request that asked for its prompt's logprobs (SamplingParams.prompt_logprobs): them, on
    # its first token's output (arrays: left out of == as `embedding`).
    prompt_logprobs: PromptLogprobs | None = field(default=None, compare=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# EngineStats too is made every step and crosses with the outputs: slots and no frozen
# __setattr__, as EngineOutput, and pickled as its values in field order (`__reduce__`).


@dataclass(slots=True)
class EngineStats:
    """The core's counters and gauges after a step (metrics cross with the outputs, not polled)."""

    num_running: int
    num_waiting: int
    # Fraction of the pool's KV blocks in use; bytes count whole blocks.
    kv_usage_ratio: float
    kv_bytes_used: int
    kv_bytes_total: int
    num_steps: int
    # Requests the core has taken in since it started: the frontend's queue count is what it
    # sent beyond this plus num_waiting.
    num_added: int
    num_prompt_tokens_total: int
    # Tokens in the outputs sent (the shadow check's re-runs send none).
    num_generation_tokens_total: int
    # Requests that ended by finish reason: STOP or LENGTH, ABORT, and ERROR (refused by the
    # core, or failed by its forward or its grammar).
    num_finished: int
    num_aborted: int
    num_failed: int
    # Preemptions so far (a request preempted twice counts twice).
    num_preempted: int
    # Wall time spent inside step() with work to do.
    busy_time_s: float
    # Prompt tokens over the busy time of the steps that ran prompt tokens (a step that also
    # decodes counts whole), so decoding stretches do not dilute it.
    prompt_tokens_per_s: float
    # Generated tokens over all busy time.
    generation_tokens_per_s: float
    # The prefix cache (all 0 while it is off): admissions by match kind (miss, prefix,
    # supersequence, lcp), the blocks and bytes it holds, its byte budget (0: none but the pool),
    # and what it evicted so far.
    prefix_cache_matches: dict[str, int] = field(default_factory=dict)
    prefix_cache_blocks: int = 0
    prefix_cache_bytes: int = 0
    prefix_cache_budget_bytes: int = 0
    prefix_cache_evicted_blocks: int = 0
    prefix_cache_evicted_bytes: int = 0
    # prefix_cache_kv_bits: blocks held in int8 now, and blocks quantized and restored so far.
    prefix_cache_quantized_blocks: int = 0
    prefix_cache_quantized_bytes: int = 0
    prefix_cache_quantized_total: int = 0
    prefix_cache_restored_total: int = 0
    # The pool's dtype ("bfloat16", "float8_e4m3fn", ...) and the tokens it holds in all
    # (kv_bytes_total holds them: with fp8 about twice bf16's per byte).
    kv_cache_dtype: str = ""
    kv_tokens_total: int = 0
    # The second tier, if any: "int8" (prefix_cache_kv_bits), "host" (kv_host_cache_gib) or
    # "host int8" (both); with a host tier, the blocks and bytes it holds, its budget, and the
    # bytes offloaded to it, restored from it and dropped from it so far.
    prefix_cache_store: str | None = None
    kv_host_blocks: int = 0
    kv_host_bytes: int = 0
    kv_host_budget_bytes: int = 0
    kv_host_offloaded_bytes_total: int = 0
    kv_host_restored_bytes_total: int = 0
    kv_host_dropped_bytes_total: int = 0
    # The steps' stream time in offloads and restores, before each forward (decision.py's
    # store_transfer_s): what the steps waited for the host tier.
    kv_host_transfer_time_s_total: float = 0.0
    # Shadow re-runs without the cache (prefix_cache_shadow_rate), and those whose tokens differed.
    prefix_cache_shadow_runs: int = 0
    prefix_cache_shadow_divergences: int = 0
    # The tree's runs (most recently used first, at most ENTRIES_SENT of them) and how many there
    # are; None in the steps that did not walk the tree (see PrefixCacheObserver.entries).
    prefix_cache_num_entries: int | None = None
    prefix_cache_entries: tuple["PrefixCacheEntry", ...] | None = None
    # Decode against the memory roofline (infer.engine.roofline): what the decode steps that ran
    # back to back read (bytes) and took (seconds from each one's start to the next one's), and
    # the copy bandwidth measured at start-up (bytes/s). Achieved bandwidth over a stretch is
    # d(bytes) / d(time); over the copy bandwidth, the share of the roofline.
    decode_bytes_total: int = 0
    decode_time_s_total: float = 0.0
    copy_bandwidth_bytes_per_s: float = 0.0
    # Memory (infer.engine.memory): the model's parameters and buffers (each storage once),
    # counted when the engine was built; and the device's memory, read at most once a second:
    # on "cuda" the caching allocator's allocated and reserved bytes, on "cpu" the process's
    # resident set (reserved 0); total, the device's memory or the machine's RAM. What is in use
    # beyond weights and the KV pool (kv_bytes_total) is activations, graphs and the rest.
    weights_bytes: int = 0
    memory_device: str = ""
    memory_used_bytes: int = 0
    memory_reserved_bytes: int = 0
    memory_total_bytes: int = 0
    # Speculative decoding (infer.engine.spec_decode.SpecDecodeCounts; all 0 and empty while it is
    # off): K, the draft tokens a row may verify per step (0: speculation off); rows that verified
    # drafts (vLLM's num_drafts), the draft tokens verified and those the target accepted; and by
    # draft position j (0-based, j < K), the rows whose draft j was accepted and those that had a
    # draft j. Mean accepted length: 1 + accepted / verified rows (the target's own token counts).
    spec_decode_num_speculative_tokens: int = 0
    spec_decode_num_verified_rows: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_by_position: tuple[int, ...] = ()
    spec_decode_drafted_by_position: tuple[int, ...] = ()
    # Vision-language models (infer.engine.images.ImageCounts; all 0 for a text model): images
    # the vision tower encoded, images whose tokens all came from the prefix cache (never
    # encoded), image tokens reused from it, and the seconds the tower ran.
    vision_encoder_runs: int = 0
    vision_encoder_skipped: int = 0
    vision_image_tokens_reused: int = 0
    vision_encoder_time_s: float = 0.0

    def __reduce__(self):
        return EngineStats, _engine_stats_values(self)


# Every field's value, in order: EngineStats(*values) is the same stats.
_engine_stats_values = operator.attrgetter(*(f.name for f in fields(EngineStats)))


@dataclass(frozen=True)
class PrefixCacheEntry:
    """One run of the prefix cache's tokens between branches (infer.cache.PrefixEntry), as a
    person reads it: tokens [start, start + num_tokens) of the sequences through it; `bytes` of
    KV blocks and `stored_bytes` in the pool's store (int8 slots, or host memory); `hits`,
    requests that reused part of it (or of a run below it); when it was made and last used (Unix
    seconds); `in_use` while a running request reads it (it cannot be evicted then)."""

    start: int
    num_tokens: int
    bytes: int
    stored_bytes: int
    hits: int
    created_at: float
    last_used_at: float
    in_use: bool


ENTRIES_SENT = 100


@dataclass(slots=True)
class EngineOutputs:
    """Everything one core step produced, and the core's state after it."""

    outputs: list[EngineOutput] = field(default_factory=list)
    stats: EngineStats | None = None

    def __reduce__(self):
        rows = [
            (
                output.request_id,
                output.new_token_ids,
                None if output.finish_reason is None else int(output.finish_reason),
                output.num_prompt_tokens,
                output.num_cached_tokens,
                output.error,
                output.queue_time_s,
                output.logprobs,
                output.vision_encoder_s,
                output.embedding,
                output.prompt_logprobs,
            )
            for output in self.outputs
        ]
        return _engine_outputs_from_rows, (rows, self.stats)


def _engine_outputs_from_rows(rows: list[tuple], stats: EngineStats | None) -> EngineOutputs:
    outputs = []
    for request_id, token_ids, finish, *rest in rows:
        finish_reason = None if finish is None else FinishReason(finish)
        outputs.append(EngineOutput(request_id, token_ids, finish_reason, *rest))
    return EngineOutputs(outputs, stats)


@dataclass(frozen=True)
class CoreLimits:
    """What the frontend must know of a built core to check requests before sending them."""

    max_seq_len: int
    block_size: int
    num_blocks: int
    max_queue_len: int
    # Rows of the model's embedding: token ids (prompts, logit_bias) must be below this.
    vocab_size: int
    eos_token_ids: frozenset[int]
    # The config the core runs, its auto settings decided for the device
    # (infer.engine.device_defaults), and that decision in one line for the operator.
    config: EngineConfig
    settings_line: str
    # A vision-language model's image placeholder token (it may lie past the vocabulary, as
    # Gemma 3's does); None: the model takes no images.
    image_token_id: int | None = None

    def check_request(
        self, prompt_ids: list[int], params: SamplingParams, images: tuple[PromptImage, ...] = ()
    ) -> None:
        """Raises what makes a request impossible: ValueError for an empty prompt, an id outside
        the vocabulary, images the model does not take or that do not lie over its image tokens
        (and image tokens without an image), InvalidParamError for a logit_bias id outside it,
        RequestTooLongError when it can never fit. The frontend checks before sending, and the
        core again when it takes the request in."""
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        if images and self.image_token_id is None:
            raise ValueError("the model takes no images: it has no vision tower")
        speculative = self.config.speculative
        if images and speculative is not None and speculative.method == "draft_model":
            raise ValueError(
                "images with a draft model are not supported: the draft model sees no images; "
                "serve without speculative_config or with the ngram method"
            )
        if images:
            check_images(images, prompt_ids, self.image_token_id)
        num_image_tokens = sum(image.num_tokens for image in images)
        if self.image_token_id is not None and prompt_ids.count(self.image_token_id) != num_image_tokens:
            raise ValueError(
                f"the prompt holds the model's image token {self.image_token_id} where no image is; "
                "images come as image_url content parts"
            )
        bad = [
            token_id
            for token_id in prompt_ids
            if not 0 <= token_id < self.vocab_size and token_id != self.image_token_id
        ]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        outside = [token_id for token_id in params.logit_bias if token_id >= self.vocab_size]
        if outside:
            raise InvalidParamError(
                "logit_bias", f"logit_bias token ids must be in [0, {self.vocab_size}), got {outside[:5]}"
            )
        self.check_fits(len(prompt_ids), params.max_new_tokens)

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        check_fits(num_prompt_tokens, max_new_tokens, self.max_seq_len, self.block_size, self.num_blocks)


def check_fits(
    num_prompt_tokens: int, max_new_tokens: int, max_seq_len: int, block_size: int, num_blocks: int
) -> None:
    """Raises RequestTooLongError when such a request could never run, whatever the load."""
    total = num_prompt_tokens + max_new_tokens
    if total > max_seq_len:
        raise RequestTooLongError(
            f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
            f"max_seq_len ({max_seq_len}); shorten the prompt or lower max_new_tokens"
        )
    needed = -(-total // block_size)
    if needed > num_blocks:
        raise RequestTooLongError(
            f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {total} needs "
            f"{needed} KV blocks of {block_size} tokens but the whole pool has "
            f"{num_blocks}; shorten the request or build a larger pool"
        )
