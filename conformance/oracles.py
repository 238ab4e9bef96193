"""A recompute oracle for generation tests: no KV cache, no batching, no scheduler.

Every token, the whole sequence so far runs through one cache-free forward
(`ForwardBatch.from_tokens`), and the last position's logits go through the engine's sampler
with the request's own seeded generator and the engine's stop rules. What the engine produces for
a request, whatever shares its steps, whatever its pool layout, chunking or preemption, must equal
this under greedy decoding (and under seeded sampling when the RNG is drawn the same way).
"""

from collections.abc import Sequence

import torch

from infer.engine.eos import eos_token_ids_of
from infer.engine.generate import GenerationResult
from infer.engine.sampler import make_generator, sample_next_tokens
from infer.engine.sampling_params import SamplingParams
from infer.engine.stop import StopChecker, stop_token_ids_of, token_finish_reason
from infer.models.forward_batch import ForwardBatch


class RecomputeOracle:
    def __init__(self, loaded):
        """`loaded`: an infer.models.LoadedModel."""
        self.loaded = loaded
        self.model = loaded.model
        self.eos_token_ids = eos_token_ids_of(loaded)
        self.device = next(self.model.parameters()).device

    @torch.inference_mode()
    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, proposal: Sequence[int] = ()
    ) -> GenerationResult:
        """The request's answer, a token at a time as above. `proposal`: tokens the answer may
        begin with (say, the answer under test); one cache-free forward over the sequence and the
        proposal gives every position's logits at once, and the oracle draws its tokens from them
        one by one, as a forward a token would, while each drawn token is the proposal's; past the
        first that is not (or the proposal's end) it goes on a forward a token. The answer is the
        oracle's own whatever the proposal: a causal model's logits at a position do not depend on
        the tokens after it (up to the rounding of a longer matmul), so a right proposal only saves
        forwards and a wrong one changes nothing (SmolLM2's 64 greedy tokens: 0.8 s, not 47)."""
        from infer.models.loader.tokenizer import IncrementalDetokenizer

        tokens = list(prompt_ids)
        detokenizer = IncrementalDetokenizer(self.loaded.tokenizer, prompt_ids=tokens)
        checker = StopChecker(params, detokenizer)
        stop_token_ids = stop_token_ids_of(params, self.eos_token_ids)
        generator = make_generator(params.seed, self.device)
        generated, text, proposal = [], [], list(proposal)
        while True:
            ahead = proposal[len(generated) :] if proposal[: len(generated)] == generated else []
            hidden = self.model(ForwardBatch.from_tokens([tokens + ahead], device=self.device))
            # Row i: the logits after the sequence and ahead[:i].
            for i, logits in enumerate(self.model.compute_logits(hidden[len(tokens) - 1 :])):
                token_id = int(sample_next_tokens(logits[None], [params], [tokens], [generator])[0])
                tokens.append(token_id)
                generated.append(token_id)
                core_finish = token_finish_reason(params, stop_token_ids, len(generated), token_id)
                delta, finish_reason = checker.push(token_id, core_finish)
                text.append(delta)
                if finish_reason is not None:
                    return GenerationResult(
                        token_ids=generated, text="".join(text), finish_reason=finish_reason
                    )
                if i == len(ahead) or token_id != ahead[i]:
                    break


def reference_8bit_linears(model: torch.nn.Module) -> None:
    """Every 8-bit Linear of `model` through the reference method (dequantize, fp32 matmul).
    The CPU's int8 kernels round activations, by a method chosen by shape, so a tensor-parallel
    shard and the whole model would differ by that, not by what a comparison of the two is
    about."""
    from infer.models.linear import Linear
    from infer.models.linear_method import QuantizedMethod

    for module in model.modules():
        if isinstance(module, Linear) and module.weight_scale is not None:
            module.method = QuantizedMethod()
