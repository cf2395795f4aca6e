"""The device check of megatok.load and the commands' --device: a device this torch can use comes back as a
torch.device, any other is one line saying why, before anything is read."""

from __future__ import annotations

import pytest
import torch

import megatok
from megatok.devices import checked_device, unusable


def test_cpu_and_torch_devices_pass_through():
    assert checked_device("cpu") == torch.device("cpu") == checked_device(torch.device("cpu"))
    assert checked_device("cpu:0") == torch.device("cpu", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:3", "tpu", "gpu", "meta"])
def test_load_names_device_and_why_before_reading_the_path(device, tmp_path):
    """megatok.load on a device this torch cannot use: a ValueError naming ``device``, raised before the path
    is read (the path here does not exist: otherwise it would be a FileNotFoundError)."""
    with pytest.raises(ValueError) as e:
        megatok.load(tmp_path / "nowhere", device=device)
    why = ("not a device megatok runs models on (cpu, cuda or cuda:N)" if not device.startswith("cuda") else
           f"this torch has no CUDA (torch {torch.__version__}); use device='cpu'")
    assert str(e.value) == f"device={device!r}: {why}"


def test_the_reasons_on_a_machine_with_cuda(monkeypatch):
    """The GPU-machine branches, with torch's CUDA build and device count set as they would be there."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert unusable(torch.device("cuda"), "X") is None and unusable(torch.device("cuda:1"), "X") is None
    assert unusable(torch.device("cuda:2"), "X") == "this machine has 2 CUDA devices (cuda:0 to cuda:1)"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert unusable(torch.device("cuda:1"), "X") == "this machine has 1 CUDA device (cuda:0)"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert unusable(torch.device("cuda"), "--device cpu") == (
        "no CUDA device is visible (CUDA_VISIBLE_DEVICES=''); use --device cpu")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert unusable(torch.device("cuda"), "--device cpu") == "no CUDA device is visible; use --device cpu"


def test_deterministic_kernels_switch_torch_to_them_and_fix_the_cublas_workspace(monkeypatch):
    """train.deterministic's switch (the trainer calls it before any kernel runs; megatok-gpu-check's trainer
    section runs with it and fails on a resume that is not bit-exact)."""
    import torch

    from megatok.config import load_config
    from megatok.devices import deterministic_kernels

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # restored (removed) after the test, whatever it sets
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    assert load_config("configs/tiny.json", ["train.deterministic=true"], world_size=1).train.deterministic
    before = torch.are_deterministic_algorithms_enabled()
    try:
        deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled()
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before)
