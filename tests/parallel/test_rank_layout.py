"""The rank layout (``[parallelism] rank_order``): torchtitan's pp-outer placement unchanged, and
the data-parallel-outer one that keeps every tensor-parallel engine group inside a node.
(The placed torchtitan mesh on 4 gloo ranks: ``tests/parallel/test_pipeline.py``.)"""

import pytest

from titan_cotrain.config import load_job_config
from titan_cotrain.parallel.rank_layout import RankLayout, engine_group_nodes, nodes_spanned, rank_layout

LLAMA_70B = "train_configs/llama3_70b_pp_cp.toml"  # PP 4 x DP 4 x CP 2 on 32 GPUs, engine TP 8


def _config(path: str = "", *args: str):
    files = ["--job.config_file", path] if path else []
    return load_job_config([*files, "--simulate.enable", *args], world_size="config")


def test_pp_outer_is_torchtitans_order():
    layout = RankLayout(4, 4, 2, "pp_outer")
    assert layout.mesh_ranks() == list(range(32))
    assert layout.dp_groups()[1] == [(p * 4 + 1) * 2 + c for p in range(4) for c in range(2)]


def test_dp_outer_makes_a_coordinates_ranks_consecutive():
    layout = RankLayout(4, 4, 2, "dp_outer")
    assert sorted(layout.mesh_ranks()) == list(range(32))
    assert layout.dp_groups() == [list(range(8 * b, 8 * b + 8)) for b in range(4)]
    assert layout.rank(p=3, b=1, c=1) == 15 and layout.mesh_ranks()[(3 * 4 + 1) * 2 + 1] == 15
    # A stage's FSDP group (its DP x CP ranks) now spans the nodes: the trade.
    assert [layout.rank(0, b, c) for b in range(4) for c in range(2)] == [0, 1, 8, 9, 16, 17, 24, 25]


def test_the_70b_engine_groups_stay_in_a_node_under_auto(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # the simulator's case: [simulate] gpus_per_node = 8
    config = _config(LLAMA_70B)
    layout = rank_layout(config, 32)
    assert layout == RankLayout(4, 4, 2, "dp_outer")
    groups = layout.engine_groups(8)
    assert len(groups) == 4 and all(g == list(range(g[0], g[0] + 8)) and g[0] % 8 == 0 for g in groups)
    assert engine_group_nodes(config, 32) == 1
    # torchtitan's order spreads each over the 4 nodes; a 32-GPU node would hold it anyway.
    pinned = _config(LLAMA_70B, "--parallelism.rank_order", "pp_outer")
    assert rank_layout(pinned, 32).engine_groups(8)[0] == [0, 1, 8, 9, 16, 17, 24, 25]
    assert engine_group_nodes(pinned, 32) == 4 and engine_group_nodes(pinned, 32, node_size=32) == 1
    assert rank_layout(config, 32, node_size=32).order == "pp_outer"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")  # torchrun's value wins over [simulate] gpus_per_node
    assert rank_layout(config, 32).order == "pp_outer"


@pytest.mark.parametrize("degree", ["1", "2"])
def test_auto_keeps_torchtitans_order_when_it_costs_nothing(degree):
    """Without an engine TP, or with one inside a CP group (TP 2 = CP 2), nothing to gain."""
    assert rank_layout(_config(LLAMA_70B, "--rollout.tensor_parallel_degree", degree), 32).order == "pp_outer"


def test_nodes_spanned():
    assert nodes_spanned([[0, 1], [6, 7], [7, 8]], 8) == 2 and nodes_spanned([[0, 9]], 16) == 1


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="rank order 'tp_outer'"):
        RankLayout(2, 2, 1, "tp_outer")
