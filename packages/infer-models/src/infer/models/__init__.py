"""Loading Hugging Face checkpoints into our own Llama 3, Qwen 3 and Gemma 3 code.

loaded = load_model("smollm2-135m-instruct")         # alias or folder
batch = ForwardBatch.from_tokens([loaded.tokenizer.encode("Hi", add_special_tokens=True)])
logits = loaded.model.compute_logits(loaded.model(batch))   # [N, vocab]: the rows' tokens back to back
next_id = int(batch.rows(logits)[0][-1].argmax())             # row 0's last token

A ForwardBatch is flat (forward_batch.py): without a cache (above) each row attends to its own
tokens; with one, its AttentionMetadata and kv_layers say where every token's K/V lives.
"""

from infer.models._version import INTERFACE_VERSION, __version__
from infer.models.activation_diff import LayerDiff, activation_diffs, first_departure
from infer.models.attention import attention
from infer.models.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateKwargsError,
    chat_template_families,
    chat_template_for,
    detect_family,
    read_tokenizer_config,
)
from infer.models.common import CausalLM
from infer.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeConfig
from infer.models.forward_batch import AttentionMetadata, ForwardBatch
from infer.models.gemma3 import Gemma3ForCausalLM
from infer.models.kernel_policy import KernelPolicy, apply_kernel_policy
from infer.models.llama import LlamaForCausalLM
from infer.models.load import LoadedModel, ModelInfo, load_causal_lm, load_model, load_model_info
from infer.models.loader.fetch import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    CachedModel,
    fetch_model,
    infer_home,
    list_cached_models,
    models_dir,
)
from infer.models.loader.manifest import ModelFolderError, verify_model_folder
from infer.models.loader.tokenizer import IncrementalDetokenizer, Tokenizer
from infer.models.loader.weights import CheckpointError, load_weights, read_safetensors_header
from infer.models.qwen3 import Qwen3ForCausalLM
from infer.models.random_checkpoint import PRESETS, make_random_checkpoint
from infer.models.registry import ARCHITECTURES, Architecture, architecture_for, registered_model_types

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_MODEL",
    "FULL_ATTENTION",
    "INTERFACE_VERSION",
    "KNOWN_MODELS",
    "PRESETS",
    "SLIDING_ATTENTION",
    "Architecture",
    "AttentionMetadata",
    "CachedModel",
    "CausalLM",
    "ChatTemplate",
    "ChatTemplateError",
    "ChatTemplateKwargsError",
    "CheckpointError",
    "ForwardBatch",
    "Gemma3ForCausalLM",
    "IncrementalDetokenizer",
    "KernelPolicy",
    "LayerDiff",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelFolderError",
    "ModelInfo",
    "Qwen3ForCausalLM",
    "RopeConfig",
    "Tokenizer",
    "__version__",
    "activation_diffs",
    "apply_kernel_policy",
    "architecture_for",
    "attention",
    "chat_template_families",
    "chat_template_for",
    "detect_family",
    "fetch_model",
    "first_departure",
    "infer_home",
    "list_cached_models",
    "load_causal_lm",
    "load_model",
    "load_model_info",
    "load_weights",
    "make_random_checkpoint",
    "models_dir",
    "read_safetensors_header",
    "read_tokenizer_config",
    "registered_model_types",
    "verify_model_folder",
]
