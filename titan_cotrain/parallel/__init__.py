"""Parallelism: FSDP2 (``fsdp``), context parallelism (``context_parallel``, ``cp_dispatch``)
and pipeline parallelism with the TapChannel (``pipeline``, ``tap_channel``)."""
