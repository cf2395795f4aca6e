"""launch/pretrain.py with the faults of the MEGATOK_FAULT_* variables (tests/train/faults.py) installed
in its Trainer; arguments as launch/pretrain.py's, under any launcher.

    python tests/train/faulty_pretrain.py --config configs/tiny.json ...
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megatok.train import trainer  # noqa: E402
from tests.train import faults  # noqa: E402


def train_with_faults(cfg, *, resume="auto", lock_wait_s=0.0):
    return trainer.Trainer(cfg, resume=resume, callbacks=faults.from_env(), lock_wait_s=lock_wait_s).fit()


if __name__ == "__main__":
    trainer.train = train_with_faults  # launch/pretrain.py's run() imports train when it runs
    sys.argv[0] = str(ROOT / "launch/pretrain.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
