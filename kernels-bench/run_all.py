"""Run every kernel benchmark and write one markdown table (no pytest needed).

    python kernels-bench/run_all.py --out kernels.md [--only rms_norm,rope]

Needs a CUDA GPU and infer-kernels importable (installed, or PYTHONPATH=packages/infer-kernels/src).
"""

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_activation  # noqa: E402
import bench_add_rms_norm  # noqa: E402
import bench_int4_linear  # noqa: E402
import bench_paged_attention  # noqa: E402
import bench_qk_norm_rope  # noqa: E402
import bench_quantized_linear  # noqa: E402
import bench_rms_norm  # noqa: E402
import bench_rms_norm_add_rms_norm  # noqa: E402
import bench_rope  # noqa: E402
import bench_store_kv  # noqa: E402
import bench_token_bitmask  # noqa: E402
import harness  # noqa: E402
import torch  # noqa: E402

BENCH_MODULES = [
    bench_rms_norm,
    bench_add_rms_norm,
    bench_rms_norm_add_rms_norm,
    bench_rope,
    bench_qk_norm_rope,
    bench_activation,
    bench_store_kv,
    bench_token_bitmask,
    bench_paged_attention,
    bench_quantized_linear,
    bench_int4_linear,
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="markdown file to write")
    parser.add_argument("--only", default="", help="comma-separated op names (default: all)")
    parser.add_argument("--phase", choices=["decode", "prefill"], help="only this phase")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel benchmarks need a CUDA GPU")
    only = {name for name in args.only.split(",") if name}
    cases = [c for m in BENCH_MODULES for c in m.cases() if not only or c.op in only]
    cases = [c for c in cases if args.phase in (None, c.phase)]
    print(harness.environment_header(), flush=True)
    started = time.perf_counter()
    for case in cases:
        try:
            harness.run_case(case)
        except Exception as error:  # one broken case must not hide the others' numbers
            traceback.print_exc()
            case.result["error"] = f"{type(error).__name__}: {error}"[:120]
        torch.cuda.empty_cache()
        print(f"{case.id}: {case.result}", flush=True)
        # Rewritten after every case, so a run cut short still leaves every figure it measured.
        table = harness.markdown_table([c for c in cases if c.result])
        args.out.write_text(f"{harness.environment_header()}\n\n{table}\n")
    print(args.out.read_text())
    print(f"(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
