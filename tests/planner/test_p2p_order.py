"""The static NCCL point-to-point order check (planner.p2p_order) over every schedule and plan
shape the planner emits, and on plans whose order is broken on purpose."""

from __future__ import annotations

import pytest
from helpers import chain_profile, cluster

from planner.actions import Action
from planner.formats import PlanOptions
from planner.p2p_order import P2PError, check_plan, check_programs, check_schedule, rank_programs
from planner.schedules import generate
from planner.solve import make_plan
from planner.validate import validate


def _devices(replicas: list[int]) -> list[list[int]]:
    out, r = [], 0
    for k in replicas:
        out.append(list(range(r, r + k)))
        r += k
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize("S", range(2, 9))
def test_chains_pass(schedule, S):
    devs = _devices([1] * S)
    for m in (1, 2, S - 1, S, 2 * S + 1):
        check_schedule(generate(schedule, devs, m), devs)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize("replicas", [[2, 1], [1, 2], [2, 2], [3, 1, 2], [1, 3, 2, 1], [2, 3], [4]])
def test_replicated_stages_pass(schedule, replicas):
    devs = _devices(replicas)
    for m in (1, 2, 5, 6, 12):
        check_schedule(generate(schedule, devs, m), devs)


def _unet_pairs(S: int) -> list[tuple[int, int]]:
    """A U-Net's stage pairs: the chain plus skips from stage s to stage S-1-s."""
    return [(s - 1, s) for s in range(1, S)] + [(s, S - 1 - s) for s in range(S // 2) if S - 1 - s > s + 1]


@pytest.mark.parametrize("S", range(2, 9))
def test_dag_gpipe_passes(S):
    devs = _devices([1] * S)
    for m in (1, 3, 8):
        check_schedule(generate("gpipe", devs, m), devs, _unet_pairs(S))


def test_dag_1f1b_with_a_skip_over_one_stage_passes():
    devs = _devices([1, 1, 1])
    for m in (1, 3, 8):
        check_schedule(generate("1f1b", devs, m), devs, [(0, 1), (1, 2), (0, 2)])


@pytest.mark.parametrize("S", range(4, 9))
def test_dag_1f1b_with_long_skips_needs_buffered_sends(S):
    # 1F1B runs stage 0 S-1 microbatches ahead of stage S-1: stage 0 sends the skip tensor of
    # microbatch 2 before it can take the gradient of microbatch 0, and stage S-1 sends that
    # gradient before it takes microbatch 2. gloo buffers the send; under NCCL's rendezvous in
    # order this is a real deadlock, so the check must refuse it (and the runtime does on NCCL).
    devs = _devices([1] * S)
    validate(generate("1f1b", devs, 8), S, 8, _unet_pairs(S))  # a valid schedule ...
    with pytest.raises(P2PError, match="deadlocks under NCCL"):  # ... that NCCL cannot run
        check_schedule(generate("1f1b", devs, 8), devs, _unet_pairs(S))


def test_reordered_plan_fails_with_the_pair_named():
    devs = _devices([1, 1])
    sched = generate("gpipe", devs, 2)
    sched[1] = [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)]
    validate(sched, 2, 2)  # dependencies are fine: only the order of the messages differs
    with pytest.raises(P2PError, match=r"rank 0 and rank 1 post their messages in different orders.*"
                                       r"microbatch 0.*microbatch 1"):
        check_schedule(sched, devs)


def test_reordered_backwards_on_a_middle_stage_fail():
    devs = _devices([1, 1, 1])
    sched = generate("1f1b", devs, 4)
    acts = sched[1]
    i, k = acts.index(Action(1, "B", 1)), acts.index(Action(1, "B", 2))
    acts[i], acts[k] = acts[k], acts[i]
    validate(sched, 3, 4)
    with pytest.raises(P2PError):
        check_schedule(sched, devs)


def test_swapped_replica_order_fails():
    # stage 0 replicated twice: replica 0 runs microbatches 0, 2; swapping them breaks the order
    # with stage 1, which receives 0 before 2
    devs = _devices([2, 1])
    sched = generate("gpipe", devs, 4)
    sched[0] = [Action(0, "F", 2), Action(0, "F", 0), Action(0, "B", 0), Action(0, "B", 2)]
    validate(sched, 2, 4)
    with pytest.raises(P2PError):
        check_schedule(sched, devs)


def test_programs_issue_sends_with_the_next_receives():
    devs = _devices([1, 1])
    progs = rank_programs(generate("1f1b", devs, 2), devs, [(0, 1)])
    # stage 0: F0 F1 B0 B1; after F1 it sends microbatch 1 and posts the receive of B0's gradient
    issue = [st for st in progs[0] if st.what == "issue"]
    assert [(op.send, op.msg.kind, op.msg.mb) for op in issue[1].ops] == [(True, "act", 1), (False, "grad", 0)]
    # rank 1 (last stage) sends its loss to rank 0 at the end; rank 0 receives it
    assert progs[1][-1].ops[0].msg.kind == "loss" and progs[0][-1].ops[0].msg.kind == "loss"


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_plans_the_planner_emits_pass(schedule):
    # real plans: a chain on 2..8 stages and replicated stages, from the planner itself
    for S in range(2, 9):
        profile = chain_profile([1.0] * 8)
        options = PlanOptions(global_batch=16, microbatch_size=2, schedule=schedule, method="manual",
                              split=[8 // S + (1 if i < 8 % S else 0) for i in range(S)], optimizer="sgd")
        check_plan(make_plan(profile, cluster(per_node=S), options))
    profile = chain_profile([1.0] * 6, skips=[(0, 5)])  # stage 0 -> stage 2
    options = PlanOptions(global_batch=24, microbatch_size=2, schedule=schedule, method="manual",
                          split=[2, 2, 2], replicas=[2, 1, 3], optimizer="sgd")
    check_plan(make_plan(profile, cluster(per_node=6), options))
    check_plan(make_plan(profile, cluster(per_node=8), PlanOptions(
        global_batch=16, microbatch_size=2, schedule=schedule, method="blocks", optimizer="sgd")))


@pytest.mark.parametrize("S", range(2, 9))
def test_weight_gradient_actions_communicate_nothing(S):
    # zero-bubble schedules split B into B (input gradient, sent back) and W (weight gradient,
    # local): W adds no message, so a 1F1B order with a W after each B stays matched
    devs = _devices([1] * S)
    sched = {r: [x for a in acts for x in ([a, Action(a.stage, "W", a.mb)] if a.kind == "B" else [a])]  # type: ignore[arg-type]
             for r, acts in generate("1f1b", devs, 2 * S).items()}
    check_schedule(sched, devs)
    progs = rank_programs(sched, devs, [(s - 1, s) for s in range(1, S)])
    plain = rank_programs(generate("1f1b", devs, 2 * S), devs, [(s - 1, s) for s in range(1, S)])
    ops = lambda p: [op for st in p if st.what == "issue" for op in st.ops]  # noqa: E731
    assert all(ops(progs[r]) == ops(plain[r]) for r in progs)


def _with_tp(profile, degrees):
    """Every layer also profiled at each TP degree (shard: half the time, 1/t of the bytes)."""
    data = profile.model_dump()
    for layer in data["layers"]:
        layer["tp"] = [dict(degree=t, fwd_ms=layer["fwd_ms"] / 2, bwd_ms=layer["bwd_ms"] / 2,
                            param_bytes=layer["param_bytes"] // t,
                            activation_bytes=layer["activation_bytes"] // t,
                            allreduce_bytes_fwd=1000, allreduce_bytes_bwd=1000,
                            allreduces_fwd=1, allreduces_bwd=1) for t in degrees]
    return type(profile).model_validate(data)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_tensor_parallel_plans_pass(schedule):
    """TP stages next to TP stages of another degree and plain ones, with replicas (and with
    GPipe a skip over a stage; 1F1B's long skips need buffered sends, see above): every TP
    rank's sends meet their receives (runtime.executor's routing)."""
    profile = _with_tp(chain_profile([1.0] * 6, skips=[(0, 5)] if schedule == "gpipe" else []), [2, 4])
    for split, replicas, tp in [([3, 3], [1, 1], [2, 1]), ([3, 3], [1, 1], [1, 2]),
                                ([2, 2, 2], [1, 2, 1], [2, 1, 4]), ([2, 2, 2], [2, 1, 1], [2, 4, 2]),
                                ([6], [2], [2])]:
        options = PlanOptions(global_batch=16, microbatch_size=2, schedule=schedule, method="manual",
                              split=split, replicas=replicas, tp=tp, optimizer="sgd")
        check_plan(make_plan(profile, cluster(per_node=4, nodes=4), options))


def test_a_tp_rank_receiving_from_the_wrong_peer_fails():
    # stage 0 TP 2 -> stage 1 TP 1: only TP rank 0 of stage 0 sends to stage 1; if rank 1 of
    # stage 0 also expected a gradient, nothing would ever send it
    devs = [[0, 1], [2]]
    sched = generate("1f1b", [[0], [2]], 2)
    sched = {0: sched[0], 1: sched[0], 2: sched[2]}
    check_programs(rank_programs(sched, devs, [(0, 1)], tps=[2, 1]))
    with pytest.raises(P2PError):
        check_programs(rank_programs(sched, devs, [(0, 1)], tps=[1, 1]))
