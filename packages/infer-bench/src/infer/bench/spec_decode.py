"""Speculative decoding's figures over a benchmark's timed run: from the engine's counters
(EngineStats, `infer bench generate`) or from the server's Prometheus counters (`infer bench
serve`: ours, infer_spec_decode_*, or vLLM's, vllm:spec_decode_num_*), each read before and after
the run. None where the engine or server does not speculate.

  verified_rows         rows (one request in one step) that verified drafts (vLLM: num_drafts)
  draft_tokens          draft tokens verified
  accepted_tokens       draft tokens the target accepted
  acceptance_rate       accepted_tokens / draft_tokens
  mean_accepted_length  1 + accepted_tokens / verified_rows: tokens a verifying row emits in its
                        step (its accepted drafts and the target's own), vLLM's convention
  accepted_by_position  rows whose draft j (0-based) was accepted, and over verified_rows
  acceptance_rate_by_position
"""

import math

# Our server's counter names and vLLM's: drafts (verified rows), draft tokens, accepted tokens,
# accepted tokens by position (label "position").
PROMETHEUS_NAMES = (
    (
        "infer_spec_decode_drafts_total",
        "infer_spec_decode_draft_tokens_total",
        "infer_spec_decode_accepted_tokens_total",
        "infer_spec_decode_accepted_tokens_per_pos_total",
    ),
    (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    ),
)


def spec_decode_summary(
    verified_rows: int, draft_tokens: int, accepted_tokens: int, accepted_by_position: list[int]
) -> dict:
    """The figures (see the module) from a run's counts."""
    return {
        "verified_rows": verified_rows,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted_tokens,
        "acceptance_rate": accepted_tokens / draft_tokens if draft_tokens else math.nan,
        "mean_accepted_length": 1 + accepted_tokens / verified_rows if verified_rows else math.nan,
        "accepted_by_position": accepted_by_position,
        "acceptance_rate_by_position": [
            count / verified_rows if verified_rows else math.nan for count in accepted_by_position
        ],
    }


def spec_decode_from_engine_stats(before, after) -> dict | None:
    """Between two infer.engine EngineStats; None when the engine does not speculate."""
    if not after.spec_decode_num_speculative_tokens:
        return None
    k = after.spec_decode_num_speculative_tokens

    def by_position(stats) -> list[int]:
        counts = list(stats.spec_decode_accepted_by_position)
        return counts + [0] * (k - len(counts))

    return spec_decode_summary(
        after.spec_decode_num_verified_rows - before.spec_decode_num_verified_rows,
        after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
        after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
        [a - b for a, b in zip(by_position(after), by_position(before), strict=True)],
    )


def spec_decode_from_metrics(before: dict, after: dict) -> dict | None:
    """Between two scrapes of /metrics (server_info.parse_prometheus_text), samples summed over
    labels other than `position` (vLLM labels by model and engine); None when the server shows no
    speculative-decoding counters."""
    for drafts, draft_tokens, accepted, per_position in PROMETHEUS_NAMES:
        if not any(name == drafts for name, _ in after):
            continue

        def gained(name: str, position: str | None = None) -> float:
            def total(samples: dict) -> float:
                return sum(
                    value
                    for (sample, labels), value in samples.items()
                    if sample == name and (position is None or dict(labels).get("position") == position)
                )

            return total(after) - total(before)

        positions = sorted(
            {dict(labels)["position"] for name, labels in after if name == per_position},
            key=int,
        )
        return spec_decode_summary(
            int(gained(drafts)),
            int(gained(draft_tokens)),
            int(gained(accepted)),
            [int(gained(per_position, position)) for position in positions],
        )
    return None


def spec_decode_line(figures: dict) -> str:
    """One line for a markdown report."""
    by_position = ", ".join(f"{100 * rate:.1f}%" for rate in figures["acceptance_rate_by_position"])
    return (
        f"speculative decoding: acceptance {100 * figures['acceptance_rate']:.1f}% "
        f"({figures['accepted_tokens']} of {figures['draft_tokens']} draft tokens), mean accepted "
        f"length {figures['mean_accepted_length']:.2f} tokens per verifying step "
        f"({figures['verified_rows']} rows); accepted by draft position: {by_position or '-'}"
    )
