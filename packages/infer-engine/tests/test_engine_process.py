"""Engine.spawn's core in a child process, seen from the frontend's side once that process dies:
the first read says so (EngineDeadError), new requests are refused with it and leave nothing
behind, and aborting what was in flight does not raise again."""

import os
import signal

import pytest

from infer.engine import Engine, EngineConfig, EngineDeadError, SamplingParams


def test_a_dead_engine_process_refuses_new_requests_and_lets_aborts_pass(tiny_checkpoints):
    engine = Engine.spawn(EngineConfig(model=str(tiny_checkpoints["llama-tiny"]), max_seq_len=64))
    try:
        in_flight = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True))
        os.kill(engine.client.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine process exited"):
            for _ in range(100):
                engine.step(wait_s=1.0)
        with pytest.raises(EngineDeadError):
            engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2), request_id="after")
        assert "after" not in engine.processor
        assert engine.abort(in_flight) is True
    finally:
        engine.shutdown()
