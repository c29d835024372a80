"""course_lib: the shared package of the course "Optimising the training loop". Its layers, bottom to top, are in
docs/architecture.md (tests/test_imports.py holds every import to them)."""

from .config import ConfigError, ModelConfig, TrainConfig
from .ladder import ladder_configs
from .presets import preset
from .results import RunResult

__all__ = ["ConfigError", "ModelConfig", "TrainConfig", "RunResult", "ladder_configs", "preset"]
__version__ = "0.1.0"
