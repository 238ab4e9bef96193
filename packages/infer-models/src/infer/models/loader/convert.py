"""Turn a GGUF file into a standard Hugging Face folder (bfloat16 safetensors, tokenizer, configs).

transformers dequantizes the GGUF (and undoes llama.cpp's own layout changes: the Q/K row
permutation of Llama, Gemma's norm weights stored as 1 + w). We then write the folder ourselves,
because `save_pretrained` refuses a model that was loaded from GGUF.

Any change to the files written here must bump `fetch.CONVERSION_VERSION`, so that cached
folders made by the old code are converted again.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"
EMBEDDING_WEIGHT = "model.embed_tokens.weight"
LM_HEAD_WEIGHT = "lm_head.weight"


def convert_gguf_to_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to `out_dir`.

    Takes 10-60 s on a CPU for the small models we ship aliases for; memory peaks near twice the
    bfloat16 model size.
    """
    # transformers is imported here, not at module level: fetching a cached model must stay cheap.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The template goes into tokenizer_config.json (not a separate chat_template.jinja), where
    # readers of HF folders look first and where our tests compare our ChatML rendering with it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16
    )
    _write_config(model, out_dir / CONFIG_FILE)
    model.generation_config.save_pretrained(out_dir)
    save_file(_weights_to_save(model), out_dir / WEIGHTS_FILE, metadata={"format": "pt"})


def _write_config(model, path: Path) -> None:
    config = model.config.to_dict()
    # The weights we write are plain bfloat16: a quantization section would make loaders
    # (transformers included) look for the GGUF file again.
    config.pop("quantization_config", None)
    # Where the GGUF happened to lie (a virtualenv, a scratch folder) is no part of the model,
    # and would make two conversions of the same file differ.
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "bfloat16"
    config["torch_dtype"] = "bfloat16"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _weights_to_save(model) -> dict[str, torch.Tensor]:
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings and LM_HEAD_WEIGHT in tensors:
        # Tied weights share storage, which safetensors refuses to write; HF checkpoints with
        # tied embeddings carry the embedding alone and loaders tie lm_head back to it.
        if not torch.equal(tensors[LM_HEAD_WEIGHT], tensors[EMBEDDING_WEIGHT]):
            raise ValueError(
                "config says tie_word_embeddings but lm_head.weight differs from the embedding; "
                "the GGUF conversion is inconsistent: report it with the GGUF file's name"
            )
        del tensors[LM_HEAD_WEIGHT]
    return tensors
