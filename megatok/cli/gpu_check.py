"""megatok-gpu-check: the command line of megatok.perf.gpu_check (its docstring is the help)."""

from __future__ import annotations

import argparse
import sys

from megatok.perf import gpu_check
from megatok.cli import command_parser


def build_parser() -> argparse.ArgumentParser:
    """The command line (tools/gpu_bench.sh's commands are checked against it)."""
    d = gpu_check.Settings()
    ap = command_parser(description=gpu_check.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=d.configs,
                    help=f"the training section's configs (default: {' '.join(gpu_check.GPU_CONFIGS)}; not with "
                         f"--cpu-smoke, which runs configs/tiny.json)")
    ap.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="applied to every config")
    ap.add_argument("--steps", type=int, default=d.steps, help="timed steps per config")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first")
    ap.add_argument("--micro", type=int, default=None, help="micro-batch (default: the config's)")
    ap.add_argument("--engine", choices=["auto", "deepspeed", "torch"], default=d.engine)
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the device (default: by name)")
    ap.add_argument("--attn-iters", type=int, default=d.attn_iters)
    ap.add_argument("--json-out", default=None, help="also write the report as JSON here")
    ap.add_argument("--trainer-config", default=d.trainer_config,
                    help=f"the config of the trainer section (default: {gpu_check.TRAINER_CONFIG}; 'none' skips it; not "
                         f"with --cpu-smoke, which runs configs/tiny.json)")
    ap.add_argument("--trainer-steps", type=int, default=d.trainer_steps, help="steps of the trainer check (even)")
    ap.add_argument("--gen-bytes", type=int, default=d.gen_bytes,
                    help="bytes each row generates in the generation section (--cpu-smoke: at most 16)")
    ap.add_argument("--no-document-mask", dest="document_mask", action="store_false",
                    help="skip the first config's second run with model.document_mask")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="the first config once more with train.compile the other way: its gain, or its cost "
                         "(default: on a GPU, not in --cpu-smoke)")
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                    help="the first config once more with train.deterministic: what deterministic kernels cost "
                         "(default: on a GPU, not in --cpu-smoke)")
    ap.add_argument("--sections", nargs="+", choices=gpu_check.SECTIONS, default=d.sections,
                    help="what to run, in this order (default: %(default)s: the trainer first, the figure that "
                         "matters most when GPU time is short)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny config on the CPU, 2 steps: tests the code paths")
    ap.add_argument("--budget-s", type=float, default=d.budget_s,
                    help="wall-clock budget: work that would start past it is skipped and reported as such, and the "
                         "trainer check's processes get what is left (the report and --json-out are written after "
                         "every section and on SIGTERM, so a run cut short keeps what it measured)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    try:
        settings = gpu_check.Settings(**vars(ap.parse_args(argv)))
    except ValueError as e:
        ap.error(str(e))
    return gpu_check.run(settings)


if __name__ == "__main__":
    sys.exit(main())
