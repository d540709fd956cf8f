"""The device the GPU code and ``tests/gpu`` run on is chosen explicitly: CUDA where it exists
(``titan.device_type()``, the project's one answer), whatever torch calls its accelerator.
``tests/conftest.py`` registers the scale simulator's PrivateUse1 device in every pytest
process, and from then on torch's current accelerator (``torch._C._get_accelerator()``) is that
device, ahead of CUDA: code that asked torch would put a GPU run's tensors on fake memory."""

import pathlib
import re

import torch

from titan_cotrain.components import titan
from titan_cotrain.simulate.device import SIM_DEVICE_TYPE, register_simulated_device

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_with_the_simulator_registered_torchs_accelerator_is_not_cuda():
    """The hazard the explicit choice avoids."""
    register_simulated_device()
    assert torch.accelerator.current_accelerator().type == SIM_DEVICE_TYPE


def test_the_device_is_cuda_where_cuda_exists(monkeypatch):
    register_simulated_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert titan.device_type() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert titan.device_type() == "cpu"


def test_the_gpu_tests_run_on_that_device():
    from tests.gpu.conftest import DEVICE

    assert DEVICE == torch.device("cuda" if torch.cuda.is_available() else "cpu") == torch.device(titan.device_type())


def test_nothing_asks_torch_for_its_accelerator():
    asks = re.compile(r"_get_accelerator\(|current_accelerator\(")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("titan_cotrain", "scripts", "tests")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != pathlib.Path(__file__).resolve()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if asks.search(line)
    ]
    assert not found, f"torch's current accelerator is the simulator's device under pytest: {found}"
