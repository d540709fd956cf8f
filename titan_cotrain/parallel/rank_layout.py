"""Which process sits at each coordinate of the ``[pp, dp, cp]`` mesh (``[parallelism] rank_order``).

torchtitan's ``ParallelDims`` puts the pipeline outermost (``pp_outer``, tensor parallel 1,
``dp = dp_replicate x dp_shard``)::

    rank(p, b, c) = (p * DP + b) * CP + c

so the ``cp x pp`` ranks that train the rows of data-parallel coordinate ``b`` lie ``DP x CP``
apart. A tensor-parallel rollout engine is made of exactly those ranks (``t`` consecutive
members of a coordinate, ``rl.generation_group``): at 70B (PP 4 x DP 4 x CP 2, engine TP 8)
the group of ``b = 0`` is ranks ``{0, 1, 8, 9, 16, 17, 24, 25}``, four nodes of 8 GPUs, and
every verify forward's ~160 all-reduces (two per layer) would cross them.

``dp_outer`` puts the data-parallel coordinate outermost instead::

    rank(p, b, c) = (b * PP + p) * CP + c

A coordinate's ``cp x pp`` ranks are then consecutive (one node at 70B) and an engine group is
``t`` consecutive ranks starting at a multiple of ``t``; the pipeline's p2p sends stay inside
that node too. The price: FSDP's groups (the ``dp x cp`` ranks of a stage, also the loss's
all-reduce) cross nodes, ``{0, 1, 8, 9, 16, 17, 24, 25}`` at 70B, where under ``pp_outer``
they are one node. Those are large, bandwidth-bound transfers overlapped with compute, a few
per FSDP unit and microbatch; the engine's all-reduces are small, latency-bound and on the
critical path of every decoding round, thousands of times per rollout.

Only the placement changes: the mesh's dims and names (``pp``, ``batch``, ``cp``, ``fsdp``,
``loss`` ...) are torchtitan's in both orders (``components.titan.build_parallel_dims``). In
both, every 1-D sub-mesh's ranks increase along its dim, so a process group's ranks are in
mesh order and a rank's group rank is its mesh coordinate. With ``pp = 1`` or ``dp = 1`` the
two orders are the same.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RANK_ORDERS", "RankLayout", "describe_role", "engine_group_nodes", "gpus_per_node", "nodes_spanned", "rank_layout"]

RANK_ORDERS = ("pp_outer", "dp_outer")


@dataclass(frozen=True)
class RankLayout:
    """The global rank of every ``(p, b, c)`` coordinate: pipeline rank ``p < pp``,
    data-parallel coordinate ``b < dp`` (torchtitan's ``batch``: ``dp_replicate x dp_shard``),
    context-parallel rank ``c < cp``; ``order`` is one of ``RANK_ORDERS``."""

    pp: int
    dp: int
    cp: int
    order: str = "pp_outer"

    def __post_init__(self) -> None:
        if self.order not in RANK_ORDERS:
            raise ValueError(f"rank order {self.order!r}: expected one of {RANK_ORDERS}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp

    def rank(self, p: int, b: int, c: int) -> int:
        if self.order == "dp_outer":
            return (b * self.pp + p) * self.cp + c
        return (p * self.dp + b) * self.cp + c

    def mesh_ranks(self) -> list[int]:
        """The global rank at each position of torchtitan's world mesh, in its ``[pp, dp, cp]``
        order (``arange(world)`` for ``pp_outer``)."""
        return [self.rank(p, b, c) for p in range(self.pp) for b in range(self.dp) for c in range(self.cp)]

    def dp_groups(self) -> list[list[int]]:
        """For each data-parallel coordinate ``b``, the ``cp x pp`` ranks that train its rows:
        member ``p * cp + c`` is ``rank(p, b, c)``."""
        return [[self.rank(p, b, c) for p in range(self.pp) for c in range(self.cp)] for b in range(self.dp)]

    def engine_groups(self, tensor_parallel: int) -> list[list[int]]:
        """Every tensor-parallel engine group of the job: ``tensor_parallel`` consecutive members
        of each coordinate's group (it must divide ``cp x pp``)."""
        t = tensor_parallel
        if (self.pp * self.cp) % t:
            raise ValueError(f"[rollout] tensor_parallel_degree = {t} must divide cp x pp = {self.pp * self.cp}: "
                             "an engine group is made of ranks that train the same rows")
        return [ranks[i: i + t] for ranks in self.dp_groups() for i in range(0, len(ranks), t)]


def nodes_spanned(groups: Sequence[Sequence[int]], gpus_per_node: int) -> int:
    """The most nodes one of ``groups`` lies on (ranks ``n x gpus_per_node ..`` on node ``n``,
    torchrun's placement)."""
    return max(len({rank // gpus_per_node for rank in ranks}) for ranks in groups)


def gpus_per_node(config) -> int:
    """Processes per node: torchrun's ``LOCAL_WORLD_SIZE``; where no launcher sets it (the
    simulator, ranks started by hand) the machine ``[simulate] gpus_per_node`` describes."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or config.simulate.gpus_per_node


def rank_layout(config, world_size: int, node_size: int | None = None) -> RankLayout:
    """The layout of ``config``'s ``[parallelism]`` at ``world_size`` ranks, ``rank_order =
    "auto"`` resolved: ``dp_outer`` when ``pp_outer`` would spread an engine group of ``[rollout]
    tensor_parallel_degree`` over more nodes of ``node_size`` (default ``gpus_per_node(config)``)
    than ``dp_outer`` does, else torchtitan's ``pp_outer``. Every rank resolves it alike."""
    p = config.parallelism
    pp, cp = p.pipeline_parallel_degree, p.context_parallel_degree
    dp = world_size // (pp * cp)
    if p.rank_order != "auto":
        return RankLayout(pp, dp, cp, p.rank_order)
    t = config.rollout.tensor_parallel_degree
    node_size = node_size or gpus_per_node(config)
    if t == 1 or (pp * cp) % t:  # the config check names a degree that does not divide
        return RankLayout(pp, dp, cp)
    spans = {order: nodes_spanned(RankLayout(pp, dp, cp, order).engine_groups(t), node_size) for order in RANK_ORDERS}
    return RankLayout(pp, dp, cp, "dp_outer" if spans["dp_outer"] < spans["pp_outer"] else "pp_outer")


def engine_group_nodes(config, world_size: int, node_size: int | None = None) -> int:
    """The most nodes of ``node_size`` GPUs (default ``gpus_per_node(config)``) one engine group
    of ``config`` lies on, in the layout the job uses: 1 when every all-reduce of the
    tensor-parallel engine stays inside a node (what the scale report's ``tp_group_nodes`` says)."""
    node_size = node_size or gpus_per_node(config)
    layout = rank_layout(config, world_size, node_size)
    return nodes_spanned(layout.engine_groups(config.rollout.tensor_parallel_degree), node_size)


def describe_role(dims, plan=None) -> str:
    """Where this rank sits in torchtitan's mesh ``dims`` (a ``ParallelDims`` whose mesh is
    built), for reports: ``"pp stages [s, ..], dp d/D, cp c/C"`` (the parts in use; ``plan``:
    a pipeline's stage plan), ``"single"`` without any."""
    parts = []
    if plan is not None:
        parts.append(f"pp stages {plan.stages_of(dims.get_mesh('pp').get_local_rank())}")
    if dims.dp_enabled:
        parts.append(f"dp {dims.get_mesh('batch').get_local_rank()}/{dims.dp_replicate * dims.dp_shard}")
    if dims.cp_enabled:
        parts.append(f"cp {dims.get_mesh('cp').get_local_rank()}/{dims.cp}")
    return ", ".join(parts) or "single"
