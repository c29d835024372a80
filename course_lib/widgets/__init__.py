"""The learner's side of the course: the technique panel (`Panel`) and the environment cell (`show_environment`).

The panel is put together from parts, one module each: controls.py (the controls, the techniques' from the registry),
run_queue.py (the runs, one after another; an OOM is a row and the next run goes on), figure.py and table.py (made
from the results alone), export_box.py (the code section), panel.py (the Panel that composes them). rerun.py: a small
re-run box for a measurement that is not a training run (a kernel sweep, a torchrun launch). pressing.py: every Run
button made in this kernel pressed, and what each drew (the notebooks' tests use it).
"""

from .controls import (  # noqa: F401 - the names the notebooks and tests use as widgets.X
    ALL_CONTROLS,
    CHOICES,
    FORMATS,
    LABELS,
    MODEL_FIELDS,
    SLIDERS,
    Controls,
    fewest_steps,
)
from .environment import show_environment  # noqa: F401
from .figure import FigureView  # noqa: F401
from .panel import Panel  # noqa: F401
from .pressing import check_all, press_all  # noqa: F401
from .rerun import Rerun  # noqa: F401
from .run_queue import RunQueue  # noqa: F401
from .table import TableView  # noqa: F401
