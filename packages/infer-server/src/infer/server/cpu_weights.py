"""`infer serve`'s weights on a CPU: a model converted from a GGUF file runs that file's blocks.

The CPU default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF file; its checkpoint folder is
that file expanded to bf16. Decoding the file's own blocks on infer-kernels' C kernels
(`quantization="gguf"`) reads 111 MB a token where the dense fp32 model reads 553 MB: on the
2-core CI-class VM it decodes at 3.4x fp32's tok/s (2.0x bf16's, 1.4x int8's) with prefill level
(docs/benchmarks/quantization.md#cpu-which-weights-infer-serve-runs). So where nothing else asks
for the weights' format, `infer serve` on a CPU runs the file, as llama.cpp and Ollama run it;
`--quantization none` keeps the checkpoint's dense weights (float32, or `--dtype`).

Only `infer serve` decides this: an `EngineConfig` built in code keeps its dense default, which
the engine's tests compare against transformers.
"""

import logging
from pathlib import Path

from infer.engine.config import EngineConfig, resolve_device

logger = logging.getLogger(__name__)

# `infer serve --quantization none`: the checkpoint's weights as stored, never the GGUF file.
DENSE = "none"


def default_cpu_weights(config: EngineConfig) -> EngineConfig:
    """`config` with quantization "gguf" where `infer serve` runs on a CPU and nothing else asks
    for the weights: no quantization, dtype auto or float32, real weights, one tensor-parallel
    rank, no speculative decoding (not measured with it), the C kernels on and built here, and a
    Llama model whose folder was converted from a known alias's GGUF file. Otherwise `config`
    unchanged."""
    if (
        config.quantization is not None
        or config.dtype not in ("auto", "float32")
        or config.load_format != "auto"
        or config.tensor_parallel_size != 1
        or config.speculative_config is not None
        or config.use_native_cpu_kernels is False
        or config.device not in ("cpu", "auto")
        or resolve_device(config.device).type != "cpu"
    ):
        return config
    from infer.kernels import gguf_linear_cpu_native

    if not gguf_linear_cpu_native():
        logger.info("the C kernels do not build here: dense weights")
        return config
    gguf_file = _packed_gguf_file(config.model)
    if gguf_file is None:
        return config
    logger.info("weights: %s in its own blocks (--quantization none: the dense checkpoint)", gguf_file.name)
    return config.replace(quantization="gguf")


def _packed_gguf_file(model: str) -> Path | None:
    """The GGUF file a Llama model's folder was converted from, or None (another model, or a
    file that cannot be found here: the dense checkpoint then runs)."""
    from infer.models.config import ModelConfig
    from infer.models.load import model_folder
    from infer.models.loader.gguf_weights import gguf_file_for
    from infer.models.loader.manifest import ModelFolderError

    try:
        folder = model_folder(model)
        if ModelConfig.from_file(folder).model_type != "llama":  # quantization "gguf" reads Llama only
            return None
        return gguf_file_for(folder)
    except (ModelFolderError, OSError, RuntimeError) as error:  # a known alias's file, not found as it was
        logger.warning("dense weights: %s", error)
        return None
    except ValueError:  # a folder not converted from a known alias's GGUF file, or one the engine refuses
        return None
