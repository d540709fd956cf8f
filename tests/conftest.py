"""Suite-wide setup: the scale simulator's stand-in accelerator is registered before any test
runs, because torch's autograd engine sizes its device queues at the first backward of a
process and a device registered later has none."""

from titan_cotrain.simulate.device import register_simulated_device

register_simulated_device()
