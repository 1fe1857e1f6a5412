import pytest

from planner.validate import ScheduleError, validate


def test_valid_schedule_passes() -> None:
    validate({0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]}, 2, 2)


def test_backward_before_forward_is_rejected_with_grid() -> None:
    with pytest.raises(ScheduleError, match="backward 1B0 before its forward 1F0") as exc:
        validate({0: ["0F0", "0B0"], 1: ["1B0", "1F0"]})
    msg = str(exc.value)
    assert "rank 0" in msg and "rank 1" in msg
    assert ">1B0<" in msg  # the failing step is marked


def test_receive_nobody_sends_is_rejected() -> None:
    with pytest.raises(ScheduleError, match="waits for 0F1, which no rank runs"):
        validate({0: ["0F0", "0B0"], 1: ["1F0", "1B0", "1F1", "1B1"]})


def test_deadlock_cycle_is_rejected() -> None:
    # rank 0 wants 0B0 (needs 1B0) before 0F1; rank 1 wants 1F1 (needs 0F1) before 1B0
    sched = {0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F0", "1F1", "1B0", "1B1"]}
    with pytest.raises(ScheduleError, match="deadlock") as exc:
        validate(sched)
    assert ">0B0<" in str(exc.value) and ">1F1<" in str(exc.value)


def test_missing_and_duplicate_actions() -> None:
    with pytest.raises(ScheduleError, match="0F1 is never run"):
        validate({0: ["0F0", "0B0"], 1: ["1F0", "1B0"]}, 2, 2)
    with pytest.raises(ScheduleError, match="scheduled twice"):
        validate({0: ["0F0", "0B0"], 1: ["0F0", "0B0"]})


def test_skip_dependency_is_checked() -> None:
    # stage 2 also consumes stage 0: its backward must reach stage 0 too
    sched = {0: ["0F0", "0B0"], 1: ["1F0", "1B0"], 2: ["2F0", "2B0"]}
    validate(sched, deps=[(0, 1), (1, 2), (0, 2)])
    with pytest.raises(ScheduleError, match="waits for 0F0"):
        validate({1: ["1F0", "1B0"], 2: ["2F0", "2B0"]}, deps=[(0, 1), (1, 2), (0, 2)])
