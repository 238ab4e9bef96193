"""The core's request and token counters, and its busy time, counted from each step's outputs."""

import time

from infer.engine.decision import ScheduleDecision
from infer.engine.observers import StepObserver
from infer.engine.protocol import EngineOutput, FinishReason


class StepCounters(StepObserver):
    """EngineStats' num_steps, token totals, finished / aborted / failed requests and busy time,
    over the outputs the core's owner gets."""

    def __init__(self):
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished = {reason: 0 for reason in FinishReason}
        self.busy_time_s = 0.0
        # Busy time of the steps that ran prompt tokens (a mixed step counts whole).
        self.prefill_time_s = 0.0

    def on_step(
        self, decision: ScheduleDecision, outputs: list[EngineOutput], started_s: float
    ) -> list[EngineOutput]:
        for output in outputs:
            self.num_generation_tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                self.num_finished[output.finish_reason] += 1
        if outputs or not decision.is_empty:
            self.num_steps += 1
            self.num_prompt_tokens += decision.num_prompt_tokens
            step_time_s = time.perf_counter() - started_s
            self.busy_time_s += step_time_s
            if decision.num_prompt_tokens:
                self.prefill_time_s += step_time_s
        return outputs

    def stats(self) -> dict:
        busy, prefill = self.busy_time_s, self.prefill_time_s
        return dict(
            num_steps=self.num_steps,
            num_prompt_tokens_total=self.num_prompt_tokens,
            num_generation_tokens_total=self.num_generation_tokens,
            num_finished=self.num_finished[FinishReason.STOP] + self.num_finished[FinishReason.LENGTH],
            num_aborted=self.num_finished[FinishReason.ABORT],
            num_failed=self.num_finished[FinishReason.ERROR],
            busy_time_s=busy,
            prompt_tokens_per_s=self.num_prompt_tokens / prefill if prefill else 0.0,
            generation_tokens_per_s=self.num_generation_tokens / busy if busy else 0.0,
        )
