"""Serial mask filling against llguidance's parallel `LLExecutor`, on identical matcher states.

`python -m infer.bench.grammar_fill TOKENIZER_DIR [--rows 16] [--steps 60] [--threads 2,4,8,16]`

Two identical sets of matchers of infer.bench.structured_output's schema walk the same random
allowed tokens; each step one set is filled row by row (`GrammarMatcher.fill_bitmask`, what the
engine does), the other by `LLExecutor(threads).unsafe_compute_mask_ptr`, and the masks are
checked equal. Every step is a fresh state, as in a real batch (a state's mask is cached).
"""

import argparse
import random
import time

import torch

from infer.bench.structured_output import SCHEMA
from infer.engine.grammar import GrammarCompiler
from infer.engine.grammar_spec import GrammarSpec


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tokenizer", help="a folder with a Hugging Face tokenizer (e.g. a checkpoint)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", default="2,4,8,16")
    args = parser.parse_args(argv)
    from llguidance import LLExecutor
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    print(f"{vocab_size} tokens, {args.rows} rows, {args.steps} steps")
    print("| LLExecutor threads | serial ms/step | LLExecutor ms/step |")
    print("|---|---|---|")
    for threads in (int(n) for n in args.threads.split(",")):
        executor = LLExecutor(threads)
        rng = random.Random(0)
        serial = [grammar.matcher() for _ in range(args.rows)]
        parallel = [grammar.matcher() for _ in range(args.rows)]
        serial_mask, parallel_mask = (
            compiler.allocate_bitmask(args.rows),
            compiler.allocate_bitmask(args.rows),
        )
        serial_s = parallel_s = 0.0
        for _ in range(args.steps):
            start = time.perf_counter()
            for row, matcher in enumerate(serial):
                matcher.fill_bitmask(serial_mask, row)
            serial_s += time.perf_counter() - start
            start = time.perf_counter()
            executor.unsafe_compute_mask_ptr(
                [(matcher._matcher, row) for row, matcher in enumerate(parallel)],
                parallel_mask.data_ptr(),
                parallel_mask.shape[1] * 4,
                args.rows,
            )
            parallel_s += time.perf_counter() - start
            assert torch.equal(serial_mask, parallel_mask), "the two fills disagree"
            for row in range(args.rows):
                bits = (serial_mask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
                allowed = [t for t in torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist()
                           if t != tokenizer.eos_token_id]  # fmt: skip
                if allowed:
                    token = rng.choice(allowed)
                    assert serial[row].advance(token) and parallel[row].advance(token)
        per_step = 1e3 / args.steps
        print(f"| {threads} | {serial_s * per_step:.2f} | {parallel_s * per_step:.2f} |")


if __name__ == "__main__":
    main()
