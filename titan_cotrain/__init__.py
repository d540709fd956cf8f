"""titan_cotrain: RL post-training of LLMs with an EAGLE-3 draft co-trained online.

Packages: ``config`` (TOML job config), ``components`` (the torchtitan adapter), ``models``
(target, draft, Hugging Face and EAGLE-3 folders), ``ops`` (document-causal, branch and
ring attention), ``parallel`` (FSDP, context and pipeline parallelism), ``cotrain`` (TTT
unroll and the co-training step), ``data`` (packed rows), ``rl`` (rollouts, GRPO, tasks,
trainer). The main job is ``python -m titan_cotrain.train``.
"""

__version__ = "0.1.0"

# The job-config checks of the packages above ``config`` register themselves with it
# (``config.validate.config_check``): importing the package registers them all.
from titan_cotrain.parallel import config_checks as _parallel_checks  # noqa: E402,F401
from titan_cotrain.rl import config_checks as _rl_checks  # noqa: E402,F401
