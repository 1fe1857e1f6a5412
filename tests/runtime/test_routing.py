"""Routing: every tensor goes straight from the stage that produces it to each stage that reads it."""

from __future__ import annotations

import pytest

from planner.errors import PipeplanError
from runtime.stages import Routing, complete_aliases, cross_stage_ties


def test_skip_connection_goes_straight_to_the_non_adjacent_stage():
    # stage 0 makes a (used by 1) and skip (used by 2); stage 1 makes b; stage 2 the output
    r = Routing.from_keys(
        input_keys=[["<input>:0"], ["a"], ["b", "skip", "<input>:0"]],
        output_keys=[["a", "skip"], ["b"], ["<output>"]],
    )
    assert r.sends(0) == [("a", [1]), ("skip", [2])]
    assert r.sends(1) == [("b", [2])]
    assert r.recvs(2) == [("b", 1), ("skip", 0)]  # model inputs are loaded locally
    assert r.sends(2) == []


def test_a_tensor_read_by_two_later_stages_is_sent_to_both():
    r = Routing.from_keys([["<input>:0"], ["x"], ["x", "y"]], [["x"], ["y"], ["<output>"]])
    assert r.sends(0) == [("x", [1, 2])]


def test_a_stage_reading_what_nobody_produces_is_a_clear_error():
    with pytest.raises(PipeplanError, match="no earlier stage produces"):
        Routing.from_keys([["<input>:0"], ["ghost"]], [["a"], ["<output>"]])


def test_tied_parameters_held_by_two_stages():
    ties = [["emb.weight", "head.weight"], ["blocks.0.w", "blocks.0.w_alias"]]
    stage_names = [{"emb.weight", "blocks.0.w", "blocks.0.w_alias"}, {"x"}, {"head.weight"}]
    assert cross_stage_ties(ties, stage_names) == [(["emb.weight", "head.weight"], [0, 2])]
    full = complete_aliases({"emb.weight": 1, "other": 2}, ties)
    assert full == {"emb.weight": 1, "head.weight": 1, "other": 2}
