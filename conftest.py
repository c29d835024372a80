"""Test-wide settings: the small budget for notebooks and experiments (read by course_lib.budget).
Notebook kernels started by nbval inherit the environment, so they see it too."""
import os

os.environ.setdefault("COURSE_BUDGET", "smoke")
