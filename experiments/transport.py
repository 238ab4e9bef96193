"""Which transport should carry the engine core's messages to and from its child process?

`python experiments/transport.py [--requests 64] [--steps 2000] [--repeats 5] [--no-pin]`

For each transport and encoding below, a real spawned child plays the engine core and the parent
plays the frontend. The child sends one `EngineOutputs` per step (`--requests` outputs of one new
token each, one of them finished, stats filled); the parent sends `("add", EngineRequest)`
messages (a 512-token prompt, default SamplingParams) the other way. Measured, per round, as the
median per message (robust to other load on the machine; it leaves rare GC pauses out), and
printed as the median over `--repeats` rounds:

  (1) core send: the child's time in encode + send of one step (the engine loop pays it).
  (2) frontend recv: the parent's time in receive + decode of one step, taken once the message
      is already readable, so it holds no waiting (the frontend's thread pays it).
  (3) RTT: the parent sends a ping and blocks until it has decoded the step the child answers
      with: the latency a waiting frontend sees, wake-ups included.
  bg CPU: CPU time per step of threads other than the main one, in both processes (zmq's I/O
      threads; zero for pipes): the cost that (1) and (2) do not show for zmq.
  add: the parent sends 64 adds back to back: its encode + send per add (with a pipe, this
      includes blocking once the 64 KiB pipe buffer is full), the child's receive + decode per
      add, and the whole burst until the child has decoded the last one.

In (1) and (2) the child sends step N only after the parent acknowledged step N-1, so neither
side's time includes the other's backlog. The two processes are pinned to a CPU each (zmq's I/O
thread shares its process's): unpinned on few CPUs, a send that wakes the reader on the same CPU
is preempted by it, and the sender's timed span then holds the reader's decode. Decoded objects
are freed outside the timed spans. Every encoding decodes to objects the frontend can use as it
uses the protocol's (attributes by name); "msgspec Struct" would need `infer.engine.protocol`
to become msgspec Structs.
"""

import argparse
import multiprocessing
import os
import pickle
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import MISSING, fields
from multiprocessing.reduction import ForkingPickler
from typing import NamedTuple

from infer.engine.protocol import EngineOutput, EngineOutputs, EngineRequest, EngineStats, FinishReason
from infer.engine.sampling_params import SamplingParams

PROMPT_TOKENS = 512
VOCAB_SIZE = 151_936
# Each round sends this many bursts of `--adds` adds.
ADD_BURSTS = 10
# (transport, encoding) pairs, in table order.
COMBINATIONS = [
    ("pipe", "pickle"),
    ("pipe", "msgspec Struct"),
    ("zmq", "pickle"),
    ("zmq", "msgspec dataclass"),
    ("zmq", "msgspec Struct"),
]


# -- encodings ------------------------------------------------------------------------------------


class Codec:
    """`("outputs", EngineOutputs)` and `("add", EngineRequest)` to bytes and back; the
    `EngineOutputs`, `EngineOutput`, `EngineStats` and `EngineRequest` types it carries are the
    ones its messages are built from."""

    types = (EngineOutputs, EngineOutput, EngineStats, EngineRequest)

    def encode_outputs(self, outputs) -> bytes: ...
    def decode_outputs(self, data: bytes): ...
    def encode_add(self, request) -> bytes: ...
    def decode_add(self, data: bytes) -> tuple: ...


class PickleCodec(Codec):
    """The protocol's objects pickled as `Connection.send` / `recv` do (the engine process's
    transport; EngineOutputs crosses as plain rows through its `__reduce__`)."""

    def encode_outputs(self, outputs):
        return ForkingPickler.dumps(("outputs", outputs))

    def decode_outputs(self, data):
        return pickle.loads(data)[1]

    def encode_add(self, request):
        return ForkingPickler.dumps(("add", request))

    def decode_add(self, data):
        return pickle.loads(data)


def _msgspec_dataclass_codec() -> Codec:
    """msgpack of the protocol's dataclasses as they are (maps keyed by field name), decoded by
    msgspec straight into them: no change to `infer.engine.protocol`."""
    import msgspec

    class MsgspecDataclassCodec(Codec):
        encode = msgspec.msgpack.Encoder().encode
        outputs_decoder = msgspec.msgpack.Decoder(tuple[str, EngineOutputs])
        add_decoder = msgspec.msgpack.Decoder(tuple[str, EngineRequest])

        def encode_outputs(self, outputs):
            return self.encode(("outputs", outputs))

        def decode_outputs(self, data):
            return self.outputs_decoder.decode(data)[1]

        def encode_add(self, request):
            return self.encode(("add", request))

        def decode_add(self, data):
            return self.add_decoder.decode(data)

    return MsgspecDataclassCodec()


def _msgspec_struct_codec() -> Codec:
    """msgpack of msgspec Struct mirrors of the dataclasses (same fields, frozen, array_like:
    encoded as arrays, no field names; gc=False; tagged, so kinds of message can share a
    decoder), as if `infer.engine.protocol` defined Structs. SamplingParams stays a dataclass."""
    import msgspec

    def mirror(cls, tag, **field_types):
        spec = []
        for f in fields(cls):
            kind = field_types.get(f.name, f.type)
            if f.default is not MISSING:
                spec.append((f.name, kind, f.default))
            elif f.default_factory is not MISSING:
                spec.append((f.name, kind, msgspec.field(default_factory=f.default_factory)))
            else:
                spec.append((f.name, kind))
        return msgspec.defstruct(cls.__name__, spec, tag=tag, array_like=True, frozen=True, gc=False)

    output = mirror(EngineOutput, None)
    stats = mirror(EngineStats, None)
    outputs = mirror(EngineOutputs, "outputs", outputs=list[output], stats=stats | None)
    request = mirror(EngineRequest, "add")
    abort = msgspec.defstruct("Abort", [("request_ids", list[str])], tag="abort", array_like=True)

    class MsgspecStructCodec(Codec):
        types = (outputs, output, stats, request)
        encode = msgspec.msgpack.Encoder().encode
        outputs_decoder = msgspec.msgpack.Decoder(outputs)
        to_core_decoder = msgspec.msgpack.Decoder(request | abort)

        def encode_outputs(self, outputs):
            return self.encode(outputs)

        def decode_outputs(self, data):
            return self.outputs_decoder.decode(data)

        def encode_add(self, request):
            return self.encode(request)

        def decode_add(self, data):
            return "add", self.to_core_decoder.decode(data)

    return MsgspecStructCodec()


CODECS: dict[str, Callable[[], Codec]] = {
    "pickle": PickleCodec,
    "msgspec dataclass": _msgspec_dataclass_codec,
    "msgspec Struct": _msgspec_struct_codec,
}


# -- transports -----------------------------------------------------------------------------------


class Link(NamedTuple):
    """One side's ends: `send(bytes)` to the other side, `recv()` from it (blocking), and
    `wait()` until a message from it is readable."""

    send: Callable
    recv: Callable
    wait: Callable
    close: Callable


def _pipe_link(reader, writer) -> Link:
    def close():
        reader.close()
        writer.close()

    return Link(writer.send_bytes, reader.recv_bytes, lambda: reader.poll(None), close)


def _zmq_link(receive_address: str, send_address: str, bind: bool) -> Link:
    import zmq

    context = zmq.Context()
    receiver, sender = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    for sock, address in ((receiver, receive_address), (sender, send_address)):
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    return Link(sender.send, receiver.recv, receiver.poll, lambda: context.destroy(linger=0))


def open_frontend(transport: str, context) -> tuple[Link, tuple, Callable]:
    """The parent's link, what the child needs to open its own (`open_core`), and a cleanup."""
    if transport == "pipe":
        frontend_inbox, core_outbox = context.Pipe(duplex=False)
        core_inbox, frontend_outbox = context.Pipe(duplex=False)
        return _pipe_link(frontend_inbox, frontend_outbox), (core_inbox, core_outbox), lambda: None
    folder = tempfile.mkdtemp(prefix="infer-transport-")
    to_core, from_core = f"ipc://{folder}/to-core", f"ipc://{folder}/from-core"
    return _zmq_link(from_core, to_core, bind=True), (to_core, from_core), lambda: shutil.rmtree(folder)


def open_core(transport: str, child_args: tuple) -> Link:
    return _pipe_link(*child_args) if transport == "pipe" else _zmq_link(*child_args, bind=False)


# -- the two sides --------------------------------------------------------------------------------


def build_step(codec: Codec, request_ids: list[str], step: int, rng: random.Random):
    outputs_type, output_type, stats_type, _ = codec.types
    finished = step % len(request_ids)
    outputs = [
        output_type(
            request_id=request_id,
            new_token_ids=[rng.randrange(VOCAB_SIZE)],
            finish_reason=FinishReason.STOP if index == finished else None,
            num_prompt_tokens=PROMPT_TOKENS,
            num_cached_tokens=256,
        )
        for index, request_id in enumerate(request_ids)
    ]
    n = len(request_ids)
    stats = stats_type(
        num_running=n,
        num_waiting=3,
        kv_usage_ratio=0.4375,
        kv_bytes_used=7 << 30,
        kv_bytes_total=16 << 30,
        num_steps=step,
        num_added=n + step // n,
        num_prompt_tokens_total=PROMPT_TOKENS * (n + step // n),
        num_generation_tokens_total=n * step,
        num_finished=step // n,
        num_aborted=1,
        num_failed=0,
        num_preempted=2,
        busy_time_s=step * 0.0125,
        prompt_tokens_per_s=41234.5,
        generation_tokens_per_s=5120.25,
    )
    return outputs_type(outputs=outputs, stats=stats)


def build_request(codec: Codec, rng: random.Random):
    request_type = codec.types[3]
    prompt = [rng.randrange(VOCAB_SIZE) for _ in range(PROMPT_TOKENS)]
    return request_type(f"cmpl-{uuid.uuid4().hex}-0", prompt, SamplingParams(), time.monotonic())


def _bg_cpu_s() -> float:
    """CPU time of this process's threads other than the calling one."""
    return time.process_time() - time.thread_time()


def run_core(transport: str, child_args: tuple, codec_name: str, args: argparse.Namespace) -> None:
    """The child: the engine core's side of every round."""
    if args.core_cpu is not None:
        os.sched_setaffinity(0, {args.core_cpu})  # before zmq starts its I/O thread
    codec = CODECS[codec_name]()
    link = open_core(transport, child_args)
    rng = random.Random(1)
    request_ids = [f"cmpl-{uuid.uuid4().hex}-0" for _ in range(args.requests)]
    warmup = min(200, args.steps // 10)
    link.send(b"ready")
    for _ in range(args.repeats):
        send_ns, bg_cpu_start = [], _bg_cpu_s()
        for step in range(warmup + args.steps):
            message = build_step(codec, request_ids, step, rng)
            if step:
                link.recv()  # the frontend's ack of the previous step
            start = time.perf_counter_ns()
            data = codec.encode_outputs(message)
            link.send(data)
            send_ns.append(time.perf_counter_ns() - start)
        link.recv()
        bg_cpu_s = _bg_cpu_s() - bg_cpu_start

        for step in range(warmup + args.steps):
            message = build_step(codec, request_ids, step, rng)
            link.recv()  # ping
            link.send(codec.encode_outputs(message))

        add_recv_ns = []
        for _ in range(ADD_BURSTS):
            for _ in range(args.adds):
                link.wait()
                start = time.perf_counter_ns()
                _kind, _request = codec.decode_add(link.recv())
                add_recv_ns.append(time.perf_counter_ns() - start)
                del _request
            link.send(b"added")
        report = {
            "send_ns": send_ns[warmup:],
            "bg_cpu_s": bg_cpu_s,
            "add_recv_ns": add_recv_ns,
            "bytes": len(data),
        }
        link.send(pickle.dumps(report))
    link.recv()  # the frontend's goodbye, so nothing is closed under a message in flight
    link.close()


def _median_us(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1000


def measure(transport: str, codec_name: str, args: argparse.Namespace) -> dict[str, float]:
    """Runs one child through `--repeats` rounds; each metric's median over the rounds."""
    codec = CODECS[codec_name]()  # raises ImportError before any process starts
    context = multiprocessing.get_context("spawn")
    link, child_args, cleanup = open_frontend(transport, context)
    core = context.Process(target=run_core, args=(transport, child_args, codec_name, args), daemon=True)
    core.start()
    if transport == "pipe":
        for end in child_args:
            end.close()
    rng = random.Random(2)
    requests = [build_request(codec, rng) for _ in range(args.adds)]
    warmup = min(200, args.steps // 10)
    rounds = []
    try:
        link.recv()  # ready
        for _ in range(args.repeats):
            recv_ns, bg_cpu_start = [], _bg_cpu_s()
            for _ in range(warmup + args.steps):
                link.wait()
                start = time.perf_counter_ns()
                outputs = codec.decode_outputs(link.recv())
                recv_ns.append(time.perf_counter_ns() - start)
                link.send(b"ack")
                del outputs
            frontend_bg_cpu_s = _bg_cpu_s() - bg_cpu_start

            rtt_ns = []
            for _ in range(warmup + args.steps):
                start = time.perf_counter_ns()
                link.send(b"ping")
                outputs = codec.decode_outputs(link.recv())
                rtt_ns.append(time.perf_counter_ns() - start)
                del outputs

            add_send_ns, burst_ns = [], []
            for _ in range(ADD_BURSTS):
                burst_start = time.perf_counter_ns()
                for request in requests:
                    start = time.perf_counter_ns()
                    link.send(codec.encode_add(request))
                    add_send_ns.append(time.perf_counter_ns() - start)
                link.recv()  # "added": the core decoded the last one
                burst_ns.append(time.perf_counter_ns() - burst_start)

            core_report = pickle.loads(link.recv())
            rounds.append(
                {
                    "bytes": core_report["bytes"],
                    "send": _median_us(core_report["send_ns"]),
                    "recv": _median_us(recv_ns[warmup:]),
                    "rtt": _median_us(rtt_ns[warmup:]),
                    "bg_cpu": (core_report["bg_cpu_s"] + frontend_bg_cpu_s) / (warmup + args.steps) * 1e6,
                    "add_send": _median_us(add_send_ns),
                    "add_recv": _median_us(core_report["add_recv_ns"]),
                    "burst": _median_us(burst_ns),
                    "add_bytes": len(codec.encode_add(requests[0])),
                }
            )
        link.send(b"bye")
        core.join(30)
    finally:
        if core.is_alive():
            core.kill()
        link.close()
        cleanup()
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


# -- the table ------------------------------------------------------------------------------------


def _versions() -> str:
    found = [f"Python {platform.python_version()} ({platform.python_implementation()})"]
    try:
        import zmq

        found.append(f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()})")
    except ImportError:
        found.append("pyzmq not installed")
    try:
        import msgspec

        found.append(f"msgspec {msgspec.__version__}")
    except ImportError:
        found.append("msgspec not installed")
    cpus = f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable)"
    return ", ".join([*found, cpus, platform.platform()])


COLUMNS = [  # (key, heading, format)
    ("bytes", "B/step", "{:>7.0f}"),
    ("send", "(1) send", "{:>9.1f}"),
    ("recv", "(2) recv", "{:>9.1f}"),
    ("rtt", "(3) RTT", "{:>8.1f}"),
    ("bg_cpu", "bg CPU", "{:>7.1f}"),
    ("add_bytes", "B/add", "{:>6.0f}"),
    ("add_send", "add send", "{:>9.1f}"),
    ("add_recv", "add recv", "{:>9.1f}"),
    ("burst", "adds burst", "{:>11.0f}"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="EngineOutput entries per step message")
    parser.add_argument("--steps", type=int, default=2000, help="step messages per round and phase")
    parser.add_argument("--adds", type=int, default=64, help="add messages per burst")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per transport; the median is shown")
    parser.add_argument(
        "--no-pin", action="store_true", help="let the OS place both processes (default: one CPU each)"
    )
    args = parser.parse_args(argv)
    print(_versions())
    cpus = sorted(os.sched_getaffinity(0))
    args.core_cpu = None
    if len(cpus) >= 2 and not args.no_pin:
        # On few CPUs an unpinned pair shares one now and then, and one side's timed span then
        # holds the other side's work (a write wakes the reader, which preempts the writer).
        args.core_cpu = cpus[1]
        os.sched_setaffinity(0, {cpus[0]})
    pinning = "unpinned" if args.core_cpu is None else f"frontend on CPU {cpus[0]}, core on CPU {cpus[1]}"
    print(f"load average {os.getloadavg()[0]:.2f}, {pinning}")
    print(
        f"{args.requests} outputs/step, {args.steps} steps x {args.repeats} rounds (medians of medians), "
        f"adds of {PROMPT_TOKENS} prompt tokens in bursts of {args.adds}; times in µs"
    )
    head = f"{'transport':<10}{'encoding':<19}" + "".join(
        f"{heading:>{len(fmt.format(0))}}" for _, heading, fmt in COLUMNS
    )
    print(head)
    print("-" * len(head))
    for transport, codec_name in COMBINATIONS:
        row = f"{transport:<10}{codec_name:<19}"
        try:
            result = measure(transport, codec_name, args)
        except ImportError as error:
            print(f"{row}skipped: {error.name} is not installed")
            continue
        print(row + "".join(fmt.format(result[key]) for key, _, fmt in COLUMNS), flush=True)
    print(
        "(1) core encode+send per step, (2) frontend recv+decode per step, (3) ping -> decoded step, "
        "bg CPU: other threads' CPU per step (both sides, the acks' included), add send/recv: per add, "
        "adds burst: all of them"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
