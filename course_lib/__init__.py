"""course_lib: the shared package of the course "Optimising the training loop".

config -> model -> techniques -> train -> measure -> results -> plots / widgets, with data feeding train.
"""

from .config import ConfigError, ModelConfig, TrainConfig, preset
from .ladder import ladder_configs
from .results import RunResult

__all__ = ["ConfigError", "ModelConfig", "TrainConfig", "RunResult", "ladder_configs", "preset"]
__version__ = "0.1.0"
