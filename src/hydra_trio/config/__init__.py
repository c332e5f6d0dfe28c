"""All settings in one place: each flag of `hydra-trio serve` and its HYDRA_* variable.

The face of the settings: ``Settings`` (the catalog, settings.py), ``validate`` and the
rules other layers share (rules.py), and the reading of flags and variables (flags.py).
Callers import these names from here; the modules are this package's own business."""

from .flags import add_arguments, settings_from, settings_table, split_model_flags
from .rules import CACHE_TYPES, REASONING_FORMATS, cache_type_problem, validate
from .settings import IPNetwork, Settings, is_loopback

__all__ = [
    "CACHE_TYPES",
    "REASONING_FORMATS",
    "IPNetwork",
    "Settings",
    "add_arguments",
    "cache_type_problem",
    "is_loopback",
    "settings_from",
    "settings_table",
    "split_model_flags",
    "validate",
]
