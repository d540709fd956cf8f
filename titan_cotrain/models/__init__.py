"""The target decoder, its shapes, and its Hugging Face checkpoint adapter."""

from titan_cotrain.models.args import ARCHITECTURES, ModelArgs, RopeScaling, model_args_for
from titan_cotrain.models.eagle3 import load_eagle3, save_eagle3
from titan_cotrain.models.hf import (
    HFCheckpointError,
    hf_config_from_model_args,
    load_hf,
    model_args_from_hf_config,
    read_hf_model_args,
    save_hf,
)
from titan_cotrain.models.transformer import TargetOutput, Transformer

__all__ = [
    "ARCHITECTURES",
    "HFCheckpointError",
    "ModelArgs",
    "RopeScaling",
    "TargetOutput",
    "Transformer",
    "hf_config_from_model_args",
    "load_eagle3",
    "load_hf",
    "model_args_for",
    "model_args_from_hf_config",
    "read_hf_model_args",
    "save_eagle3",
    "save_hf",
]
