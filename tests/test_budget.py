import pytest

from course_lib import budget


def test_pick_follows_the_environment(monkeypatch):
    monkeypatch.setenv("COURSE_BUDGET", "smoke")
    assert budget.pick(full=100, smoke=3) == 3 and budget.is_smoke()
    monkeypatch.setenv("COURSE_BUDGET", "full")
    assert budget.pick(full=100, smoke=3) == 100
    monkeypatch.delenv("COURSE_BUDGET")
    assert budget.budget() == "full"  # a learner gets the full size


def test_an_unknown_budget_says_what_to_use(monkeypatch):
    monkeypatch.setenv("COURSE_BUDGET", "tiny")
    with pytest.raises(ValueError) as e:
        budget.pick(1, 2)
    assert "COURSE_BUDGET='tiny' is not a budget" in str(e.value)
    assert all(f"{name} (" in str(e.value) for name in budget.BUDGETS) and "unset it" in str(e.value)
    monkeypatch.setenv("COURSE_BUDGET", " Smoke ")  # case and spaces aside
    assert budget.is_smoke()


def test_the_budget_line_says_how_to_get_the_other_budget(monkeypatch):
    from course_lib import budget

    monkeypatch.setenv("COURSE_BUDGET", "smoke")
    assert budget.describe().startswith("smoke") and "unset COURSE_BUDGET" in budget.describe()
    monkeypatch.delenv("COURSE_BUDGET")
    assert budget.describe().startswith("full") and "COURSE_BUDGET=smoke" in budget.describe()
