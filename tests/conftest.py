"""Suite-wide setup: the scale simulator's stand-in accelerator is registered before any test
runs, because torch's autograd engine sizes its device queues at the first backward of a
process and a device registered later has none.

Once registered it is torch's current accelerator (``torch.accelerator.current_accelerator``),
ahead of CUDA on a GPU machine: no code asks torch for it. The project's device is
``titan.device_type()`` (CUDA where it exists), and ``tests/gpu`` uses that
(``tests/ops/test_device.py``)."""

import pytest

from titan_cotrain.simulate.device import register_simulated_device

register_simulated_device()


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a whole test module (``tests.multiprocess.one_thread``)."""
    from tests.multiprocess import one_thread

    with one_thread():
        yield
