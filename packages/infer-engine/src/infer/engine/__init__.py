"""The engine: config, requests, scheduler, KV manager, runner, sampler, stop rules, the engine
core (token ids only) and its clients, and the frontend's Engine over them (the server's, and
`generate` / `stream` without a server)."""

from infer.engine._version import INTERFACE_VERSION, __version__
from infer.engine.client import EngineClient, EngineDeadError, InProcClient
from infer.engine.config import EngineConfig, EngineConfigError, add_cli_arguments, from_cli_args
from infer.engine.decision import NewRequest, RunnerOutput, RunningRequest, ScheduleDecision
from infer.engine.engine import Engine, load_engine
from infer.engine.engine_core import EngineCore
from infer.engine.eos import collect_eos_token_ids, eos_token_ids_of
from infer.engine.generate import GenerationChunk, GenerationResult, generate, stream
from infer.engine.kv_manager import KVCacheManager
from infer.engine.output_processor import OutputProcessor, StepOutput
from infer.engine.protocol import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    CoreLimits,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    EngineStats,
    FinishReason,
)
from infer.engine.request import QueueFullError, Request, RequestState, RequestTooLongError
from infer.engine.runner import ModelRunner
from infer.engine.sampler import SamplingTensors, make_generator, sample, sample_next_tokens
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Scheduler
from infer.engine.stop import StopChecker, StopStringMatcher

__all__ = [
    "FINISH_ABORT",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "INTERFACE_VERSION",
    "CoreLimits",
    "Engine",
    "EngineClient",
    "EngineConfig",
    "EngineConfigError",
    "EngineCore",
    "EngineDeadError",
    "EngineOutput",
    "EngineOutputs",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "GenerationChunk",
    "GenerationResult",
    "InProcClient",
    "KVCacheManager",
    "ModelRunner",
    "NewRequest",
    "OutputProcessor",
    "QueueFullError",
    "Request",
    "RequestState",
    "RequestTooLongError",
    "RunnerOutput",
    "RunningRequest",
    "SamplingParams",
    "SamplingTensors",
    "ScheduleDecision",
    "Scheduler",
    "StepOutput",
    "StopChecker",
    "StopStringMatcher",
    "__version__",
    "add_cli_arguments",
    "collect_eos_token_ids",
    "eos_token_ids_of",
    "from_cli_args",
    "generate",
    "load_engine",
    "make_generator",
    "sample",
    "sample_next_tokens",
    "stream",
]
