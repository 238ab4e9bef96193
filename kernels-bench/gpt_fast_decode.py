"""gpt-fast's batch-1 decode (github.com/pytorch-labs/gpt-fast, its generate.py as it runs with
`--compile`: torch.compile of one decode step, mode="reduce-overhead", fullgraph) on random bf16
weights with a model's real shapes: the baseline issue 15 compares `infer bench generate` with,
run in the same device call.

gpt-fast is not vendored: pass the directory of a checkout of it. The prompt is `--prompt-tokens`
random ids; decode tok/s is the new tokens after the first over the time of gpt-fast's own
`decode_n_tokens` loop (prefill excluded, as `infer bench generate` reports decode), median of
`--repeats` runs after one that compiles. Sampling as gpt-fast's defaults (temperature 0.8, top-k
200) or, with `--top-k 0`, without top-k.

    python kernels-bench/gpt_fast_decode.py --gpt-fast DIR [--shape llama-3.2-1b] [--top-k 0]
"""

import argparse
import statistics
import sys
import time

import torch

# ModelArgs of the shapes gpt-fast has no name for (its transformer_configs stop at Llama 3.1).
SHAPES = {
    "llama-3.2-1b": dict(
        block_size=131072,
        n_layer=16,
        n_head=32,
        n_local_heads=8,
        dim=2048,
        intermediate_size=8192,
        vocab_size=128256,
        rope_base=500000,
        rope_scaling=dict(
            factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ),
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpt-fast", required=True, help="a checkout of pytorch-labs/gpt-fast")
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=200, help="0: no top-k")
    args = parser.parse_args()
    sys.path.insert(0, args.gpt_fast)
    import generate as gpt_fast  # noqa: PLC0415 (gpt-fast's directory is known only now)
    from model import ModelArgs, Transformer  # noqa: PLC0415

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(ModelArgs(**SHAPES[args.shape]))
    model = model.to(dtype=torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gpt_fast.decode_one_token = torch.compile(
        gpt_fast.decode_one_token, mode="reduce-overhead", fullgraph=True
    )
    decode_times = []
    decode_n_tokens = gpt_fast.decode_n_tokens

    def timed_decode(*call_args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = decode_n_tokens(*call_args, **kwargs)
        torch.cuda.synchronize()
        decode_times.append((time.perf_counter() - start, call_args[3]))
        return out

    gpt_fast.decode_n_tokens = timed_decode
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt_tokens,), device="cuda", dtype=torch.int)
    sampling = dict(temperature=args.temperature, top_k=args.top_k or None)
    rates = []
    for run in range(args.repeats + 1):
        gpt_fast.generate(
            model, prompt, args.gen_tokens, batch_size=1, interactive=False, draft_model=None, **sampling
        )
        seconds, tokens = decode_times[-1]
        if run > 0:  # the first run compiles
            rates.append(tokens / seconds)
    rate = statistics.median(rates)
    print(
        f"| gpt-fast | {args.shape} | decode {rate:.1f} tok/s | runs {', '.join(f'{r:.1f}' for r in rates)} "
        f"| {weight_bytes / 1e9:.3f} GB of weights | temperature {args.temperature}, top-k {args.top_k} "
        f"| torch {torch.__version__} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
