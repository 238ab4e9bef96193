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
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        from infer.models.loader.tokenizer import IncrementalDetokenizer

        tokens = list(prompt_ids)
        detokenizer = IncrementalDetokenizer(self.loaded.tokenizer, prompt_ids=tokens)
        checker = StopChecker(params, detokenizer)
        stop_token_ids = stop_token_ids_of(params, self.eos_token_ids)
        generator = make_generator(params.seed, self.device)
        generated, text = [], []
        while True:
            hidden = self.model(ForwardBatch.from_tokens([tokens], device=self.device))
            logits = self.model.compute_logits(hidden[-1:])
            token_id = int(sample_next_tokens(logits, [params], [tokens], [generator])[0])
            tokens.append(token_id)
            generated.append(token_id)
            core_finish = token_finish_reason(params, stop_token_ids, len(generated), token_id)
            delta, finish_reason = checker.push(token_id, core_finish)
            text.append(delta)
            if finish_reason is not None:
                return GenerationResult(token_ids=generated, text="".join(text), finish_reason=finish_reason)


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
