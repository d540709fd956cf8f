"""No duplicated generation: the ranks that train the same rows share one set of rollouts.

Context-parallel and pipeline peers (the ``cp x pp`` ranks of one data-parallel coordinate)
train the same packed rows: CP shards them, PP passes them from stage to stage. Their
rollouts must be *the same* rollouts, and generating them on every peer would be ``cp x pp``
times the work and would rely on every peer's sampling being bit-identical. Instead the
group's prompts (GRPO groups: a problem and its ``G`` samples, never split) are shared out,
each rank generates and scores its share, and the finished samples are exchanged, so every
rank trains on a batch it *received*.

``split = True``: member ``j`` of a group of ``g`` generates problems ``j, j + g, j + 2g, ...``.
``split = False``: member 0 generates them all and sends them; the others generate nothing
(the rollouts are then those a one-process job of the same seed generates, which the parity
tests compare against).

With a tensor-parallel engine of degree ``t`` (``[rollout] tensor_parallel_degree``) the
generating unit is an *engine group* of ``t`` consecutive members, which generate together
(``parallel.engine_tp``): unit ``u = j // t`` takes the share member ``u`` would take in a
group of ``g / t``, and only its first member sends the results.

Which global ranks make a group is the job's rank layout (``parallel.rank_layout``,
``[parallelism] rank_order``): the group of data-parallel coordinate ``b`` is
``layout.dp_groups()[b]``, member ``p * CP + c`` at pipeline rank ``p`` and CP rank ``c``.
"""

import hashlib
import pickle

import torch.distributed as dist

from titan_cotrain.parallel.rank_layout import RankLayout, nodes_spanned

__all__ = ["GenerationGroup"]


class GenerationGroup:
    """This rank's place among the ranks that train the same rows, and the exchange.

    ``size``: ``cp x pp`` (1: nothing to share); ``member``: this rank's index in the group;
    ``tensor_parallel``: members per engine group (it must divide ``size``); ``unit``: this
    rank's engine group within the group. ``dp_rank``: this rank's data-parallel coordinate
    as the device mesh has it, checked against ``layout``. Every rank must construct it
    (creating the groups is a collective)."""

    def __init__(self, layout: RankLayout, rank: int, split: bool, *, dp_rank: int, communicate: bool = True,
                 tensor_parallel: int = 1) -> None:
        self.layout, self.split, self.tensor_parallel = layout, split, tensor_parallel
        self.size = layout.pp * layout.cp
        self._engine_groups = layout.engine_groups(tensor_parallel)  # checks that t divides the size
        self.groups = groups = layout.dp_groups()
        (self.ranks,) = [ranks for ranks in groups if rank in ranks]
        if groups.index(self.ranks) != dp_rank:
            raise RuntimeError(f"rank {rank}: the mesh's data-parallel coordinate is {dp_rank}, the {layout.order} "
                               f"layout says {groups.index(self.ranks)}")
        self.member = self.ranks.index(rank)
        self.unit = self.member // tensor_parallel
        self.group = None
        if self.size > 1 and communicate:
            self.group, _ = dist.new_subgroups_by_enumeration(groups)

    @property
    def units(self) -> int:
        """Engine groups per group: ``size / tensor_parallel``."""
        return self.size // self.tensor_parallel

    def engine_groups(self) -> list[list[int]]:
        """Every engine group of the job (``tensor_parallel`` consecutive members of each
        group), the same list on every rank."""
        return self._engine_groups

    def nodes_spanned(self, gpus_per_node: int) -> int:
        """The most nodes one engine group's ranks lie on (ranks ``n x gpus_per_node ..`` on
        node ``n``): 1 when every tensor-parallel all-reduce of the engine stays in a node."""
        return nodes_spanned(self._engine_groups, gpus_per_node)

    def share(self, n_problems: int, member: int | None = None) -> list[int]:
        """The indices (of ``n_problems``) that ``member`` (default: this rank) generates,
        with the rest of its engine group."""
        unit = (self.member if member is None else member) // self.tensor_parallel
        if not self.split:
            return list(range(n_problems)) if unit == 0 else []
        return list(range(unit, n_problems, self.units))

    def sends(self, member: int | None = None) -> bool:
        """Whether ``member``'s results are the ones exchanged (its engine group's first)."""
        return (self.member if member is None else member) % self.tensor_parallel == 0

    def max_share(self, n_problems: int) -> int:
        """The most problems any member generates (what its engine is sized for)."""
        return n_problems if not self.split else -(-n_problems // self.units)

    def exchange(self, own: list, n_problems: int, problems_key: bytes) -> list:
        """Every member's ``own`` results (one entry per problem of its ``share``, in order)
        put back in problem order, the same list on every member. ``problems_key`` is the
        digest of the prompts this rank drew: members that drew different problems would
        train on rows that are not the same, so that stops the job with a message."""
        if self.group is None:
            return own
        gathered = [None] * self.size
        dist.all_gather_object(gathered, (problems_key, own if self.sends() else None), group=self.group)
        keys = {key for key, _ in gathered}
        if len(keys) > 1:
            raise RuntimeError(f"the ranks {self.ranks}, which train the same rows, drew different prompts for this "
                               "step; their rollouts cannot be shared")
        merged = [None] * n_problems
        for member, (_, results) in enumerate(gathered):
            if not self.sends(member):
                continue
            indices = self.share(n_problems, member)
            if len(indices) != len(results):
                raise RuntimeError(f"rank {self.ranks[member]} sent {len(results)} rollout groups, expected "
                                   f"{len(indices)}")
            for i, result in zip(indices, results):
                merged[i] = result
        return merged

    @staticmethod
    def digest(value) -> bytes:
        """A short digest of a picklable value (the prompts a rank drew)."""
        return hashlib.sha256(pickle.dumps(value)).digest()[:16]
