"""`infer generate` (argv[0] names the subcommand).

infer generate [--model M] [--chat] [sampling flags] PROMPT...   stream text, tokens/s on stderr

infer-bench's `infer profile` and `infer bench generate` take the same model flags
(`add_model_arguments`) and load the same way (`engine_config_from_args`, then
`infer.engine.load_engine`).
"""

import argparse
import logging
import sys
import time

import torch

from infer.engine.config import (
    DTYPES,
    EngineConfig,
    parse_bool,
    parse_json_mapping,
    resolve_device,
    resolve_dtype,
)
from infer.engine.sampling_params import SamplingParams
from infer.models import DEFAULT_MODEL
from infer.models.quantization import QUANTIZATION_CHOICES


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    # A model's first fetch converts it for about a minute: say so even without -v.
    logging.getLogger("infer.models.loader.fetch").setLevel(logging.INFO)
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for one prompt, streamed as it comes")
    add_model_arguments(generate)
    add_sampling_arguments(generate)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("prompt", nargs="+", help="the prompt (several words are joined with spaces)")
    generate.set_defaults(run=run_generate)
    return parser


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="alias or checkpoint folder (default %(default)s)"
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on CUDA, float32 on CPU"
    )
    parser.add_argument(
        "--max-seq-len", type=int, default=None, help="prompt + new tokens (default: model's, <= 4096)"
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        default=None,
        help="8-bit (int8, fp8) or 4-bit (int4) Linear weights, quantized at load on a dense checkpoint "
        "(default: as stored; GPTQ and AWQ checkpoints load 4-bit); gguf: an alias's GGUF file in its "
        "own blocks (CPU)",
    )
    parser.add_argument(
        "--device-memory-limit-gib",
        type=float,
        default=None,
        help="most CUDA memory the engine takes, weights included (default: the whole device)",
    )
    # None: the measured best for the device (infer.engine.device_defaults); true or false overrides.
    for flag, what in (
        ("--use-cuda-graphs", "replay steps from CUDA graphs (CUDA only)"),
        ("--async-scheduling", "launch each step before the previous step's token reaches the host"),
        (
            "--use-pdl",
            "programmatic dependent launch: each Triton kernel lets the next launch early (sm_90+)",
        ),
        ("--use-triton-gemv", "batch-1 decode's dense projections through infer-kernels' Triton GEMV (CUDA)"),
    ):
        name = flag[2:].replace("-", "_")
        parser.add_argument(
            flag,
            dest=name,
            type=parse_bool,
            nargs="?",
            const=True,
            default=None,
            help=f"{what} (default: auto; false turns it off)",
        )
    parser.add_argument(
        "--use-native-cpu-kernels",
        type=parse_bool,
        nargs="?",
        const=True,
        default=True,
        help="on a CPU, decode attention and int8 and GGUF Linears through infer-kernels' C kernels "
        "(true, the default) or ATen's (false; a GGUF weight then dequantized once, to fp32)",
    )
    parser.add_argument(
        "--use-huge-pages",
        type=parse_bool,
        nargs="?",
        const=True,
        default=True,
        help="on a CPU, the weights in transparent huge pages (true, the default) or where the "
        "loader put them (false)",
    )
    parser.add_argument(
        "--speculative-config",
        type=parse_json_mapping,
        default=None,
        help='speculative decoding, as vLLM\'s: e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (default: off)',
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO (EOS ids, loading)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def resolve_device_and_dtype(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    device = resolve_device(args.device or "auto")
    return device, resolve_dtype(args.dtype, device)


def engine_config_from_args(args: argparse.Namespace, *, max_batch_size: int = 1) -> EngineConfig:
    """The EngineConfig of the model, device, dtype and graph flags in `args` (`add_model_arguments`),
    for `infer.engine.load_engine`."""
    device, _ = resolve_device_and_dtype(args)
    return EngineConfig(
        model=args.model,
        device=str(device),
        dtype=args.dtype,
        quantization=args.quantization,
        device_memory_limit_gib=args.device_memory_limit_gib,
        max_seq_len=args.max_seq_len,
        max_batch_size=max_batch_size,
        use_cuda_graphs=args.use_cuda_graphs,
        async_scheduling=args.async_scheduling,
        use_pdl=args.use_pdl,
        use_triton_gemv=args.use_triton_gemv,
        use_native_cpu_kernels=args.use_native_cpu_kernels,
        use_huge_pages=args.use_huge_pages,
        speculative_config=args.speculative_config,
    )


def encode_prompt(loaded, text: str, *, chat: bool) -> list[int]:
    """Token ids of `text`, or of a one-message chat rendered by the model's template."""
    if chat:
        rendered = loaded.chat_template.render(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        # The rendered template already holds the BOS token where the model wants one.
        return loaded.tokenizer.encode(rendered, add_special_tokens=False)
    return loaded.tokenizer.encode(text, add_special_tokens=True)


def run_generate(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            max_new_tokens=args.max_tokens,
            stop=args.stop,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as err:
        print(f"infer generate: {err}", file=sys.stderr)
        return 2
    from infer.engine.engine import load_engine
    from infer.engine.generate import stream

    try:
        loaded, engine = load_engine(engine_config_from_args(args))
    except (ValueError, OSError) as err:  # unknown model, missing files, no CUDA: the message says
        print(f"infer generate: {err}", file=sys.stderr)
        return 2
    if args.chat and not loaded.ships_chat_template:
        print(
            f"infer generate: warning: {loaded.path} ships no chat template (a base model?); --chat "
            f"renders the {loaded.chat_template.family} family's template, which it may never have seen",
            file=sys.stderr,
        )
    prompt_ids = encode_prompt(loaded, " ".join(args.prompt), chat=args.chat)
    start = time.perf_counter()
    first_token_at = None
    num_tokens, finish_reason = 0, None
    for chunk in stream(engine, prompt_ids, params):
        if first_token_at is None:
            first_token_at = time.perf_counter()
        num_tokens += 1
        finish_reason = chunk.finish_reason
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    prefill_s, decode_s = first_token_at - start, end - first_token_at
    decode_rate = f"{(num_tokens - 1) / decode_s:.1f} tokens/s" if num_tokens > 1 and decode_s > 0 else "n/a"
    print(
        f"[{num_tokens} tokens, finish {finish_reason}; prompt {len(prompt_ids)} tokens in {prefill_s:.3f} s "
        f"({len(prompt_ids) / prefill_s:.0f} tokens/s); decode {decode_rate}; "
        f"{'CUDA graphs' if engine.config.use_cuda_graphs else 'eager'}, {engine.core.device}, "
        f"{_weights_description(loaded.model)}]",
        file=sys.stderr,
    )
    return 0


def _weights_description(model) -> str:
    """The activations' dtype, and the Linear weights' format where it is 8-bit."""
    if model.quantization is None:
        return str(model.dtype)
    return f"{model.dtype}, {model.quantization.method} weights"


if __name__ == "__main__":
    sys.exit(main())
