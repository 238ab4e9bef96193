"""`infer bench compare`: runs of one multi-turn workload on several server setups, compared on the
turns that every one of them completed.

Runs of the same workload and seed send the same requests: session i's turn t is the same prompt
in every setup (while greedy replies agree, which `prompt_tokens_differ` checks). Under a time cap
(`--duration-s`) a slow setup gets through fewer turns, so its own "TTFT p50 of turns >= 3"
covers earlier, shorter turns than a fast setup's, and the ratio of the two is unfair. Here the
TTFT is taken over pairs instead: the (session index, turn) pairs of turns 3 and later (the
report's numbering: turn 1 is the first, record `turn` 0) that every setup completed, i.e. has a
first token for (a stream that failed after its first token still timed its TTFT).

Result (compare_reports), each figure per setup keyed by its name, the first setup the baseline:
  workload   the runs' common workload description
  setups     the whole run as each report says it: output_tokens_per_s, prefill computed and reused
             prompt tokens (None when the server did not report its prefix cache), its own
             ttft_p50_turns_from_3_s and how many turns >= 3 that covers, duration_s and
             stopped_by_duration (None without a cap)
  paired     pairs (of turns >= 3), ttft_p50_s, ttft_p99_s, ttft_p50_ratio_to_baseline,
             prompt_tokens_differ (pairs whose prompt token counts differ between setups)
  per_turn   per turn (1: the first) of the pairs every setup completed: pairs and ttft_p50_s
Only pass 1 is compared: a report's records are pass 1's (--passes puts the others aside).
"""

from infer.bench.serving.report import duration_line, markdown_table
from infer.bench.serving.stats import percentile

# Records' `turn` counts from 0; the report's "turns >= 3" (stats.turn_stats) are turn >= 2.
FIRST_PAIRED_TURN = 2


def compare_reports(reports: list[dict], names: list[str]) -> dict:
    """The comparison of `reports` (as `infer bench serve --json` writes them) named `names`; the
    first is the baseline. ValueError for fewer than two, other workloads or seeds, reports
    without records, or no pair of turns >= 3 that every setup completed."""
    if len(reports) < 2:
        raise ValueError(f"compare needs two reports or more, got {len(reports)}")
    if len(names) != len(reports) or len(set(names)) != len(names):
        raise ValueError(f"need one distinct name per report ({len(reports)}), got {names} (--names)")
    baseline = reports[0]["workload"]
    for name, report in zip(names[1:], reports[1:], strict=True):
        differ = sorted(
            key
            for key in baseline.keys() | report["workload"].keys()
            if baseline.get(key) != report["workload"].get(key)
        )
        if differ:
            detail = ", ".join(
                f"{key} {baseline.get(key)!r} vs {report['workload'].get(key)!r}" for key in differ
            )
            raise ValueError(
                f"{names[0]} and {name} ran different workloads ({detail}): their turns are not the same"
            )
    timed_records = []  # per setup: (index, turn) -> its record
    for name, report in zip(names, reports, strict=True):
        if not report.get("records"):
            raise ValueError(
                f"{name} has no per-request records (run `infer bench serve` without --no-records)"
            )
        timed_records.append(
            {(r["index"], r["turn"]): r for r in report["records"] if r["ttft_s"] is not None}
        )
    common = sorted(set.intersection(*(set(timed) for timed in timed_records)))
    later = [pair for pair in common if pair[1] >= FIRST_PAIRED_TURN]
    if not later:
        raise ValueError(
            f"no (session, turn) pair of turns >= {FIRST_PAIRED_TURN + 1} that every setup completed"
        )
    paired_p50 = _ttft_percentiles(timed_records, names, later)
    per_turn = []
    for turn in sorted({turn for _, turn in common}):
        pairs = [pair for pair in common if pair[1] == turn]
        per_turn.append(
            {
                "turn": turn + 1,
                "pairs": len(pairs),
                "ttft_p50_s": _ttft_percentiles(timed_records, names, pairs),
            }
        )
    return {
        "workload": baseline,
        "baseline": names[0],
        "setups": {name: _whole_run(report["stats"]) for name, report in zip(names, reports, strict=True)},
        "paired": {
            "turns_from": FIRST_PAIRED_TURN + 1,
            "pairs": len(later),
            "ttft_p50_s": paired_p50,
            "ttft_p99_s": _ttft_percentiles(timed_records, names, later, q=99),
            "ttft_p50_ratio_to_baseline": {
                name: p50 / paired_p50[names[0]] for name, p50 in paired_p50.items()
            },
            "prompt_tokens_differ": sum(
                len({t[pair]["num_prompt_tokens"] for t in timed_records}) > 1 for pair in later
            ),
        },
        "per_turn": per_turn,
    }


def _ttft_percentiles(
    timed_records: list[dict], names: list[str], pairs: list[tuple[int, int]], q: float = 50
) -> dict:
    """Per setup: the q-th percentile of its TTFT over `pairs`."""
    return {
        name: percentile([timed[pair]["ttft_s"] for pair in pairs], q)
        for name, timed in zip(names, timed_records, strict=True)
    }


def _whole_run(stats: dict) -> dict:
    """What a report says of its whole run (pass 1)."""
    cache, turns = stats.get("prefix_cache"), stats.get("turns")
    return {
        "output_tokens_per_s": stats["output_tokens_per_s"],
        "prefill_computed_tokens": cache["computed_tokens"] if cache else None,
        "prefill_reused_tokens": cache["cached_tokens"] if cache else None,
        "ttft_p50_turns_from_3_s": turns["ttft_p50_turns_from_3_s"] if turns else None,
        "turns_from_3": sum(one["num_ok"] for one in turns["per_turn"] if one["turn"] >= 3) if turns else 0,
        "duration_s": stats.get("duration_s"),
        "stopped_by_duration": stats.get("stopped_by_duration"),
    }


def compare_markdown(comparison: dict) -> str:
    """The setups side by side: the whole runs and the paired TTFT, then a row per turn."""
    workload, paired = comparison["workload"], comparison["paired"]
    names = list(comparison["setups"])
    lines = [
        f"## {workload['name']}, seed {workload['seed']}, concurrency {workload['concurrency']}: "
        + ", ".join(names),
        "",
        f"Paired: TTFT over the {paired['pairs']} (session, turn) pairs of turns >= {paired['turns_from']} "
        f"that every setup completed; ratio: paired TTFT p50 over {comparison['baseline']}'s. Own: each "
        "run's figure over the turns it completed (a faster setup's reach later, longer turns).",
        "",
    ]
    header = [
        "setup", "out tok/s", "prefill computed", "reused", "TTFT p50 turns >= 3, own (ms)", "own turns",
        "paired pairs", "paired TTFT p50 (ms)", "paired TTFT p99 (ms)", "ratio to baseline",
    ]  # fmt: skip
    rows = []
    for name, setup in comparison["setups"].items():
        rows.append([
            name,
            f"{setup['output_tokens_per_s']:.1f}",
            _count(setup["prefill_computed_tokens"]),
            _count(setup["prefill_reused_tokens"]),
            _ms(setup["ttft_p50_turns_from_3_s"]),
            str(setup["turns_from_3"]),
            str(paired["pairs"]),
            _ms(paired["ttft_p50_s"][name]),
            _ms(paired["ttft_p99_s"][name]),
            f"{paired['ttft_p50_ratio_to_baseline'][name]:.2f}",
        ])  # fmt: skip
    lines.append(markdown_table(header, rows))
    capped = [
        (name, setup) for name, setup in comparison["setups"].items() if setup["duration_s"] is not None
    ]
    if capped:
        lines += ["", *(f"- {name}: {duration_line(setup, workload['kind'])}" for name, setup in capped)]
    if paired["prompt_tokens_differ"]:
        lines += [
            "",
            f"Note: {paired['prompt_tokens_differ']} pairs differ in prompt tokens between setups (replies "
            "that differed change the later turns' prompts): those turns are not the same requests",
        ]
    lines += ["", "Per turn, on the pairs every setup completed:", ""]
    per_turn_header = ["turn", "pairs", *(f"TTFT p50 {name} (ms)" for name in names)]
    per_turn = [
        [str(one["turn"]), str(one["pairs"]), *(_ms(one["ttft_p50_s"][name]) for name in names)]
        for one in comparison["per_turn"]
    ]
    lines.append(markdown_table(per_turn_header, per_turn))
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)
