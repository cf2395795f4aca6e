"""Peak host memory of reading a run's checkpoint: megatok's streamed merge against DeepSpeed's whole-model
merge (megatok's path before it streamed). Prints one JSON object. Run it in a fresh process per path:

    python tests/run/merge_memory.py RUN --path load  --dtype bf16   # megatok.run.reader.load_model(dtype=...)
    python tests/run/merge_memory.py RUN --path export --dtype bf16  # megatok.run.export.export(...)
    python tests/run/merge_memory.py RUN --path old                  # get_fp32_state_dict_from_zero_checkpoint,
                                                                     # then the fp32 model and load_state_dict

Figures (MiB): ``anon_peak`` - the process's anonymous memory (RssAnon, sampled every 2 ms) at its peak,
less what it held before reading (after the imports); ``rss_peak`` - the peak resident set
(ru_maxrss: VmHWM, which also counts the checkpoint's memory-mapped pages the merge read: page cache
the kernel takes back under pressure) less the resident set before reading (an upper bound: the peak
of the imports, if higher, counts); ``weights_fp32`` - the parameters' size
in fp32. Used by tests/run/test_export.py and docs/results/.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

MiB = 1 << 20


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Peak:
    """The largest RssAnon seen by a sampling thread while the block runs."""

    def __enter__(self):
        self.base = _status()["RssAnon"]
        self.peak, self.done = self.base, False
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done:
            self.peak = max(self.peak, _status()["RssAnon"])
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()
        self.peak = max(self.peak, _status()["RssAnon"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--path", choices=["load", "export", "old"], required=True)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args(argv)

    import contextlib

    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: F401 (imported first)

    from megatok.model import build_model
    from megatok.run.checkpoints import checkpoint_dir, latest_tag
    from megatok.run.export import export
    from megatok.run.reader import load_model, run_config

    cfg = run_config(args.run)
    # everything the paths import, imported before the baseline (the strategy's module: by a build on meta)
    import deepspeed.checkpoint.constants  # noqa: F401
    import huggingface_hub  # noqa: F401
    import safetensors.torch  # noqa: F401

    from megatok.flops import build_meta_model

    build_meta_model(cfg)
    if cfg.model.kind == "bpe":
        import transformers  # noqa: F401
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    start = _status()
    rss_before = start["RssAnon"] + start["RssFile"]
    t0 = time.time()
    with Peak() as peak, contextlib.redirect_stdout(sys.stderr):
        if args.path == "load":
            model, _, _ = load_model(args.run, dtype=dtype)
            params = sum(p.numel() for p in model.parameters())
        elif args.path == "export":
            with tempfile.TemporaryDirectory() as tmp:
                out = export(args.run, Path(tmp) / "export", dtype=args.dtype)
                params = json.loads((out / "export.json").read_text())["parameters"]
        else:
            state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir(args.run)), tag=latest_tag(args.run))
            state = {k: v.float() for k, v in state.items()}
            model = build_model(cfg)
            model.load_state_dict(state)
            model = model.to(dtype)
            params = sum(p.numel() for p in model.parameters())
    seconds = time.time() - t0
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"path": args.path, "dtype": args.dtype, "parameters": params,
                      "weights_fp32": round(params * 4 / MiB, 1), "anon_peak": round((peak.peak - peak.base) / MiB, 1),
                      "rss_peak": round((rss_peak - rss_before) / MiB, 1),
                      "seconds": round(seconds, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
