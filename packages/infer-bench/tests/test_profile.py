"""The launch-overhead arithmetic of `infer profile`, on event records shaped like torch.profiler's.

Oracle: brute force over integer microseconds (a microsecond is busy when some kernel covers it).
"""

from types import SimpleNamespace

from torch.autograd import DeviceType

from infer.bench.profile import DECODE_STEP, launch_overhead_summary


def event(name: str, device_type: DeviceType, start: int, end: int):
    return SimpleNamespace(
        name=name, device_type=device_type, time_range=SimpleNamespace(start=start, end=end)
    )


def test_overhead_is_step_time_not_covered_by_kernels():
    steps = [(0, 100), (200, 250)]
    kernels = [(10, 30), (20, 40), (90, 120), (210, 260)]
    events = [event(DECODE_STEP, DeviceType.CPU, s, e) for s, e in steps]
    events += [event("gemv_kernel", DeviceType.CUDA, s, e) for s, e in kernels]
    # The GPU-side copy of our own annotation spans the whole step; it is not kernel work.
    events.append(event(DECODE_STEP, DeviceType.CUDA, 0, 100))
    wall = sum(e - s for s, e in steps)
    busy = sum(1 for s, e in steps for t in range(s, e) if any(ks <= t < ke for ks, ke in kernels))
    summary = launch_overhead_summary(events)
    assert f"CPU launch overhead (wall - GPU busy) {1 - busy / wall:.1%}" in summary
    assert f"mean GPU busy {busy / len(steps):.1f} us" in summary
