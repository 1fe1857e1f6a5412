"""A plan whose layers are the model's, but not in its order or number, names the first
difference (it said only "in a different order or number")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from planner.errors import PipeplanError
from runtime.stages import check_layers


def _plan(*stages: list[str]) -> SimpleNamespace:
    return SimpleNamespace(stages=[SimpleNamespace(layers=s) for s in stages])


@pytest.mark.parametrize(("stages", "message"), [
    ((["a", "c"], ["b", "d"]), "its layer 1 is 'c' where the model's is 'b'"),
    ((["a", "b"], ["c"]), "it lacks the model's layer 'd'"),
    ((["a", "b"], ["b", "c", "d"]), "it names layer 'b' twice"),
])
def test_the_first_difference_is_named(stages: tuple[list[str], ...], message: str) -> None:
    with pytest.raises(PipeplanError, match=message):
        check_layers(_plan(*stages), ["a", "b", "c", "d"], "m.py")


def test_the_model_s_own_order_passes() -> None:
    check_layers(_plan(["a", "b"], ["c", "d"]), ["a", "b", "c", "d"], "m.py")


def test_the_error_says_what_to_do_for_a_hand_edited_plan_too() -> None:
    """A plan edited by hand (a layer dropped) was told to profile the model again: the model had
    not changed (an outside review)."""
    with pytest.raises(PipeplanError, match=r"if the plan was edited by hand, make it again with plan "
                                            r"--method manual --split"):
        check_layers(_plan(["a", "b"], ["c"]), ["a", "b", "c", "d"], "m.py")
