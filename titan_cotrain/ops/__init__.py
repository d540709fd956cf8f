"""Attention ops over packed ``[T, H, Dh]`` tokens: the trunk, the EAGLE-3 branch, and their merge."""

from titan_cotrain.ops.attention import VarlenAttention, merge_attention, varlen_causal_attention
from titan_cotrain.ops.branch_attention import BranchAttention, branch_attention, branch_attention_with_lse

__all__ = [
    "BranchAttention",
    "VarlenAttention",
    "branch_attention",
    "branch_attention_with_lse",
    "merge_attention",
    "varlen_causal_attention",
]
