"""The benchmark report: JSON (everything) and markdown tables (the numbers a reader compares).

JSON layout of one `infer bench serve` run (runner.benchmark_server):
  kind, created_unix_s, base_url, model
  workload   name, kind, concurrency, num_requests, seed, length ranges
  client     host, platform, python and package versions
  server     /v1/models as served, /health status, endpoints that were missing, engine_config
             (from --engine-config FILE, else /v1/models), memory gauges and raw /metrics after the run
  ignore_eos_sent, notes
  stats      see stats.py (each latency: count, mean, p50, p95, p99, in seconds); with --passes,
             pass 1's; multi-turn runs (W5, W7) add `turns`, per turn and from turn 3 on;
             `duration_s` (--duration-s) and `stopped_by_duration`, what that time cap left out
  probe      the idle-server prefill probe
  records    one per request: send/first-token/chunk/end times, tokens, finish reason, error
  later_passes  with --passes N > 1, passes 2..N: pass, stats, ttft_p50_ratio_to_pass_1, records
"""

import json
from pathlib import Path

from infer.bench.spec_decode import spec_decode_line
from infer.bench.vision import VISION_HEADER, vision_cells

LATENCY_COLUMNS = (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def _ms(summary: dict | None, key: str) -> str:
    return "-" if not summary or key not in summary else f"{summary[key] * 1000:.1f}"


def stats_header() -> list[str]:
    latencies = [f"{label} {p} (ms)" for _, label in LATENCY_COLUMNS for p in ("mean", "p50", "p99")]
    return ["out tok/s", "req/s", *latencies, "queue wait mean (ms)", "errors"]


def stats_cells(stats: dict) -> list[str]:
    cells = [f"{stats['output_tokens_per_s']:.1f}", f"{stats['requests_per_s']:.2f}"]
    for key, _ in LATENCY_COLUMNS:
        cells += [_ms(stats[key], "mean"), _ms(stats[key], "p50"), _ms(stats[key], "p99")]
    cells += [_ms(stats["queue_wait_s"], "mean"), str(stats["num_errors"])]
    return cells


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _runs_table(report: dict) -> str:
    """A row per pass (one without --passes): the statistics, then with passes the pass and its
    TTFT p50 over pass 1's, then the vision tower's figures where the server has one."""
    workload = report["workload"]
    later = report.get("later_passes", [])
    passes = [{"pass": 1, "stats": report["stats"], "ttft_p50_ratio_to_pass_1": None}, *later]
    sees = any(one["stats"].get("vision") for one in passes)
    header = ["workload", "conc", *stats_header()]
    header += ["pass", "TTFT p50 x pass 1"] * bool(later) + [*VISION_HEADER] * sees
    rows = []
    for one in passes:
        row = [workload["name"], str(workload["concurrency"]), *stats_cells(one["stats"])]
        if later:
            ratio = one["ttft_p50_ratio_to_pass_1"]
            row += [str(one["pass"]), "-" if ratio is None else f"{ratio:.2f}"]
        if sees:
            row += vision_cells(one["stats"].get("vision"))
        rows.append(row)
    return markdown_table(header, rows)


def turns_markdown(stats: dict) -> str:
    """A multi-turn run: the whole run in a line (output tok/s, prompt tokens computed and
    reused, the TTFT p50 of turns 3 and later), then a row per turn."""
    turns, cache = stats["turns"], stats.get("prefix_cache")
    prefill = (
        f"prefill {cache['computed_tokens']} tokens computed, {cache['cached_tokens']} reused"
        if cache
        else "prefill computed / reused not reported by the server"
    )
    later = turns["ttft_p50_turns_from_3_s"]
    lines = [
        f"Whole run: {stats['output_tokens_per_s']:.1f} out tok/s, {prefill}; TTFT p50 of turns >= 3: "
        + ("-" if later is None else f"{later * 1000:.1f} ms"),
        "",
    ]
    header = ["turn", "requests", "TTFT p50 (ms)", "TTFT p99 (ms)", "prompt tokens", "computed", "reused"]
    rows = [
        [
            str(one["turn"]),
            str(one["requests"]),
            _ms(one["ttft_s"], "p50"),
            _ms(one["ttft_s"], "p99"),
            str(one["prompt_tokens"]),
            _count(one["computed_tokens"]),
            _count(one["reused_tokens"]),
        ]
        for one in turns["per_turn"]
    ]
    return "\n".join([*lines, markdown_table(header, rows)])


def duration_line(stats: dict, workload_kind: str) -> str:
    """What a run with a time cap left out (conversation workloads: sessions cut short too)."""
    stopped = stats["stopped_by_duration"]
    cap = f"{stats['duration_s']:g} s cap"
    if not any(stopped.values()):
        return f"Ran within the {cap}: every request started" + (
            ", no session cut short" if workload_kind in ("conversation", "agent") else ""
        )
    left_out = f"{stopped['requests_not_started']} requests not started"
    if workload_kind in ("conversation", "agent"):
        left_out += f", {stopped['sessions_cut_short']} sessions cut short"
    return f"Stopped at the {cap}: {left_out}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def serve_markdown(report: dict) -> str:
    """One run: what ran where, then a table row per pass."""
    workload = report["workload"]
    config = report["server"]["engine_config"]
    lines = [
        f"## {workload['name']}, {workload['num_requests']} requests, concurrency {workload['concurrency']}",
        "",
        f"- server: {report['base_url']}, model `{report['model']}`",
        f"- engine config: {json.dumps(config) if config else 'not reported (pass --engine-config FILE)'}",
        f"- client: {report['client']['platform']}, Python {report['client']['python']}",
        f"- ignore_eos sent: {report['ignore_eos_sent']}; seed {workload['seed']}",
        *[f"- note: {note}" for note in report["notes"]],
        "",
        _runs_table(report),
    ]
    stats = report["stats"]
    if stats.get("tokens_per_chunk") is not None:
        lines += [
            "",
            f"ITL is per token: each chunk's gap spread over its tokens; {stats['tokens_per_chunk']:.2f} "
            f"tokens per chunk on average ({stats['chunk_tokens_from']})",
        ]
    if stats.get("spec_decode"):
        lines += ["", f"Server {spec_decode_line(stats['spec_decode'])}"]
    cache = report["stats"].get("prefix_cache")
    if cache:
        lines += [
            "",
            f"Prefix cache (the server's usage): {cache['hits']} of {cache['requests']} requests hit "
            f"({100 * cache['hit_rate']:.1f}%), {cache['cached_tokens']} of {cache['prompt_tokens']} prompt "
            f"tokens served from it ({100 * cache['cached_share']:.1f}%)",
        ]
    matches = stats.get("prefix_cache_matches")
    if matches:
        counts = ", ".join(f"{kind} {count}" for kind, count in matches.items())
        lines += [
            "",
            "Prefix cache matches over the run (the server's /metrics; concurrent sessions' turns "
            f"interleave, so not per turn): {counts}",
        ]
    later = report.get("later_passes", [])
    for number, one in enumerate([stats, *(one["stats"] for one in later)], start=1):
        if one.get("duration_s") is not None:
            lines += ["", f"Pass {number}: " * bool(later) + duration_line(one, workload["kind"])]
    if stats.get("turns"):
        lines += ["", turns_markdown(stats)]
    memory = report["server"]["memory_after_run"]
    if memory:
        lines += [
            "",
            "Server memory gauges after the run (bytes): "
            + ", ".join(f"`{k}` {v:.0f}" for k, v in memory.items()),
        ]
    return "\n".join(lines) + "\n"
