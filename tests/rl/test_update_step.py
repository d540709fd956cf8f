"""``UpdateStep``: its settings are the job config's keys, read once; an RL batch is
``updates_per_step`` updates over consecutive minibatches, a warm-start batch one update."""

import pytest
import torch

from titan_cotrain.config import load_job_config
from titan_cotrain.data.batch import PackedBatch
from titan_cotrain.rl.update_step import UpdateSettings, UpdateStep


def test_the_settings_are_the_config_keys():
    config = load_job_config(["--rl.updates_per_step", "3", "--training.local_batch_size", "2",
                              "--draft.ttt_steps", "4", "--draft.pass_decay", "0.5", "--draft.loss_weight", "0.25",
                              "--draft.loss_on", "all", "--model.moe_aux_loss_weight", "0.01",
                              "--training.max_norm", "2.0", "--draft.grad_clip", "0.5"], world_size=1)
    assert UpdateSettings.from_config(config) == UpdateSettings(
        updates_per_step=3, microbatch_rows=2, ttt_steps=4, pass_decay=0.5, draft_loss_weight=0.25,
        draft_loss_on="all", moe_aux_loss_weight=0.01, policy_max_norm=2.0, draft_max_norm=0.5)


class _Recorded(UpdateStep):
    """Records the rows of each minibatch; its loss is the minibatch's index."""

    def __init__(self, settings: UpdateSettings) -> None:
        weight = torch.nn.Parameter(torch.zeros(1))
        super().__init__(settings, torch.optim.SGD([weight]), None, torch.device("cpu"),
                         lambda values: {key: float(value) for key, value in values.items()})
        self.minibatches: list[list[int]] = []

    def gradients(self, minibatch, loss_fn, train_draft, seed=0):
        self.minibatches.append(minibatch.tokens[:, 0].tolist())
        return {"loss/policy": torch.tensor(float(len(self.minibatches) - 1))}


@pytest.mark.parametrize("warm_start", [True, False], ids=["warm-start", "rl"])
def test_a_warm_start_batch_is_one_update_and_an_rl_batch_updates_per_step(warm_start):
    config = load_job_config(["--rl.updates_per_step", "2"], world_size=1)
    update = _Recorded(UpdateSettings.from_config(config))
    rows = torch.arange(4).unsqueeze(1)
    batch = PackedBatch(rows, torch.zeros_like(rows), torch.ones_like(rows, dtype=torch.bool))
    metrics = update.step(batch, None, train_draft=False, warm_start=warm_start)
    assert update.minibatches == ([[0, 1, 2, 3]] if warm_start else [[0, 1], [2, 3]])
    assert metrics["loss/policy"] == (0.0 if warm_start else 0.5)  # the mean over the minibatches
