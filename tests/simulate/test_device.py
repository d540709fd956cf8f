"""The simulated device's construction from Python data: ``torch.tensor(data, device=simgpu)``
bypasses the dispatcher, so the device wraps the three data constructors while it is in use."""

import torch
from torch._subclasses.fake_tensor import FakeTensor

from titan_cotrain.simulate.device import SimulatedDevice, sim_device


def test_data_built_for_the_device_is_fake_there_and_the_constructors_come_back():
    originals = (torch.tensor, torch.as_tensor, torch.asarray)
    device = sim_device()
    with SimulatedDevice() as mode:
        with mode:  # re-entered, as the ring's ops do
            t = torch.tensor([1, 2, 3], device=device)
        u = torch.as_tensor([1.0, 2.0], device=device)
        w = torch.asarray([4, 5], device=device)
        host = torch.tensor([7, 8])
        assert all(isinstance(x, FakeTensor) and x.device == device for x in (t, u, w))
        assert t.shape == (3,) and u.dtype == torch.float32 and w.dtype == torch.int64
        assert not isinstance(host, FakeTensor) and host.tolist() == [7, 8]
    assert (torch.tensor, torch.as_tensor, torch.asarray) == originals
