"""The few private torch APIs the project calls, each checked against the torch versions it
was written for (the project runs on torch 2.11-2.13): a newer torch stops with a message
naming the API and its user instead of misbehaving."""

import torch

__all__ = ["check_private_api", "in_backward"]


def check_private_api(api: str, user: str, versions: tuple[str, ...]) -> None:
    """Raise unless torch's ``major.minor`` is one of ``versions``, where ``user`` was
    checked to call the private ``api`` correctly."""
    version = torch.__version__.split("+")[0]
    if ".".join(version.split(".")[:2]) not in versions:
        raise RuntimeError(f"{user} calls torch's private {api}, written against torch {', '.join(versions)}; "
                           f"found torch {torch.__version__}. Check it and add the version.")


# Whether autograd is running a backward on this thread, which torch answers only privately
# (``torch._C._current_graph_task_id``: -1 outside one; its own checkpointing reads it). The
# same in torch 2.11-2.13.
_GRAPH_TASK_TORCH = ("2.11", "2.12", "2.13")


def in_backward() -> bool:
    """Whether this thread is inside a backward: an activation-checkpoint rerun of a forward
    (whose side effects, the router records and the loss sums, must not happen twice)."""
    check_private_api("torch._C._current_graph_task_id", "titan_cotrain.components.private_torch.in_backward",
                      _GRAPH_TASK_TORCH)
    return torch._C._current_graph_task_id() != -1
