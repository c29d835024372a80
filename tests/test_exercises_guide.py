"""The exercises' guide for teachers (docs/exercises.md) says what the checkers say: its blocks are generated from
course_lib.exercises and must be up to date; the README and the teacher's guide link it."""

import pytest

from course_lib import __main__ as cli, exercises as X
from course_lib.exercises import guide as G


def test_the_committed_guide_is_up_to_date():
    text = G.GUIDE.read_text()
    assert G.update(text) == text, "the exercises changed: run `python -m course_lib exercises --guide` and commit"
    assert "<!-- exercises" not in (G.GUIDE.parent / "teachers_guide.md").read_text()  # they have a file of their own


def test_every_exercise_and_every_hint_is_in_the_guide_under_its_notebook():
    text = G.GUIDE.read_text()
    for ex in X.EXERCISES.values():
        block = text.split(G.BEGIN.format(nb=ex.notebook))[1].split(G.END.format(nb=ex.notebook))[0]
        assert f"`{ex.name}(" in block and ex.title in block
        for m in ex.mistakes:
            assert m.hint in block, (ex.name, m.name)


def test_a_stale_block_is_rewritten_and_a_missing_one_is_named():
    text = G.GUIDE.read_text()
    nb = next(iter(X.EXERCISES.values())).notebook
    begin, end = G.BEGIN.format(nb=nb), G.END.format(nb=nb)
    stale = text.replace(begin, begin + "\n- an exercise that no longer exists\n")
    assert G.update(stale) == text
    without = text.split(begin)[0] + text.split(end)[1]
    with pytest.raises(ValueError, match=f"notebook\\(s\\) {nb}"):
        G.update(without)


def test_the_cli_rewrites_a_stale_guide(tmp_path, capsys):
    copy = tmp_path / "guide.md"
    nb = next(iter(X.EXERCISES.values())).notebook
    copy.write_text(G.GUIDE.read_text().replace(G.END.format(nb=nb), "stale\n" + G.END.format(nb=nb)))
    assert cli.main(["exercises", "--guide", str(copy)]) == 0 and "rewritten" in capsys.readouterr().out
    assert copy.read_text() == G.GUIDE.read_text()
    assert cli.main(["exercises", "--guide", str(copy)]) == 0 and "up to date" in capsys.readouterr().out


def test_the_readme_and_the_teachers_guide_link_the_exercises():
    assert G.GUIDE.name == "exercises.md"
    readme = (G.GUIDE.parent.parent / "README.md").read_text()
    assert "(docs/teachers_guide.md)" in readme and "(docs/exercises.md)" in readme
    assert "(exercises.md)" in (G.GUIDE.parent / "teachers_guide.md").read_text()
