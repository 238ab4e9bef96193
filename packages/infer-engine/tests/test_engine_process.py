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


def test_the_engine_process_exits_cleanly_without_nanobind_leak_warnings(tiny_checkpoints, capfd):
    """The core freezes what start-up built out of the collector's sight, Triton's MLIR objects
    among it; an interpreter teardown then has nanobind print "leaked N instances" and a line for
    each (27 lines on every `infer serve` shutdown) into the server's stderr, which the child
    shares: captured here at the file descriptor."""
    engine = Engine.spawn(EngineConfig(model=str(tiny_checkpoints["llama-tiny"]), max_seq_len=64))
    engine.shutdown()
    assert engine.client.process.exitcode == 0
    stderr = capfd.readouterr().err
    assert "leaked" not in stderr, stderr


def test_spawn_raises_the_loaders_error_when_the_tokenizer_cannot_load(tiny_checkpoints, tmp_path):
    """The frontend's tokenizer loads while the child builds (Engine.spawn): a folder whose
    tokenizer is broken fails both, and the error raised is the loader's, as
    `load_model_info` raises it in this process, not the child's EngineStartError."""
    import shutil

    from infer.engine.engine_process import EngineStartError
    from infer.models.load import load_model_info

    folder = tmp_path / "broken-tokenizer"
    shutil.copytree(tiny_checkpoints["llama-tiny"], folder)
    (folder / "tokenizer.json").write_text("{ not json")
    with pytest.raises(Exception) as expected:
        load_model_info(folder)
    assert not isinstance(expected.value, EngineStartError)
    with pytest.raises(type(expected.value)) as raised:
        Engine.spawn(EngineConfig(model=str(folder), max_seq_len=64))
    assert str(raised.value) == str(expected.value)
