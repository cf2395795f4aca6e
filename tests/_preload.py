"""Imported once by the server tests/preloaded.py forks ranks from: the environment every test process
runs with, then what a rank imports (megatok's trainer, torch, DeepSpeed) and what DeepSpeed imports on
a rank's first step (torch._dynamo; its ZeRO gradient reduction imports its Muon optimizer, which imports
torch's inductor)."""

import os

os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", WANDB_MODE="disabled")

import deepspeed  # noqa: E402,F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401

import megatok.train.trainer  # noqa: E402,F401

torch.set_num_threads(1)
