"""Where does our model depart from transformers? Runs both on one prompt and compares the
embeddings, every decoder block's output, the final norm and the logits.

    infer models diff MODEL PROMPT [--dtype float32|bfloat16|float16] [--rel-tol X]

Differences are reported absolute and relative to the largest reference activation of that
layer (Gemma's residual stream grows to thousands, so one absolute bound cannot fit all layers);
the first layer whose relative difference passes the tolerance is marked.
"""

import argparse
from dataclasses import dataclass

import torch

from infer.models.common import CausalLM
from infer.models.config import TORCH_DTYPES
from infer.models.forward_batch import ForwardBatch

# Relative tolerance per dtype: fp32 runs agree to rounding; half precision rounds every matmul.
DEFAULT_REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 2e-2}


@dataclass(frozen=True)
class LayerDiff:
    name: str
    max_abs: float
    mean_abs: float
    # max_abs / the largest |value| of the reference activation.
    rel: float


def block_output(layer: torch.nn.Module, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Hugging Face's output of one of our blocks from the (hidden, residual) it handed on: their
    sum, once the block's `output_norm` (Gemma's post-feedforward norm, which the next block
    applies fused with its own) is applied to hidden."""
    output_norm = getattr(layer, "output_norm", None)
    return (hidden if output_norm is None else output_norm(hidden)) + residual


def activation_diffs(ours: CausalLM, reference: torch.nn.Module, input_ids: torch.Tensor) -> list[LayerDiff]:
    """Per-stage differences for one `[1, T]` prompt (our model runs it as a one-row flat batch of
    T tokens); `reference` is a transformers CausalLM."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one prompt, [1, T], got shape {tuple(input_ids.shape)}")
    ours_outputs, reference_outputs = [], []

    def keep_ours(module, _inputs, output):
        ours_outputs.append(block_output(module, *output).float())

    def keep_reference(_module, _inputs, output):
        # transformers' block output is [1, T, hidden] (or a tuple starting with it); ours is [T, hidden].
        reference_outputs.append((output[0] if isinstance(output, tuple) else output)[0].float())

    handles = [layer.register_forward_hook(keep_ours) for layer in ours.layers]
    handles += [layer.register_forward_hook(keep_reference) for layer in reference.model.layers]
    try:
        with torch.no_grad():
            batch = ForwardBatch.from_tokens(input_ids.tolist(), device=input_ids.device)
            our_embeddings = ours.embed(batch.input_ids).float()
            our_hidden = ours(batch)
            our_logits = ours.compute_logits(our_hidden)
            ref = reference(input_ids, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    # Our one-row flat batch gives [T, ...]; transformers' batch of one gives [1, T, ...].
    pairs = [("embeddings", our_embeddings, ref.hidden_states[0][0].float())]
    pairs += [
        (f"layer {i}", o, r) for i, (o, r) in enumerate(zip(ours_outputs, reference_outputs, strict=True))
    ]
    pairs += [("final norm", our_hidden.float(), ref.hidden_states[-1][0].float())]
    pairs += [("logits", our_logits, ref.logits[0].float())]
    return [_diff(name, o, r) for name, o, r in pairs]


def first_departure(diffs: list[LayerDiff], rel_tol: float) -> int | None:
    """Index of the first stage whose relative difference exceeds rel_tol, or None."""
    return next((i for i, d in enumerate(diffs) if d.rel > rel_tol), None)


def format_diffs(diffs: list[LayerDiff], rel_tol: float) -> str:
    first = first_departure(diffs, rel_tol)
    lines = [f"{'stage':<12} {'max_abs':>11} {'mean_abs':>11} {'rel':>10}"]
    for i, d in enumerate(diffs):
        mark = f"  <- first beyond rel tol {rel_tol:g}" if i == first else ""
        lines.append(f"{d.name:<12} {d.max_abs:>11.3e} {d.mean_abs:>11.3e} {d.rel:>10.2e}{mark}")
    if first is None:
        lines.append(f"every stage within rel tol {rel_tol:g}")
    return "\n".join(lines)


def _diff(name: str, ours: torch.Tensor, reference: torch.Tensor) -> LayerDiff:
    delta = (ours - reference).abs()
    scale = reference.abs().max().clamp(min=1e-12)
    return LayerDiff(name, delta.max().item(), delta.mean().item(), (delta.max() / scale).item())


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Adds `diff MODEL PROMPT [--dtype D] [--rel-tol X]`."""
    parser = subparsers.add_parser("diff", help="per-layer activation differences against transformers")
    parser.add_argument("model", help="an alias or a checkpoint folder")
    parser.add_argument("prompt", help="text, encoded with the model's tokenizer (special tokens added)")
    parser.add_argument("--dtype", choices=list(TORCH_DTYPES), default="float32")
    parser.add_argument(
        "--rel-tol", type=float, default=None, help="default: by dtype (fp32 1e-4, bf16 1e-1)"
    )
    parser.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from infer.models.load import load_model

    dtype = TORCH_DTYPES[args.dtype]
    loaded = load_model(args.model, dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=dtype, attn_implementation="eager")
    input_ids = torch.tensor([loaded.tokenizer.encode(args.prompt, add_special_tokens=True)])
    rel_tol = args.rel_tol if args.rel_tol is not None else DEFAULT_REL_TOL[dtype]
    diffs = activation_diffs(loaded.model, reference.eval(), input_ids)
    print(f"{loaded.path.name} {args.dtype}, {input_ids.shape[1]} prompt tokens")
    print(format_diffs(diffs, rel_tol))
    return 0 if first_departure(diffs, rel_tol) is None else 1
