"""Observers of the engine core's steps: what the core does besides serving, each in its module.

After each step's outputs are decided (`Scheduler.update`), the core hands them to its observers
in order (`StepObserver.on_step`); `EngineCore.stats()` pulls each observer's share of
`EngineStats` (`StepObserver.stats`). An observer may run requests of its own through the core's
add path (the prefix cache's shadow check does): it then takes their outputs out of the step's.
"""

from infer.engine.decision import ScheduleDecision
from infer.engine.protocol import EngineOutput, EngineRequest


class StepObserver:
    """Does nothing by default; an observer overrides what it needs."""

    def on_add(self, request: EngineRequest) -> None:
        """A request the core took in (refused ones too: they end in the next step's outputs)."""

    def on_step(
        self, decision: ScheduleDecision, outputs: list[EngineOutput], started_s: float
    ) -> list[EngineOutput]:
        """After a step that ran `decision` (started at time.perf_counter() `started_s`) and
        produced `outputs`: the outputs the next observer, and the core's owner, get."""
        return outputs

    def stats(self) -> dict:
        """This observer's EngineStats fields."""
        return {}
