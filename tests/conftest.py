"""Suite-wide setup: the scale simulator's stand-in accelerator is registered before any test
runs, because torch's autograd engine sizes its device queues at the first backward of a
process and a device registered later has none."""

import pytest

from titan_cotrain.simulate.device import register_simulated_device

register_simulated_device()


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a whole test module (``tests.multiprocess.one_thread``)."""
    from tests.multiprocess import one_thread

    with one_thread():
        yield
