"""Job config: torchtitan's TOML ``JobConfig`` extended with the project's sections."""

from titan_cotrain.config.loader import ConfigError, load_job_config
from titan_cotrain.config.validate import validate_job_config

__all__ = ["ConfigError", "load_job_config", "validate_job_config"]
