"""The simulator's bounded rollout (``simulate.rollout_drive``): the engine's own step pieces,
driven for exactly the stated rounds over what fits the empty batch, every row reading the
widest table, nothing read back (no round is post-processed)."""

import pytest
import torch

from titan_cotrain.engine.rollout import RolloutEngine
from titan_cotrain.engine.sampling import SamplingParams
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.simulate.rollout_drive import bounded_rollout

SEQ_LEN, K = 40, 3


@pytest.mark.parametrize("draft_tokens", [0, K])
def test_a_bounded_rollout_runs_its_rounds_over_the_first_batch_at_its_widest(monkeypatch, one_intra_op_thread,
                                                                              draft_tokens):
    target = Transformer(model_args_for("llama3", "debugmodel").replace(vocab_size=128))
    target.init_weights(std=0.3, generator=torch.Generator().manual_seed(0))
    draft = Draft(DraftArgs.from_target(target.args, n_taps=3))
    draft.init_weights(std=0.1, generator=torch.Generator().manual_seed(1))
    # Rows for 2 groups of 2: they enter the empty batch, the other 2 wait for ever.
    engine = RolloutEngine(target, draft, max_batch_size=4, max_seq_len=SEQ_LEN, max_draft_tokens=K, block_size=4)
    rounds, admitted = [], []
    run, admit = RolloutEngine.run, RolloutEngine.admit

    def recording_run(self, call, round_):
        rounds.append((round_.rows, round_.k, round_.target_cache.table.shape))
        run(self, call, round_)

    def recording_admit(self, call):
        admit(self, call)
        admitted.append(call.scheduler.live())

    def no_postprocess(self, call, round_):
        raise AssertionError("a bounded rollout reads nothing back")

    monkeypatch.setattr(RolloutEngine, "run", recording_run)
    monkeypatch.setattr(RolloutEngine, "admit", recording_admit)
    monkeypatch.setattr(RolloutEngine, "postprocess", no_postprocess)
    prompts = [list(range(1, n + 1)) for n in (5, 9, 14, 7)]
    out = bounded_rollout(engine, prompts, SamplingParams(max_new_tokens=20), rounds=3, samples_per_prompt=2,
                          draft_tokens=draft_tokens)
    assert out is None and admitted == [4]
    assert rounds == [(4, draft_tokens, (4, engine.blocks_per_sequence))] * 3
