"""The few private torch APIs the project calls, each checked against the torch versions it
was written for (the project runs on torch 2.11-2.13): a newer torch stops with a message
naming the API and its user instead of misbehaving."""

import torch

__all__ = ["check_private_api"]


def check_private_api(api: str, user: str, versions: tuple[str, ...]) -> None:
    """Raise unless torch's ``major.minor`` is one of ``versions``, where ``user`` was
    checked to call the private ``api`` correctly."""
    version = torch.__version__.split("+")[0]
    if ".".join(version.split(".")[:2]) not in versions:
        raise RuntimeError(f"{user} calls torch's private {api}, written against torch {', '.join(versions)}; "
                           f"found torch {torch.__version__}. Check it and add the version.")
