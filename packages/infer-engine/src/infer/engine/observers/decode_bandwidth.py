"""Decode against the memory roofline: what decode steps that ran back to back read and took
(EngineStats.decode_*; `infer.engine.roofline`)."""

from infer.engine.decision import ScheduleDecision
from infer.engine.observers import StepObserver
from infer.engine.protocol import EngineOutput
from infer.engine.roofline import DecodeTraffic


class DecodeBandwidth(StepObserver):
    def __init__(self, decode_traffic: DecodeTraffic, copy_bandwidth: float):
        self.decode_traffic = decode_traffic
        self.copy_bandwidth = copy_bandwidth
        self._previous_decode: tuple[float, int] | None = None  # (started, bytes) of the last step
        self.decode_bytes_total = 0
        self.decode_time_s_total = 0.0

    def on_step(
        self, decision: ScheduleDecision, outputs: list[EngineOutput], started_s: float
    ) -> list[EngineOutput]:
        """Counts the previous step's bytes and its time (to this step's start) when both were
        decode steps: between those, nothing but decoding (no prompt, no idle wait) took time."""
        decode_bytes = None
        if not decision.num_prompt_tokens and not decision.is_empty:
            decode_bytes = self._decode_bytes(decision)
        previous = self._previous_decode
        if previous is not None and decode_bytes is not None:
            self.decode_bytes_total += previous[1]
            self.decode_time_s_total += started_s - previous[0]
        self._previous_decode = None if decode_bytes is None else (started_s, decode_bytes)
        return outputs

    def _decode_bytes(self, decision: ScheduleDecision) -> int:
        """What the decode step `decision` reads: the weights, and each sequence's K/V (a decode
        step schedules running requests only)."""
        scheduled = decision.num_scheduled_tokens
        return self.decode_traffic.step_bytes(
            [
                running.num_computed_tokens + scheduled[running.request_id]
                for running in decision.running_requests
            ]
        )

    def stats(self) -> dict:
        return dict(
            decode_bytes_total=self.decode_bytes_total,
            decode_time_s_total=self.decode_time_s_total,
            copy_bandwidth_bytes_per_s=self.copy_bandwidth,
        )
