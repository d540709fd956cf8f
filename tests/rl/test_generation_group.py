"""No duplicated generation: the CP x PP peers of one data-parallel coordinate share out their
rollouts and all train the same received batch; prompts that differ between peers stop the job."""

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import run_on_ranks
from titan_cotrain.parallel.rank_layout import RankLayout
from titan_cotrain.rl.generation_group import GenerationGroup


def _group(pp, dp, cp, rank, order="pp_outer", **kwargs):
    layout = RankLayout(pp, dp, cp, order)
    (b,) = [b for b, ranks in enumerate(layout.dp_groups()) if rank in ranks]
    return GenerationGroup(layout, rank, kwargs.pop("split", True), dp_rank=kwargs.pop("dp_rank", b),
                           communicate=False, **kwargs)


@pytest.mark.parametrize("order, mesh", [("pp_outer", "pp dp cp"), ("dp_outer", "dp pp cp")])
def test_groups_follow_the_rank_layout_and_share_whole_problems(order, mesh):
    pp, dp, cp = 2, 2, 2
    # The ranks of the layout, arranged [pp, dp, cp]: torchtitan's pp-outer arange, or dp outermost.
    grid = torch.arange(pp * dp * cp).view(pp, dp, cp) if order == "pp_outer" else \
        torch.arange(pp * dp * cp).view(dp, pp, cp).transpose(0, 1)
    for rank in range(pp * dp * cp):
        p, b, c = (grid == rank).nonzero()[0].tolist()
        group = _group(pp, dp, cp, rank, order)
        assert group.ranks == grid[:, b, :].flatten().tolist()
        assert group.member == p * cp + c
    group = _group(pp, dp, cp, 0, order)
    shares = [group.share(10, member) for member in range(4)]
    assert shares == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]] and group.max_share(10) == 3
    leader = _group(pp, dp, cp, 0, order, split=False)
    assert [leader.share(10, m) for m in range(4)] == [list(range(10)), [], [], []]
    with pytest.raises(RuntimeError, match=f"data-parallel coordinate is 1, the {order} layout says 0"):
        _group(pp, dp, cp, 0, order, dp_rank=1)


def test_tensor_parallel_engine_groups_generate_together_and_their_first_rank_sends():
    pp, dp, cp = 2, 2, 2
    groups = [_group(pp, dp, cp, rank, tensor_parallel=2) for rank in range(pp * dp * cp)]
    # Each coordinate's peers [0, 1, 4, 5] and [2, 3, 6, 7] make two engine groups of two.
    assert groups[0].engine_groups() == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert [g.unit for g in groups] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert groups[0].share(5) == groups[1].share(5) == [0, 2, 4] and groups[4].share(5) == [1, 3]
    assert [g.sends() for g in groups[:2]] == [True, False] and groups[0].max_share(5) == 3
    with pytest.raises(ValueError, match="must divide cp x pp = 4"):
        _group(pp, dp, cp, 0, tensor_parallel=3)


def test_nodes_an_engine_group_spans():
    """In the pp_outer layout an engine group of a data-parallel coordinate's CP x PP peers
    lies on one node only without PP: the 70B layout (PP 4 x DP 4 x CP 2, TP 8) spreads each
    group over 4 nodes of 8 GPUs; dp_outer keeps each in one, as FSDP 4 x CP 2 with TP 2 is."""
    pp, dp, cp = 4, 4, 2
    group = _group(pp, dp, cp, 0, tensor_parallel=8)
    assert group.engine_groups()[0] == [0, 1, 8, 9, 16, 17, 24, 25]
    assert group.nodes_spanned(8) == 4 and group.nodes_spanned(32) == 1
    group = _group(pp, dp, cp, 0, "dp_outer", tensor_parallel=8)
    assert group.engine_groups() == [list(range(n * 8, n * 8 + 8)) for n in range(4)]
    assert group.nodes_spanned(8) == 1
    assert _group(1, 4, 2, 0, tensor_parallel=2).nodes_spanned(8) == 1


ARGS = ("--task.sft_steps", "0", "--training.steps", "1", "--training.seq_len", "64", "--rl.prompts_per_step", "4",
        "--rl.group_size", "2", "--rollout.max_new_tokens", "8", "--parallelism.context_parallel_degree", "2",
        "--checkpoint.no-enable", "--metrics.no-enable_tensorboard")


def _split_rollouts(rank: int, world_size: int, folder: str) -> None:
    from titan_cotrain.config import load_job_config
    from titan_cotrain.rl.trainer import Trainer

    trainer = Trainer(load_job_config([*ARGS, "--job.dump_folder", folder], world_size=world_size),
                      world_size, rank)
    generated = []
    real_generate = trainer.engine.generate

    def recording(prompts, *args, **kwargs):
        generated.append(([list(p) for p in prompts], kwargs["samples_per_prompt"]))
        return real_generate(prompts, *args, **kwargs)

    trainer.engine.generate = recording
    trainer.refresh_engine()
    samples, metrics = trainer.rollouts(1)
    _, prompts = trainer.rollouts.prompts(1)
    # This rank generated its share only: its problems (of 4), each prefilled once for both samples.
    assert len(generated) == 1 and generated[0] == ([prompts[i] for i in (rank, 2 + rank)], 2)
    # Every peer holds the whole batch, in problem order, the same on both ranks.
    assert [s.prompt for s in samples] == [p for p in prompts for _ in range(2)]
    both = [None, None]
    dist.all_gather_object(both, (samples, metrics))
    assert both[0][0] == both[1][0]
    volatile = ("time/", "rollout/tokens_per_s")
    assert {k: v for k, v in both[0][1].items() if not k.startswith(volatile)} == \
        {k: v for k, v in both[1][1].items() if not k.startswith(volatile)}
    mine = {tuple(p) for p in generated[0][0]}
    assert {tuple(s.prompt) for s in samples} - mine  # the rest was received, not generated
    # The update trains the received rows.
    update = trainer.update.step(trainer.pack(samples, 1), trainer.rl_loss, train_draft=True, warm_start=False)
    assert torch.isfinite(torch.tensor(update["loss/policy"]))

    # Peers that drew different prompts cannot share rollouts: every one of them stops.
    if rank == 1:
        trainer.rollouts.prompts = lambda step, round_=0, real=trainer.rollouts.prompts: real(step + 1, round_)
    with pytest.raises(RuntimeError, match=r"the ranks \[0, 1\], which train the same rows, drew different prompts"):
        trainer.rollouts(1)


def test_cp_peers_generate_a_share_each_and_train_the_same_received_batch(tmp_path):
    run_on_ranks(_split_rollouts, 2, str(tmp_path))
