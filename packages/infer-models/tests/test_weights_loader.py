"""Loading safetensors checkpoints: single file, shards, dtype cast, tied weights, and one clear
error for each way a checkpoint can be broken. The oracle is the checkpoint's own tensors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.models.load import load_causal_lm
from infer.models.loader.weights import CheckpointError, read_safetensors_header
from infer.models.random_checkpoint import make_random_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    # Untied head: both embed_tokens and lm_head are stored.
    return make_random_checkpoint("llama-tiny", tmp_path_factory.mktemp("llama"), dtype=torch.float32)


@pytest.fixture
def broken_copy(llama_dir, tmp_path):
    """A writable copy of the llama checkpoint and its tensors, to damage and save back."""
    folder = tmp_path / "ckpt"
    shutil.copytree(llama_dir, folder)
    return folder, load_file(folder / "model.safetensors")


def test_single_file_loads_every_tensor_and_fuses_projections(llama_dir):
    stored = load_file(llama_dir / "model.safetensors")
    model = load_causal_lm(llama_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    attn = "model.layers.1.self_attn"
    assert torch.equal(
        params["layers.1.self_attn.qkv_proj.weight"],
        torch.cat(
            [
                stored[f"{attn}.q_proj.weight"],
                stored[f"{attn}.k_proj.weight"],
                stored[f"{attn}.v_proj.weight"],
            ]
        ),
    )
    mlp = "model.layers.0.mlp"
    assert torch.equal(
        params["layers.0.mlp.gate_up_proj.weight"],
        torch.cat([stored[f"{mlp}.gate_proj.weight"], stored[f"{mlp}.up_proj.weight"]]),
    )
    assert torch.equal(params["lm_head.weight"], stored["lm_head.weight"])
    assert torch.equal(params["norm.weight"], stored["model.norm.weight"])
    assert all(p.device.type == "cpu" and not p.requires_grad for p in params.values())


def test_sharded_checkpoint_loads_the_same_weights(llama_dir, tmp_path):
    sharded = make_random_checkpoint("llama-tiny", tmp_path, shards=3, dtype=torch.float32)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    single = dict(load_causal_lm(llama_dir, dtype=torch.float32).named_parameters())
    from_shards = dict(load_causal_lm(sharded, dtype=torch.float32).named_parameters())
    assert single.keys() == from_shards.keys()
    assert all(torch.equal(single[name], from_shards[name]) for name in single)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_weights_are_cast_to_the_requested_dtype(llama_dir, dtype):
    stored = load_file(llama_dir / "model.safetensors")
    model = load_causal_lm(llama_dir, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert torch.equal(model.embed_tokens.weight, stored["model.embed_tokens.weight"].to(dtype))


def test_tied_embeddings_share_one_tensor(tmp_path):
    folder = make_random_checkpoint("qwen3-tiny", tmp_path, dtype=torch.float32)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    model = load_causal_lm(folder, dtype=torch.float32)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_missing_tensor_is_named(broken_copy):
    folder, tensors = broken_copy
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight"
    ):
        load_causal_lm(folder)


def test_unexpected_tensor_is_named(broken_copy):
    folder, tensors = broken_copy
    tensors["model.layers.9.mlp.gate_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"unexpected tensors: model\.layers\.9\.mlp\.gate_proj\.weight"
    ):
        load_causal_lm(folder)


def test_static_kv_cache_scales_are_read_past(broken_copy):
    """vLLM's fp8 KV scales: our fp8 cache computes its own per token, so they are not needed."""
    folder, tensors = broken_copy
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, folder / "model.safetensors")
    assert "model.layers.0.self_attn.k_scale" not in dict(load_causal_lm(folder).named_parameters())


def test_wrong_shape_names_tensor_and_both_shapes(broken_copy):
    folder, tensors = broken_copy
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].T.contiguous()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=rf"wrong shapes: {name}: expected \[64, 128\], got \[128, 64\]"
    ):
        load_causal_lm(folder)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda raw: raw[:5], "shorter than the 8-byte header length"),
        (lambda raw: (10**12).to_bytes(8, "little") + raw[8:], "exceeds the file"),
        (lambda raw: raw[:8] + b"{not json" + raw[17:], "header is not JSON"),
    ],
    ids=["truncated", "huge-length", "garbage-json"],
)
def test_corrupt_header_is_a_value_error_naming_the_file(broken_copy, damage, reason):
    folder, _ = broken_copy
    path = folder / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=rf"{path}: corrupt safetensors header \(.*{reason}"):
        load_causal_lm(folder)


def test_header_reader_agrees_with_safetensors(llama_dir):
    header = read_safetensors_header(llama_dir / "model.safetensors")
    stored = load_file(llama_dir / "model.safetensors")
    assert {name: info.shape for name, info in header.items()} == {
        n: tuple(t.shape) for n, t in stored.items()
    }


def test_index_naming_an_absent_shard_is_reported(tmp_path):
    folder = make_random_checkpoint("llama-tiny", tmp_path, shards=2, dtype=torch.float32)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="names shard model-00002-of-00002.safetensors"):
        load_causal_lm(folder)
