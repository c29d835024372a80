"""The course's shipped data, installed as the package course_lib._data (see pyproject.toml)."""
