"""What adding a technique must not require: an edit in a second place that a reader can forget (issue 32)."""
from course_lib import config as C
from course_lib import export, widgets


def test_every_technique_has_a_control_on_the_default_panel():
    assert {t.name for t in C.TECHNIQUES} <= set(widgets.ALL_CONTROLS)


def test_every_technique_has_an_export_snippet():
    assert {t.field for t in C.TECHNIQUES} <= set(export.SNIPPETS) | set(export.NOT_EXPORTED)
