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

World layout (torchtitan's ``ParallelDims``): ranks are ordered ``[pp, dp, cp]`` (tensor
parallel 1), so the group of data-parallel coordinate ``b`` is ``{(p * DP + b) * CP + c}``.
"""

import hashlib
import pickle

import torch.distributed as dist

__all__ = ["GenerationGroup"]


class GenerationGroup:
    """This rank's place among the ranks that train the same rows, and the exchange.

    ``size``: ``cp x pp`` (1: nothing to share); ``member``: this rank's index in the group.
    Every rank must construct it (creating the groups is a collective)."""

    def __init__(self, pp: int, dp: int, cp: int, rank: int, split: bool, *, dp_rank: int,
                 communicate: bool = True) -> None:
        self.size, self.split = pp * cp, split
        groups = [[(p * dp + b) * cp + c for p in range(pp) for c in range(cp)] for b in range(dp)]
        (self.ranks,) = [ranks for ranks in groups if rank in ranks]
        if groups.index(self.ranks) != dp_rank:
            raise RuntimeError(f"rank {rank}: the mesh's data-parallel coordinate is {dp_rank}, the [pp, dp, cp] "
                               f"layout says {groups.index(self.ranks)}")
        self.member = self.ranks.index(rank)
        self.group = None
        if self.size > 1 and communicate:
            self.group, _ = dist.new_subgroups_by_enumeration(groups)

    def share(self, n_problems: int, member: int | None = None) -> list[int]:
        """The indices (of ``n_problems``) that ``member`` (default: this rank) generates."""
        member = self.member if member is None else member
        if not self.split:
            return list(range(n_problems)) if member == 0 else []
        return list(range(member, n_problems, self.size))

    def max_share(self, n_problems: int) -> int:
        """The most problems any member generates (what its engine is sized for)."""
        return n_problems if not self.split else -(-n_problems // self.size)

    def exchange(self, own: list, n_problems: int, problems_key: bytes) -> list:
        """Every member's ``own`` results (one entry per problem of its ``share``, in order)
        put back in problem order, the same list on every member. ``problems_key`` is the
        digest of the prompts this rank drew: members that drew different problems would
        train on rows that are not the same, so that stops the job with a message."""
        if self.group is None:
            return own
        gathered = [None] * self.size
        dist.all_gather_object(gathered, (problems_key, own), group=self.group)
        keys = {key for key, _ in gathered}
        if len(keys) > 1:
            raise RuntimeError(f"the ranks {self.ranks}, which train the same rows, drew different prompts for this "
                               "step; their rollouts cannot be shared")
        merged = [None] * n_problems
        for member, (_, results) in enumerate(gathered):
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
