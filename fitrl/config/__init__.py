"""fitrl configuration: the typed schema and its YAML loader (import-light: PyYAML only)."""

from .loader import config_to_dict, describe_fields, load_config, save_config
from .schema import ConfigError, FitrlConfig

__all__ = ["ConfigError", "FitrlConfig", "load_config", "config_to_dict", "save_config", "describe_fields"]
