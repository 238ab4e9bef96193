"""Logprobs of sampled tokens (SamplingParams.logprobs) through the engine core, against
transformers: the log-softmax of the model's raw logits at each generated position, whatever the
request's temperature or penalties, computed only for the rows that ask."""

import pytest
import torch

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.sampling_params import SamplingParams

# float32 on CPU: our kernels and transformers' eager attention agree to about 1e-5 in logits.
LOGPROB_ATOL = 1e-3
PROMPT = "The three largest cities of France are"


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Each request's StepOutputs, all in one batch."""
    for request_id, (prompt_ids, params) in requests.items():
        engine.add_request(prompt_ids, params, request_id=request_id)
    outputs: dict[str, list] = {request_id: [] for request_id in requests}
    while engine.has_work():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def make_engine(smollm2, **settings) -> Engine:
    config = EngineConfig(max_batch_size=4, max_seq_len=256, block_size=4, **settings)
    return Engine(config, loaded_model=smollm2.loaded)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_logprobs_are_transformers_log_softmax_of_the_raw_logits(smollm2, async_scheduling):
    prompt_ids = smollm2.loaded.tokenizer.encode(PROMPT, add_special_tokens=True)
    # Sampled hot and penalized: the logprobs still describe the model's own distribution, so a
    # drawn token may be unlikely, and its logprob says so.
    hot = SamplingParams(
        temperature=1.5, seed=7, repetition_penalty=1.3, max_new_tokens=10, ignore_eos=True, logprobs=5
    )
    greedy = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, logprobs=0)
    engine = make_engine(smollm2, async_scheduling=async_scheduling)
    outputs = run(engine, {"hot": (prompt_ids, hot), "greedy": (prompt_ids, greedy)})
    for request_id, params in (("hot", hot), ("greedy", greedy)):
        generated = [output.token_id for output in outputs[request_id]]
        with torch.inference_mode():
            logits = smollm2.reference(torch.tensor([prompt_ids + generated])).logits[0]
        expected = logits[len(prompt_ids) - 1 : -1].double().log_softmax(dim=-1)
        for position, (output, token_id) in enumerate(zip(outputs[request_id], generated, strict=True)):
            row = expected[position]
            top = row.topk(params.logprobs)
            where = f"{request_id} token {position}"
            assert output.logprobs.logprob == pytest.approx(float(row[token_id]), abs=LOGPROB_ATOL), where
            assert output.logprobs.top_token_ids == top.indices.tolist(), where
            assert output.logprobs.top_logprobs == pytest.approx(top.values.tolist(), abs=LOGPROB_ATOL), where


def test_a_request_asking_for_logprobs_changes_no_tokens_of_its_batch(smollm2):
    prompt_ids = smollm2.loaded.tokenizer.encode(PROMPT, add_special_tokens=True)
    sampled = SamplingParams(temperature=1.0, seed=3, max_new_tokens=8, ignore_eos=True)
    asking = SamplingParams(temperature=0.8, seed=4, max_new_tokens=8, ignore_eos=True, logprobs=3)
    silent = SamplingParams(temperature=0.8, seed=4, max_new_tokens=8, ignore_eos=True)
    engine = make_engine(smollm2)
    together = run(engine, {"sampled": (prompt_ids, sampled), "asking": (prompt_ids, asking)})
    without = run(engine, {"sampled": (prompt_ids, sampled), "asking": (prompt_ids, silent)})

    def tokens(outputs) -> list[int]:
        return [output.token_id for output in outputs]

    assert tokens(together["sampled"]) == tokens(without["sampled"])
    assert tokens(together["asking"]) == tokens(without["asking"])
    assert all(output.logprobs is None for output in together["sampled"])
    assert all(len(output.logprobs.top_token_ids) == 3 for output in together["asking"])
