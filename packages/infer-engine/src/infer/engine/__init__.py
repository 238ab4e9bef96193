"""Sampling, stop handling and generation: the loop that turns a prompt into streamed text."""

from infer.engine._version import INTERFACE_VERSION, __version__
from infer.engine.eos import collect_eos_token_ids
from infer.engine.forward_paths import CachedForward, RecomputeForward
from infer.engine.generate import GenerationChunk, GenerationResult, SingleRequestGenerator
from infer.engine.sampler import make_generator, sample_next_tokens
from infer.engine.sampling_params import SamplingParams
from infer.engine.stop import FINISH_LENGTH, FINISH_STOP, StopChecker, StopStringMatcher

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "INTERFACE_VERSION",
    "CachedForward",
    "GenerationChunk",
    "GenerationResult",
    "RecomputeForward",
    "SamplingParams",
    "SingleRequestGenerator",
    "StopChecker",
    "StopStringMatcher",
    "__version__",
    "collect_eos_token_ids",
    "make_generator",
    "sample_next_tokens",
]

# The serving engine: config, requests, scheduler, runner (appended after the generation names
# above, which another change owns; imports here come after __all__ on purpose).
from infer.engine.config import EngineConfig, EngineConfigError, add_cli_arguments, from_cli_args  # noqa: E402
from infer.engine.engine import Engine, EngineStats  # noqa: E402
from infer.engine.request import (  # noqa: E402
    FINISH_ABORT,
    QueueFullError,
    Request,
    RequestState,
    RequestTooLongError,
    StepOutput,
)
from infer.engine.runner import ModelRunner  # noqa: E402
from infer.engine.scheduler import PrefillChunk, ScheduleDecision, Scheduler  # noqa: E402

__all__ += [
    "FINISH_ABORT",
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineStats",
    "ModelRunner",
    "PrefillChunk",
    "QueueFullError",
    "Request",
    "RequestState",
    "RequestTooLongError",
    "ScheduleDecision",
    "Scheduler",
    "StepOutput",
    "add_cli_arguments",
    "from_cli_args",
]
