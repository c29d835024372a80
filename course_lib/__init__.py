"""course_lib: the shared package of the course "Optimising the training loop".

Its layers, bottom to top (docs/architecture.md; tests/test_imports.py holds every import to them): config and the base,
the device's capabilities, model and data, measure and techniques, results and plots, the loop (train, ladder), the
notebooks' own helpers (lessons/), and the learner's side (widgets, the CLI).
"""

from .config import ConfigError, ModelConfig, TrainConfig
from .ladder import ladder_configs
from .presets import preset
from .results import RunResult

__all__ = ["ConfigError", "ModelConfig", "TrainConfig", "RunResult", "ladder_configs", "preset"]
__version__ = "0.1.0"
