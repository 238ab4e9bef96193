"""What structured output costs: constrained requests against unconstrained ones that generate
exactly as many tokens, at batch 1 and 16, through the engine alone.

`python -m infer.bench.structured_output MODEL [--device cuda] [--repeats 3]`

Greedy, 256-token random prompts, a JSON schema with every value bounded (with random weights
every answer is the grammar's doing, and it still ends). Each repeat runs the constrained batch,
then the same prompts unconstrained with `max_new_tokens` set to each constrained answer's length
and `ignore_eos`, so both generate the same tokens; tok/s is tokens over the batch's wall time.
"""

import argparse
import time

import torch

from infer.engine import Engine, EngineConfig, SamplingParams
from infer.engine.grammar_spec import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "n": {"type": "integer", "minimum": -5000, "maximum": 5000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "tags", "ok"],
    "additionalProperties": False,
}
PROMPT_TOKENS = 256
BATCHES = (1, 16)


def run_batch(engine: Engine, prompts: list[list[int]], params_for) -> tuple[list[int], float]:
    """Adds one request per prompt and steps until all end: each one's token count, the wall time."""
    start = time.perf_counter()
    ids = [engine.add_request(prompt, params_for(i)) for i, prompt in enumerate(prompts)]
    counts = dict.fromkeys(ids, 0)
    while engine.has_work():
        for output in engine.step():
            if output.token_id is not None:
                counts[output.request_id] += 1
    return [counts[request_id] for request_id in ids], time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    engine = Engine(
        EngineConfig(
            model=args.model, device=args.device, dtype="bfloat16" if on_cuda else "float32",
            max_batch_size=max(BATCHES), max_seq_len=2048, use_chunked_prefill=True,
            use_cuda_graphs=on_cuda, async_scheduling=True,
        )
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 32000, (PROMPT_TOKENS,), generator=generator).tolist() for _ in range(max(BATCHES))
    ]
    spec = GrammarSpec.json_schema(SCHEMA)

    def constrained(_):
        return SamplingParams(temperature=0, max_new_tokens=400, grammar=spec)

    lengths, _ = run_batch(engine, prompts, constrained)  # warm-up: the compiler, the graphs
    print(f"constrained answer lengths: {lengths}")
    print("| batch | tokens | constrained tok/s | unconstrained tok/s | constrained / unconstrained |")
    print("|---|---|---|---|---|")
    for batch in BATCHES:
        for _ in range(args.repeats):
            lengths, constrained_s = run_batch(engine, prompts[:batch], constrained)
            same, unconstrained_s = run_batch(
                engine,
                prompts[:batch],
                lambda i, lengths=lengths: SamplingParams(
                    temperature=0, max_new_tokens=lengths[i], ignore_eos=True
                ),
            )
            assert same == lengths, (same, lengths)
            tokens = sum(lengths)
            print(
                f"| {batch} | {tokens} | {tokens / constrained_s:.0f} | {tokens / unconstrained_s:.0f} | "
                f"{unconstrained_s / constrained_s:.3f} |"
            )
    engine.shutdown()


if __name__ == "__main__":
    main()
