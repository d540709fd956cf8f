"""``TrainingStateOffload``: the training state leaves the device's storages while away and
comes back bitwise, views and ties included; training after a round trip is the training
without one."""

import copy

import pytest
import torch
from torch import nn

from titan_cotrain.rl.offload import TrainingStateOffload


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # one storage, two names

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, offload: TrainingStateOffload | None,
           seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        if offload is not None:
            offload.away()
            offload.back()
        ids = torch.randint(0, 11, (4, 5), generator=g)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        opt.zero_grad(set_to_none=False)  # gradients that stay allocated: they travel too
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_the_state_leaves_the_storages_and_comes_back_bitwise():
    torch.manual_seed(0)
    model, reference = _Tied(), _Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, None)
    before = ({k: v.clone() for k, v in model.state_dict().items()},
              [p.grad.clone() for p in model.parameters()],
              copy.deepcopy(opt.state_dict()), {k: v.clone() for k, v in reference.state_dict().items()})
    view = model.mid.weight[1:3]  # a view taken before the trip sees the restored bytes
    offload = TrainingStateOffload([model, reference], [opt], torch.device("cpu"))
    offload.away()
    assert offload.is_away
    away = [t for t in (*model.parameters(), *reference.parameters()) if t.untyped_storage().nbytes()]
    away += [v for s in opt.state.values() for v in s.values() if v.untyped_storage().nbytes()]
    assert away == []  # every parameter, gradient and optimizer-state storage is freed
    params = {id(p): p for m in (model, reference) for p in m.parameters()}  # the tie counts once
    state = [v for s in opt.state.values() for v in s.values()]  # moments and (on this device) step counts
    expected = 2 * sum(p.numel() * 4 for p in model.parameters()) + sum(v.numel() * 4 for v in state)
    expected += sum(p.numel() * 4 for p in reference.parameters())
    assert offload.host_bytes == expected and len(params) == 6
    offload.back()
    assert not offload.is_away
    after = (model.state_dict(), [p.grad for p in model.parameters()], opt.state_dict(), reference.state_dict())
    for name, value in before[0].items():
        assert torch.equal(after[0][name], value), name
    assert all(torch.equal(a, b) for a, b in zip(after[1], before[1], strict=True))
    for i, state in before[2]["state"].items():
        for key, value in state.items():
            assert torch.equal(after[2]["state"][i][key], value), (i, key)
    assert all(torch.equal(after[3][k], v) for k, v in before[3].items())
    assert torch.equal(view, before[0]["mid.weight"][1:3])
    assert model.head.weight is model.embed.weight


def test_training_after_round_trips_is_training_without_them():
    torch.manual_seed(1)
    plain = _Tied()
    moved = copy.deepcopy(plain)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_moved = torch.optim.AdamW(moved.parameters(), lr=1e-2)
    offload = TrainingStateOffload([moved], [opt_moved], torch.device("cpu"))
    assert _train(moved, opt_moved, 4, offload) == _train(plain, opt_plain, 4, None)
    for (name, a), b in zip(plain.state_dict().items(), moved.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_second_away_is_refused_and_host_buffers_follow_the_storages():
    model = _Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    offload = TrainingStateOffload([model], [opt], torch.device("cpu"))
    offload.away()
    with pytest.raises(RuntimeError, match="already off the device"):
        offload.away()
    offload.back()
    # A storage replaced since (a checkpoint load that assigns new tensors) drops its old buffer.
    model.mid.weight = nn.Parameter(model.mid.weight.detach().clone())
    offload.away()
    offload.back()
    keys = {p.untyped_storage()._cdata for p in model.parameters()}
    assert set(offload._host) == keys


def test_in_two_stages_the_parameters_stay_for_the_refresh_then_follow():
    torch.manual_seed(2)
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1, None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [v.clone() for s in opt.state.values() for v in s.values()]
    offload = TrainingStateOffload([model], [opt], torch.device("cpu"))
    offload.away(weights=False)
    # The refresh reads the parameters; the gradients and the optimizer's state are gone.
    assert all(p.untyped_storage().nbytes() for p in model.parameters())
    assert not any(p.grad.untyped_storage().nbytes() for p in model.parameters())
    assert not any(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values())
    partial = offload.host_bytes
    offload.away()
    assert not any(p.untyped_storage().nbytes() for p in model.parameters())
    assert offload.host_bytes == partial + sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values())
    with pytest.raises(RuntimeError, match="already off the device"):  # a third one
        offload.away()
    offload.back()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(torch.equal(a, b) for a, b in zip((v for s in opt.state.values() for v in s.values()), moments))
