"""load_format="dummy" (vLLM's --load-format dummy): weights made at random on the device, none
read. The oracle is the real loader on a random checkpoint of the same preset: the same
parameters (names, shapes, dtypes, the tied head shared), and logits of the same spread (the
random-checkpoint rule: std ~4, a trained model's)."""

import pytest
import torch

from infer.models.forward_batch import ForwardBatch
from infer.models.load import load_causal_lm, model_folder
from infer.models.random_checkpoint import make_random_checkpoint

PROMPT = [[1, 17, 33, 5, 99, 250, 7, 3]]


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny", "gemma3-tiny"])
def test_dummy_weights_have_the_checkpoints_parameters_and_logit_spread(preset, tmp_path):
    real = load_causal_lm(make_random_checkpoint(preset, tmp_path / "real", dtype=torch.float32))
    bare = make_random_checkpoint(preset, tmp_path / "bare", dtype=torch.float32, weights=False)
    assert not list(bare.glob("*.safetensors"))
    dummy = load_causal_lm(bare, load_format="dummy")
    assert all(param.device.type == "cpu" for param in dummy.parameters())  # none left on meta
    shapes = {name: (param.shape, param.dtype) for name, param in real.named_parameters()}
    assert {name: (param.shape, param.dtype) for name, param in dummy.named_parameters()} == shapes
    assert (dummy.lm_head.weight is dummy.embed_tokens.weight) == (
        real.lm_head.weight is real.embed_tokens.weight
    )
    with torch.inference_mode():
        spreads = [
            model.compute_logits(model(ForwardBatch.from_tokens(PROMPT))).std().item()
            for model in (real, dummy)
        ]
    assert spreads[1] == pytest.approx(spreads[0], rel=0.5)
    # Made by a seeded generator: the same weights every time.
    again = load_causal_lm(bare, load_format="dummy")
    assert all(torch.equal(a, b) for a, b in zip(dummy.parameters(), again.parameters(), strict=True))


def test_a_presets_name_gives_its_config_and_tokenizer_without_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_HOME", str(tmp_path))
    folder = model_folder("llama-3.1-70b", load_format="dummy")
    assert folder == tmp_path / "models" / "dummy" / "llama-3.1-70b"
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert not list(folder.glob("*.safetensors"))
    with pytest.raises(ValueError, match="'dummy' makes dense weights; int8 is not made"):
        load_causal_lm(model_folder("llama-tiny", "dummy"), load_format="dummy", quantization="int8")
