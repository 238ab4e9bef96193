"""Runs a Workload against any OpenAI-compatible server over streamed HTTP and times every chunk.

Each request is a streamed POST (`stream: true`, `stream_options.include_usage: true`,
`temperature: 0`, `ignore_eos: true`). Per request the client records, on one monotonic clock
(`time.perf_counter`, seconds): when it was sent, when each chunk carrying output text arrived
and how many tokens it carried, when the stream ended, the output token count (the final usage
chunk's `completion_tokens`, else the tokens of the text chunks) and any error.

A chunk may carry several tokens: a server that speculates emits a verified run of tokens in one
step, and a busy server catches up in one chunk. Its tokens are the length of the choice's
`token_ids` (our server sends them); a server that sends none is taken to stream one token a
chunk, and the record says so (`chunk_tokens_from`).

Before the timed run, two untimed requests go out alone:
  warm-up  a short request, so first-call costs (allocator, kernel selection) stay out of the
           numbers. If the server answers 400 or 422 naming `ignore_eos`, the run goes on without the
           field and notes it (outputs may then end early at EOS).
  probe    the workload's median-length prompt with max_tokens=1 on the idle server: its time to
           first token is the unloaded prefill time that the queue-wait estimate subtracts
           (see stats.py).
A workload with images sends both with an image no timed request sends
(workloads.untimed_stand_in), so the timed run meets every one of its images uncached.

Concurrency is a closed loop: `workload.concurrency` workers take requests in index order from
one queue, each sending its next request when its previous one has finished.

The timed requests may be read by several client processes (`client_processes`; by default one
per STREAMS_PER_PROCESS streams), their workers taking requests from the same queue: one Python
process reading 64 streams at about 14k events a second was busy all of an H100 run, so it, not
the server, set the pace. Every process times on the same clock (`time.perf_counter`, the
system's monotonic clock on Linux and macOS).

A time cap (`duration_s`, `infer bench serve --duration-s`) cuts every setup off at the same point:
it counts from the start of the timed run, and after it no worker takes a new request and no
conversation starts a new turn; an agent session whose think time would end past it stops
without pausing. What is in flight then runs to its end and is counted as usual (nothing is
cancelled), so the run's end is still the last stream's. The result counts what the cap left
out (RunResult.stopped_by_duration): requests never started, and conversations cut short
(stopped for the cap before their last planned turn and before their context cap). The client
processes get the cap as an absolute deadline on the same clock.
"""

import asyncio
import dataclasses
import itertools
import json
import math
import multiprocessing
import queue
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import httpx

from infer.bench.serving.workloads import BenchRequest, Workload, untimed_stand_in

# Streams one client process reads: few enough that it keeps up with a fast server.
STREAMS_PER_PROCESS = 16
WARMUP_MAX_TOKENS = 4


@dataclass
class RequestRecord:
    """What one request did; all times are `time.perf_counter()` seconds."""

    index: int
    endpoint: str
    max_tokens: int
    send_time: float
    num_prompt_tokens: int | None = None  # the request's own count, else the server's usage
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with output text
    chunk_num_tokens: list[int] = field(default_factory=list)  # the tokens each of those chunks carried
    # "token_ids": counted from each chunk's token_ids; "assumed 1": a chunk came without them.
    chunk_tokens_from: str = "token_ids"
    end_time: float | None = None
    num_output_tokens: int = 0
    output_tokens_from: str = "chunks"  # "usage" when the final chunk reported completion_tokens
    finish_reason: str | None = None
    error: str | None = None
    # A conversation's turn (0 for a single request).
    turn: int = 0
    # The server's usage.prompt_tokens_details.cached_tokens, when it reports it.
    num_cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token_time is not None and self.end_time is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def inter_chunk_s(self) -> list[float]:
        """Gaps between consecutive text chunks: one per event, whatever number of tokens it carried."""
        return [
            later - earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:], strict=False)
        ]

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latency, one value per token after the first: a chunk of n tokens that came
        g seconds after the previous one gives n values of g / n; the tokens after the first in the
        first chunk came with it (0 s each). They sum to the last chunk's time minus the first's."""
        timed = [(at, n) for at, n in zip(self.chunk_times, self.chunk_num_tokens, strict=True) if n]
        if not timed:
            return []
        gaps = [0.0] * (timed[0][1] - 1)
        for (earlier, _), (later, num_tokens) in zip(timed, timed[1:], strict=False):
            gaps += [(later - earlier) / num_tokens] * num_tokens
        return gaps

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (end - first token) / (tokens - 1)."""
        if not self.ok or self.num_output_tokens < 2:
            return None
        return (self.end_time - self.first_token_time) / (self.num_output_tokens - 1)

    def as_dict(self) -> dict:
        return {**asdict(self), "ttft_s": self.ttft_s, "e2e_s": self.e2e_s, "tpot_s": self.tpot_s}


@dataclass
class RunResult:
    """One workload run: its records, the wall-clock window, and the untimed probe."""

    workload: Workload
    start_time: float
    end_time: float
    records: list[RequestRecord]
    ignore_eos_sent: bool
    probe: RequestRecord | None = None
    notes: list[str] = field(default_factory=list)
    client_processes: int = 1
    duration_s: float | None = None  # the time cap on the timed run (None: none)

    @property
    def wall_s(self) -> float:
        return self.end_time - self.start_time

    @property
    def stopped_by_duration(self) -> dict | None:
        """What the time cap left out (None without a cap): `requests_not_started`, the workload's
        requests (a conversation: the whole of it) of which no turn was sent, and
        `sessions_cut_short`, conversations that stopped for the cap before their last planned turn
        and before their context cap (a failed turn ends a conversation too; it is not counted)."""
        if self.duration_s is None:
            return None
        by_index: dict[int, list[RequestRecord]] = {}
        for record in sorted(self.records, key=lambda record: record.turn):
            by_index.setdefault(record.index, []).append(record)
        cut_short = sum(
            1
            for request in self.workload.requests
            if request.turns is not None
            and 0 < len(turns := by_index.get(request.index, [])) < len(request.turns)
            and all(record.ok for record in turns)
            and not passes_context_cap(request, turns)
        )
        return {
            "requests_not_started": len(self.workload.requests) - len(by_index),
            "sessions_cut_short": cut_short,
        }


def request_body(
    request: BenchRequest, model: str, *, ignore_eos: bool, max_tokens: int | None = None
) -> dict:
    body = {
        "model": model,
        "max_tokens": request.max_tokens if max_tokens is None else max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.messages is not None:
        body["messages"] = request.messages
    else:
        body["prompt"] = request.prompt_token_ids
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def stream_request(
    client: httpx.AsyncClient, request: BenchRequest, body: dict, text_parts: list[str] | None = None
) -> tuple[RequestRecord, int | None]:
    """Sends one streamed request; returns its record and the HTTP status (None if none came).
    `text_parts`, when given, gets the text of every chunk."""
    record = RequestRecord(
        index=request.index,
        endpoint=request.endpoint,
        max_tokens=body["max_tokens"],
        send_time=time.perf_counter(),
        num_prompt_tokens=request.num_prompt_tokens,
    )
    status = None
    try:
        async with client.stream("POST", request.endpoint, json=body) as response:
            status = response.status_code
            if status != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {status}: {text[:500]}"
                record.end_time = time.perf_counter()
                return record, status
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                _read_chunk(record, json.loads(payload), now, text_parts)
                if record.error is not None:
                    break
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        record.error = f"{type(error).__name__}: {error}"
    record.end_time = time.perf_counter()
    if record.output_tokens_from == "chunks":
        record.num_output_tokens = sum(record.chunk_num_tokens)
    return record, status


def _read_chunk(record: RequestRecord, chunk: dict, now: float, text_parts: list[str] | None) -> None:
    if "error" in chunk:
        record.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
        return
    usage = chunk.get("usage")
    if usage:
        if usage.get("completion_tokens") is not None:
            record.num_output_tokens = usage["completion_tokens"]
            record.output_tokens_from = "usage"
        if record.num_prompt_tokens is None and usage.get("prompt_tokens") is not None:
            record.num_prompt_tokens = usage["prompt_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            record.num_cached_tokens = cached
    for choice in chunk.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            if record.first_token_time is None:
                record.first_token_time = now
            record.chunk_times.append(now)
            token_ids = choice.get("token_ids")
            if isinstance(token_ids, list):
                record.chunk_num_tokens.append(len(token_ids))
            else:
                record.chunk_num_tokens.append(1)
                record.chunk_tokens_from = "assumed 1"
            if text_parts is not None:
                text_parts.append(text)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]


def _names_ignore_eos(record: RequestRecord) -> bool:
    return record.error is not None and "ignore_eos" in record.error


async def run_conversation(
    client: httpx.AsyncClient,
    request: BenchRequest,
    model: str,
    ignore_eos: bool,
    deadline: float = math.inf,
) -> list[RequestRecord]:
    """The turns of one conversation, each sent when the previous reply has ended, with the
    whole conversation so far (the replies as the server gave them); one record per turn. A turn
    that fails ends the conversation. An agent session (W7) pauses for each turn's think time
    first, and ends where its next turn would pass its context cap (`passes_context_cap`).
    `deadline` (`time.perf_counter()` seconds): no turn is sent after it, and a pause that would
    end past it is not taken; the conversation stops there."""
    history: list[dict] = []
    records: list[RequestRecord] = []
    for turn, (messages, max_tokens) in enumerate(zip(request.turns, request.turn_max_tokens, strict=True)):
        if turn and passes_context_cap(request, records):
            break
        think_s = request.turn_think_s[turn] if request.turn_think_s else 0.0
        if time.perf_counter() + think_s > deadline:
            break
        if think_s > 0:
            await asyncio.sleep(think_s)
            if time.perf_counter() > deadline:
                break  # the pause overran its end, past the deadline
        for message in messages:
            if message["role"] == "tool":
                # The previous reply is taken to have called the tool this message answers.
                call_id = f"call-{request.index}-{turn}"
                tool_call = {"id": call_id, "type": "function", "function": dict(message["call"])}
                history[-1] = {**history[-1], "tool_calls": [tool_call]}
                history.append({"role": "tool", "tool_call_id": call_id, "content": message["content"]})
            else:
                history.append(dict(message))
        turn_request = dataclasses.replace(request, max_tokens=max_tokens, messages=list(history), turns=None)
        reply: list[str] = []
        body = request_body(turn_request, model, ignore_eos=ignore_eos)
        record, _ = await stream_request(client, turn_request, body, text_parts=reply)
        record.turn = turn
        records.append(record)
        if not record.ok:
            break
        history.append({"role": "assistant", "content": "".join(reply)})
    return records


def passes_context_cap(request: BenchRequest, records: list[RequestRecord]) -> bool:
    """Whether the session's next turn (the one after `records`) would pass its context cap, by
    the server's counts: the last turn's `usage.prompt_tokens` and output tokens, plus the new
    turn's estimate (BenchRequest.turn_num_tokens) times `scale`, plus its max_tokens.

    `scale` is the most server tokens per estimated token that a tool turn so far showed (what
    the prompt grew by besides the reply, over the turn's estimate), before any the first turn's
    prompt over its estimate, and at least 1: 1 where each word is a token (an estimate that
    overcounts, as for JSON, is kept), about 4-5 on a byte-level vocabulary. The most, not the
    last: a byte-level vocabulary's tokens per word vary with the words. Without the server's
    counts the plan stands (workloads: the turns fit the cap by the estimate)."""
    if request.max_context_tokens is None:
        return False
    prompts = [record.num_prompt_tokens for record in records]
    if None in prompts:
        return False
    turn = len(records)
    shown = [
        (prompts[k] - prompts[k - 1] - records[k - 1].num_output_tokens) / request.turn_num_tokens[k]
        for k in range(1, turn)
    ] or [prompts[0] / request.turn_num_tokens[0]]
    estimate = math.ceil(max(1.0, *shown) * request.turn_num_tokens[turn])
    last = records[-1]
    context = last.num_prompt_tokens + last.num_output_tokens + estimate + request.turn_max_tokens[turn]
    return context > request.max_context_tokens


def default_client_processes(concurrency: int) -> int:
    return max(1, math.ceil(concurrency / STREAMS_PER_PROCESS))


def _client(base_url: str, headers: dict, concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"), headers=headers, limits=limits, timeout=httpx.Timeout(timeout_s)
    )


async def _client_loops(
    client: httpx.AsyncClient,
    requests: list[BenchRequest],
    take_index: Callable[[], int],
    concurrency: int,
    model: str,
    ignore_eos: bool,
    deadline: float = math.inf,
) -> list[RequestRecord]:
    """`concurrency` workers, each sending the request of the next index `take_index` gives when
    its previous one has finished, until the indices run past the requests or the time
    (`time.perf_counter()`) passes `deadline`; a worker takes no index after it."""
    records: list[RequestRecord] = []

    async def client_loop() -> None:
        while time.perf_counter() <= deadline and (index := take_index()) < len(requests):
            request = requests[index]
            if request.turns is not None:
                records.extend(await run_conversation(client, request, model, ignore_eos, deadline))
                continue
            record, _ = await stream_request(
                client, request, request_body(request, model, ignore_eos=ignore_eos)
            )
            records.append(record)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return records


async def run_workload(
    workload: Workload,
    *,
    base_url: str,
    model: str,
    ignore_eos: bool = True,
    timeout_s: float = 600.0,
    warmup: bool = True,
    api_key: str | None = None,
    before_timed_run: Callable[[], Awaitable[None]] | None = None,
    client_processes: int | None = None,
    duration_s: float | None = None,
) -> RunResult:
    """Runs `workload` against the server at `base_url` (e.g. http://127.0.0.1:8000).

    `before_timed_run` is awaited after the warm-up and probe, just before the timed requests
    (the runner scrapes /metrics there, so server-side counters cover the timed requests only).
    `client_processes`: how many processes read the timed streams (None: one per
    STREAMS_PER_PROCESS of the concurrency; 1: this one). `duration_s`: the time cap on the timed
    run (see the module; None: none).
    """
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0 (None: no cap), got {duration_s}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    num_processes = min(
        client_processes or default_client_processes(workload.concurrency), workload.concurrency
    )
    if num_processes < 1:
        raise ValueError(f"client_processes must be >= 1, got {client_processes}")
    notes: list[str] = []
    async with _client(base_url, headers, workload.concurrency, timeout_s) as client:
        probe = None
        if warmup:
            untimed = untimed_stand_in(workload)
            ignore_eos = await _warm_up(client, untimed, model, ignore_eos, notes)
            probe = await _prefill_probe(client, untimed, model, ignore_eos)
        if num_processes > 1:
            timed = _ProcessPool(workload, num_processes, (base_url, headers, model, ignore_eos, timeout_s))
            try:
                await asyncio.to_thread(timed.wait_ready)
                if before_timed_run is not None:
                    await before_timed_run()
                start = time.perf_counter()
                records = await asyncio.to_thread(timed.run, _deadline(start, duration_s))
            finally:
                timed.close()
            end = max([start] + [record.end_time for record in records])
        else:
            if before_timed_run is not None:
                await before_timed_run()
            start = time.perf_counter()
            records = await _client_loops(
                client,
                workload.requests,
                itertools.count().__next__,
                workload.concurrency,
                model,
                ignore_eos,
                _deadline(start, duration_s),
            )
            end = time.perf_counter()
    records.sort(key=lambda record: record.index)
    return RunResult(
        workload,
        start,
        end,
        records,
        ignore_eos_sent=ignore_eos,
        probe=probe,
        notes=notes,
        client_processes=num_processes,
        duration_s=duration_s,
    )


def _deadline(start: float, duration_s: float | None) -> float:
    return math.inf if duration_s is None else start + duration_s


class _ProcessPool:
    """Client processes for the timed requests: each builds its client and waits; `run` lets
    them go and returns every record. Their workers share one counter of the next request index."""

    def __init__(self, workload: Workload, num_processes: int, client_args: tuple):
        context = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
        self._next_index = context.Value("q", 0)
        # The time cap's deadline on the `time.perf_counter()` clock, the same in every process.
        self._deadline = context.Value("d", math.inf)
        self._ready = context.Barrier(num_processes + 1)
        self._go = context.Event()
        self._results = context.Queue()
        base, extra = divmod(workload.concurrency, num_processes)
        self._processes = [
            context.Process(
                target=_client_process,
                args=(
                    workload.requests,
                    base + (i < extra),
                    self._next_index,
                    self._deadline,
                    self._ready,
                    self._go,
                    self._results,
                    *client_args,
                ),
                daemon=True,
            )
            for i in range(num_processes)
        ]
        for process in self._processes:
            process.start()

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        self._ready.wait(timeout_s)

    def run(self, deadline: float = math.inf) -> list[RequestRecord]:
        """Lets the processes go, their workers taking no request after `deadline`."""
        self._deadline.value = deadline
        self._go.set()
        records: list[RequestRecord] = []
        for _ in self._processes:
            while True:
                try:
                    outcome = self._results.get(timeout=1.0)
                    break
                except queue.Empty:
                    if any(process.exitcode not in (None, 0) for process in self._processes):
                        raise RuntimeError("a bench client process died") from None
            if isinstance(outcome, str):
                raise RuntimeError(f"a bench client process failed: {outcome}")
            records.extend(outcome)
        return records

    def close(self) -> None:
        self._ready.abort()  # frees the children if the parent gave up before `go`
        self._go.set()
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def _client_process(
    requests,
    concurrency,
    next_index,
    deadline,
    ready,
    go,
    results,
    base_url,
    headers,
    model,
    ignore_eos,
    timeout_s,
):
    """One client process: its share of the workers, on requests from the shared counter."""

    def take_index() -> int:
        with next_index.get_lock():
            index = next_index.value
            next_index.value += 1
        return index

    async def main() -> list[RequestRecord]:
        async with _client(base_url, headers, concurrency, timeout_s) as client:
            ready.wait()
            go.wait()
            return await _client_loops(
                client, requests, take_index, concurrency, model, ignore_eos, deadline.value
            )

    try:
        results.put(asyncio.run(main()))
    except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it
        results.put(f"{type(error).__name__}: {error}")


async def _warm_up(
    client: httpx.AsyncClient, workload: Workload, model: str, ignore_eos: bool, notes: list
) -> bool:
    """Sends one short request; returns whether `ignore_eos` is accepted (False if it was never sent)."""
    request = _first_turn(workload.requests[0])
    body = request_body(request, model, ignore_eos=ignore_eos, max_tokens=WARMUP_MAX_TOKENS)
    record, status = await stream_request(client, request, body)
    if ignore_eos and status in (400, 422) and _names_ignore_eos(record):
        notes.append(f"the server rejected ignore_eos ({status}), so it was not sent: {record.error[:200]}")
        ignore_eos = False
        body = request_body(request, model, ignore_eos=False, max_tokens=WARMUP_MAX_TOKENS)
        record, status = await stream_request(client, request, body)
    if record.error is not None:
        raise RuntimeError(
            f"warm-up request to {client.base_url}{request.endpoint} failed: {record.error}; "
            "check --base-url and --model (GET /v1/models lists the served names)"
        )
    return ignore_eos


async def _prefill_probe(
    client: httpx.AsyncClient, workload: Workload, model: str, ignore_eos: bool
) -> RequestRecord:
    # The median-length prompt (chat prompts: the first; they share the long system prompt).
    by_length = sorted(workload.requests, key=lambda request: request.num_prompt_tokens or 0)
    request = _first_turn(by_length[(len(by_length) - 1) // 2])
    record, _ = await stream_request(
        client, request, request_body(request, model, ignore_eos=ignore_eos, max_tokens=1)
    )
    return record


def _first_turn(request: BenchRequest) -> BenchRequest:
    """A conversation's first turn as a request of its own (other requests as they are)."""
    if request.turns is None:
        return request
    return dataclasses.replace(request, messages=[dict(message) for message in request.turns[0]], turns=None)
