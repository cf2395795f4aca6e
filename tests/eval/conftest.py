"""lm-evaluation-harness reads local data files only in these tests: no hub, no network."""

from __future__ import annotations

import os
import tempfile

# read by datasets and huggingface_hub when they are imported (by lm_eval, in these tests only)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="megatok-test-datasets-"))
