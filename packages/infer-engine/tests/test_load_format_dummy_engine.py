"""An engine over dummy weights (`load_format="dummy"`, a preset's name as the model): it serves
as over a checkpoint. The oracle: the recompute oracle over the same dummy model, loaded alone."""

import torch

from conformance.engine_runs import run_to_completion, token_ids
from conformance.oracles import RecomputeOracle
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.sampling_params import SamplingParams
from infer.models.load import load_model

from .test_engine import random_prompts


def test_an_engine_over_a_presets_dummy_weights_gives_the_recompute_oracles_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_HOME", str(tmp_path))
    config = EngineConfig(model="qwen3-tiny", load_format="dummy", dtype="float32", max_seq_len=128)
    engine = Engine(config)
    oracle = RecomputeOracle(load_model("qwen3-tiny", dtype=torch.float32, load_format="dummy"))
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = random_prompts([9, 30], 384, seed=5)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs = run_to_completion(engine)
    assert [token_ids(outputs[i]) for i in ids] == [oracle.generate(p, params).token_ids for p in prompts]
