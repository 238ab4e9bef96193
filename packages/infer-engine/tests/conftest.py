"""Models shared by the engine tests, loaded once per session (loading dominates CPU test time)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conformance.oracles import RecomputeOracle
from infer.engine import Engine, EngineConfig, GenerationResult, SamplingParams, generate
from infer.models.load import load_model
from infer.models.random_checkpoint import make_random_checkpoint

TINY_PRESETS = ["llama-tiny", "qwen3-tiny", "gemma3-tiny"]


def run_together(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    """Every request queued at once, then stepped to the end: per request, in order, its tokens,
    the most cached tokens an output reported, and its embedding and prompt logprobs (None where
    none came; each comes once)."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    results = {
        request_id: {"tokens": [], "cached": 0, "embedding": None, "prompt_logprobs": None}
        for request_id in ids
    }
    while engine.has_work():
        for output in engine.step():
            result = results[output.request_id]
            assert output.error is None, output.error
            if output.token_id is not None:
                result["tokens"].append(output.token_id)
            for name in ("embedding", "prompt_logprobs"):
                if getattr(output, name) is not None:
                    assert result[name] is None, f"{name} came twice"
                    result[name] = getattr(output, name)
            result["cached"] = max(result["cached"], output.cached_tokens)
    return [results[request_id] for request_id in ids]


def cuda_engine(checkpoint) -> Engine:
    """An engine on CUDA in float32 over `checkpoint` with what GPU steps add, CUDA graphs and async
    scheduling, and chunks of 16 tokens with the prefix cache (steps that pool or score prompts run
    eagerly beside graph-replayed ones)."""
    loaded = load_model(checkpoint, dtype=torch.float32, device="cuda")
    config = EngineConfig(
        device="cuda",
        dtype="float32",
        max_batch_size=4,
        max_seq_len=128,
        use_chunked_prefill=True,
        prefill_chunk_size=16,
        use_prefix_caching=True,
        use_cuda_graphs=True,
        async_scheduling=True,
    )
    return Engine(config, loaded_model=loaded)


def drop_weight_files(folder) -> None:
    """Deletes a checkpoint folder's weight files once its model is loaded on the device: nothing
    reads them again, and a real shape's take gigabytes in every pytest-xdist worker that loads
    it (with the tests' other checkpoints they filled the GPU machine's 64 GiB disk)."""
    for weights in folder.glob("*.safetensors"):
        weights.unlink()


class ModelUnderTest:
    """Our loaded model, an engine over it (on demand), the recompute oracle, and transformers'
    model (on demand)."""

    def __init__(self, path_or_alias):
        self.loaded = load_model(path_or_alias, dtype=torch.float32)
        self.oracle = RecomputeOracle(self.loaded)
        self._engine = None
        self._reference = None

    @property
    def engine(self) -> Engine:
        """An engine with the default config (one request at a time is all these tests need)."""
        if self._engine is None:
            max_seq_len = min(512, self.loaded.config.max_position_embeddings)
            config = EngineConfig(max_batch_size=2, max_seq_len=max_seq_len)
            self._engine = Engine(config, loaded_model=self.loaded)
        return self._engine

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Through the engine core, as `infer generate` does."""
        return generate(self.engine, prompt_ids, params)

    @property
    def reference(self):
        """transformers' eager model on the same folder: the independent oracle."""
        if self._reference is None:
            self._reference = AutoModelForCausalLM.from_pretrained(
                self.loaded.path, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return self._reference

    def chat_ids(self, question: str) -> list[int]:
        prompt = self.loaded.chat_template.render([{"role": "user", "content": question}])
        return self.loaded.tokenizer.encode(prompt, add_special_tokens=False)

    def transformers_greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """transformers' greedy tokens, stopping at our EOS set (its own stops at a subset)."""
        eos = sorted(self.oracle.eos_token_ids)
        input_ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            output = self.reference.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
        return output[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def smollm2() -> ModelUnderTest:
    return ModelUnderTest("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3() -> ModelUnderTest:
    return ModelUnderTest("gemma-3-270m")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {
        preset: make_random_checkpoint(preset, root / preset, dtype=torch.float32) for preset in TINY_PRESETS
    }


@pytest.fixture(scope="session")
def tiny_models(tiny_checkpoints) -> dict[str, ModelUnderTest]:
    return {preset: ModelUnderTest(folder) for preset, folder in tiny_checkpoints.items()}
