"""Single-request generation: prefill the prompt, then sample, check stops and decode, one token a step.

This is the loop later phases batch: one forward path (cached or recompute), the sampler, and a
StopChecker that owns the detokenizer; every step yields one `GenerationChunk`.
"""

import dataclasses
import logging
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from infer.engine.eos import collect_eos_token_ids
from infer.engine.forward_paths import CachedForward, RecomputeForward
from infer.engine.sampler import make_generator, sample_next_tokens
from infer.engine.sampling_params import SamplingParams
from infer.engine.stop import FINISH_LENGTH, StopChecker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationChunk:
    """One generated token and the text it releases (may be "" while a stop string could be forming)."""

    token_id: int
    text: str
    finished: bool = False
    # "stop" or "length" on the last chunk, None before.
    finish_reason: str | None = None


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str


class SingleRequestGenerator:
    """Generates for one prompt at a time on a loaded model; keeps its KV cache between requests."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        eos_token_ids: Collection[int],
        use_kv_cache: bool = True,
        cuda_graph: bool = False,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.use_kv_cache = use_kv_cache
        if cuda_graph and not use_kv_cache:
            raise ValueError("cuda_graph=True needs the KV cache (use_kv_cache=True)")
        self.forward = (
            CachedForward(model, cuda_graph=cuda_graph) if use_kv_cache else RecomputeForward(model)
        )

    @classmethod
    def from_loaded(
        cls, loaded, *, use_kv_cache: bool = True, cuda_graph: bool = False
    ) -> "SingleRequestGenerator":
        """From an `infer.models.LoadedModel`; the EOS set is collected (and logged) here, once."""
        end_of_turn = (
            getattr(loaded.chat_template, "end_of_turn_token", None) if loaded.chat_template else None
        )
        eos_token_ids = collect_eos_token_ids(
            loaded.path,
            tokenizer_eos_token_id=loaded.tokenizer.eos_token_id,
            end_of_turn_token_id=loaded.tokenizer.token_id(end_of_turn) if end_of_turn else None,
        )
        return cls(
            loaded.model,
            loaded.tokenizer,
            eos_token_ids=eos_token_ids,
            use_kv_cache=use_kv_cache,
            cuda_graph=cuda_graph,
        )

    @property
    def device(self) -> torch.device:
        return self.forward.device

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[GenerationChunk]:
        """Yields one chunk per generated token; the last has finished=True and a finish_reason."""
        from infer.models.loader.tokenizer import IncrementalDetokenizer

        prompt_ids = list(prompt_ids)
        params = self._fit_to_context(prompt_ids, params)
        checker = StopChecker(
            params, self.eos_token_ids, IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt_ids)
        )
        rng = make_generator(params.seed, self.device)
        # The repetition penalty reads prompt + generated ids; nothing else needs the list.
        tracks_history = params.repetition_penalty != 1.0
        history = list(prompt_ids) if tracks_history else []
        self.forward.reserve(len(prompt_ids) + params.max_new_tokens)
        logits = self.forward.prefill(prompt_ids)
        while True:
            with torch.inference_mode():
                next_token = sample_next_tokens(logits[None], [params], [history], [rng])
            token_id = int(next_token[0])
            text, finish_reason = checker.push(token_id)
            yield GenerationChunk(token_id, text, finish_reason is not None, finish_reason)
            if finish_reason is not None:
                return
            if tracks_history:
                history.append(token_id)
            logits = self.forward.decode(token_id)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        chunks = list(self.stream(prompt_ids, params))
        return GenerationResult(
            token_ids=[chunk.token_id for chunk in chunks],
            text="".join(chunk.text for chunk in chunks),
            finish_reason=chunks[-1].finish_reason,
        )

    def _fit_to_context(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        config = self.model.config
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token id; encode it with the BOS token")
        bad = [token_id for token_id in prompt_ids if not 0 <= token_id < config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {config.vocab_size}), got {bad[:5]}")
        room = config.max_position_embeddings - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens and the model takes "
                f"{config.max_position_embeddings} positions; shorten the prompt"
            )
        if params.max_new_tokens > room:
            logger.warning(
                "max_new_tokens %d exceeds the context left after the prompt; capping it at %d (finish %r)",
                params.max_new_tokens,
                room,
                FINISH_LENGTH,
            )
            return dataclasses.replace(params, max_new_tokens=room)
        return params
