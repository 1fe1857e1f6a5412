"""The CP-SAT planner against independent references: brute force over every plan (simulated
by the core), every baseline, PipeDream's DP under its own objective, hand-checkable mixed
clusters, and its own reports (status, bound, determinism, errors)."""

from __future__ import annotations

import random

import pytest

from planner.build import evaluate
from planner.cost import layer_table
from planner.cpsat import solve, solve_detailed
from planner.cpsat.bounds import dp_excludes_below, dp_lower_bound, model_value_ms
from planner.cpsat.instance import build_instance
from planner.errors import PipeplanError
from planner.formats import Cluster, PlanOptions, Profile
from planner.pipedream import solve_pipedream
from planner.solve import METHODS, make_plan
from tests.planner.cpsat_reference import brute_force, brute_force_throughput

REL = 1e-6


def random_profile(rng: random.Random, num_layers: int, dag: bool) -> Profile:
    layers = [dict(name=f"l{i}", fwd_ms=rng.uniform(0.2, 3), bwd_ms=rng.uniform(0.4, 6),
                   param_bytes=int(rng.uniform(1e5, 3e8)),
                   activation_bytes=int(rng.uniform(1e6, 4e8)),
                   output_bytes=int(rng.uniform(1e5, 5e7))) for i in range(num_layers)]
    edges = []
    for i in range(1, num_layers):
        edges.append(dict(src=f"l{i - 1}", dst=f"l{i}", bytes=layers[i - 1]["output_bytes"]))
        if dag and i >= 2 and rng.random() < 0.4:
            k = rng.randrange(0, i - 1)
            edges.append(dict(src=f"l{k}", dst=f"l{i}", bytes=layers[k]["output_bytes"]))
    return Profile(model=dict(path="random", sha256="0"), device=dict(type="cpu", name="x"),
                   batch_size=8, layers=layers, edges=edges)


def random_cluster(rng: random.Random, mixed: bool) -> Cluster:
    bw = dict(intra_node_gb_per_s=rng.choice([50, 300]), inter_node_gb_per_s=rng.choice([1, 5, 25]),
              latency_us=rng.choice([0, 5]))
    if mixed:
        return Cluster(nodes=[
            dict(name="fast", devices=rng.randint(1, 3), device_memory_gb=rng.choice([2, 4, 8]),
                 speed=1.0),
            dict(name="slow", devices=rng.randint(1, 3), device_memory_gb=rng.choice([2, 8, 16]),
                 speed=0.5)], **bw)
    return Cluster(nodes=rng.randint(1, 2), devices_per_node=rng.randint(1, 3),
                   device_memory_gb=rng.choice([2, 4, 8, 40]), **bw)


def random_instance(seed: int) -> tuple[Profile, Cluster, PlanOptions]:
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(2, 6), dag=rng.random() < 0.5)
    cluster = random_cluster(rng, mixed=rng.random() < 0.4)
    options = PlanOptions(global_batch=rng.choice([8, 16, 32]), microbatch_size=rng.choice([2, 4, 8]),
                          optimizer=rng.choice(["sgd", "adam"]), time_limit_s=60)
    return profile, cluster, options


def assert_close(a: float, b: float, rel: float = REL) -> None:
    assert a == pytest.approx(b, rel=rel), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("block", range(10))
def test_equals_brute_force_on_random_instances(block: int) -> None:
    """250 random instances (chain and DAG, one or two nodes, uniform and mixed speed/memory,
    memory often binding): CP-SAT's plan simulates exactly as fast as the best of every plan."""
    for seed in range(block * 25, (block + 1) * 25):
        profile, cluster, options = random_instance(seed)
        ref = brute_force(profile, cluster, options, [options.microbatch_size])
        if ref.candidate is None:
            with pytest.raises(PipeplanError):
                solve(profile, cluster, options)
            continue
        cand = solve(profile, cluster, options)
        ev = evaluate(layer_table(profile), cluster, cand, options)
        assert ev.fits, seed
        assert_close(ev.iteration_ms, ref.iteration_ms)
        assert cand.solver["status"] == "OPTIMAL", seed
        assert_close(cand.solver["objective"], ev.iteration_ms)  # the reported objective is the simulator's
        assert cand.solver["bound"] <= ev.iteration_ms * (1 + REL)


def test_gpipe_schedule_equals_brute_force() -> None:
    for seed in range(500, 520):
        profile, cluster, options = random_instance(seed)
        options = options.model_copy(update={"schedule": "gpipe"})
        ref = brute_force(profile, cluster, options, [options.microbatch_size])
        if ref.candidate is None:
            continue
        cand = solve(profile, cluster, options)
        assert cand.solver["status"] == "OPTIMAL", seed
        assert_close(cand.solver["objective"], ref.iteration_ms)


def test_never_worse_than_any_baseline() -> None:
    for seed in range(200, 215):
        profile, cluster, options = random_instance(seed)
        table = layer_table(profile)
        try:
            cand = solve(profile, cluster, options)
        except PipeplanError:
            continue
        ours = evaluate(table, cluster, cand, options).iteration_ms
        for name in ("pipedream", "blocks", "params", "uniform"):
            try:
                base = METHODS[name](profile, cluster, options.model_copy(update={"method": name}))
            except PipeplanError:
                continue
            ev = evaluate(table, cluster, base, options)
            if ev.fits:
                assert ours <= ev.iteration_ms * (1 + REL), (seed, name)


def test_model_value_is_a_lower_bound_of_the_simulated_time() -> None:
    """The model prices any plan no higher than the simulator (what makes the verified search
    exact), and exactly on a balanced pipeline."""
    from planner.partition import Candidate, StageChoice
    from tests.planner.cpsat_reference import _placements, splits

    rng = random.Random(7)
    checked = 0
    for seed in range(300, 315):
        profile, cluster, options = random_instance(seed)
        table = layer_table(profile)
        inst = build_instance(table, cluster, options, options.microbatch_size)
        ranks = {}
        for d in cluster.devices():
            ranks.setdefault(d.node, []).append(d.rank)
        for bounds in rng.sample(list(splits(table.num_layers)), k=min(3, 2 ** (table.num_layers - 1))):
            S = len(bounds) - 1
            places = list(_placements(S, [s.devices for s in cluster.node_specs()]))
            if not places:
                continue
            vec = rng.choice(places)
            used = [0] * len(ranks)
            stages = []
            for s, v in enumerate(vec):
                rk: list[int] = []
                for n, k in enumerate(v):
                    rk += ranks[n][used[n]:used[n] + k]
                    used[n] += k
                stages.append(StageChoice(bounds[s], bounds[s + 1], tuple(rk)))
            cand = Candidate(tuple(stages), options.microbatch_size,
                             options.global_batch // options.microbatch_size)
            ev = evaluate(table, cluster, cand, options)
            value = model_value_ms(inst, cand, cluster.devices())
            if not ev.fits or value is None:
                continue
            checked += 1
            assert value <= ev.iteration_ms * (1 + 1e-5)
    assert checked >= 10


def test_balanced_pipeline_model_value_is_exact() -> None:
    layers = [dict(name=f"l{i}", fwd_ms=1.0, bwd_ms=2.0, param_bytes=1000, activation_bytes=1000,
                   output_bytes=1000) for i in range(4)]
    profile = Profile(model=dict(path="x", sha256="0"), device=dict(type="cpu", name="x"),
                      batch_size=1, layers=layers)
    cluster = Cluster(nodes=1, devices_per_node=4, device_memory_gb=1, intra_node_gb_per_s=1e6,
                      inter_node_gb_per_s=1e6)
    options = PlanOptions(global_batch=8, microbatch_size=1)
    cand = solve(profile, cluster, options)
    # four equal stages, free communication: (m + S - 1)(F + B) = 11 * 3, or pure data
    # parallelism (8 / 4) * 4 * 3 = 24 with negligible all-reduce: the latter wins
    assert cand.solver["objective"] == pytest.approx(24.0, rel=1e-3)
    assert cand.solver["model_objective"] == pytest.approx(cand.solver["objective"], rel=1e-2)


def test_mixed_cluster_gives_slow_devices_less_work_and_matches_brute_force() -> None:
    layers = [dict(name=f"l{i}", fwd_ms=1.0, bwd_ms=2.0, param_bytes=10**6, activation_bytes=10**6,
                   output_bytes=10**5) for i in range(9)]
    profile = Profile(model=dict(path="x", sha256="0"), device=dict(type="cpu", name="x"),
                      batch_size=4, layers=layers)
    cluster = Cluster(nodes=[dict(name="fast", devices=1, device_memory_gb=4, speed=1.0),
                             dict(name="slow", devices=1, device_memory_gb=8, speed=0.5)],
                      intra_node_gb_per_s=100, inter_node_gb_per_s=100)
    options = PlanOptions(global_batch=32, microbatch_size=4)
    cand = solve(profile, cluster, options)
    ref = brute_force(profile, cluster, options, [4])
    assert_close(cand.solver["objective"], ref.iteration_ms)
    devices = cluster.devices()
    work = {devices[s.devices[0]].speed: s.stop - s.start for s in cand.stages}
    assert set(work) == {1.0, 0.5}
    assert work[0.5] < work[1.0]  # 3 layers on the slow device, 6 on the fast one
    assert work == {1.0: 6, 0.5: 3}


@pytest.mark.parametrize("seed", range(12))
def test_throughput_objective_equals_pipedream_dp(seed: int) -> None:
    """PipeDream's assumptions: a chain, one level of bandwidth (one node, or one device per
    node), memory not binding. Then the slowest-stage optimum equals PipeDream's DP (and a
    brute force over splits and replica vectors)."""
    rng = random.Random(1000 + seed)
    profile = random_profile(rng, rng.randint(2, 6), dag=False)
    one_node = seed % 2 == 0
    cluster = Cluster(nodes=1 if one_node else rng.randint(2, 5),
                      devices_per_node=rng.randint(2, 5) if one_node else 1, device_memory_gb=1000,
                      intra_node_gb_per_s=rng.choice([10, 100]), inter_node_gb_per_s=rng.choice([1, 10]))
    options = PlanOptions(global_batch=32, microbatch_size=4, objective="throughput")
    cand = solve(profile, cluster, options)
    dp = solve_pipedream(profile, cluster, options, 4)
    ref = brute_force_throughput(profile, cluster, options, 4)
    assert_close(cand.solver["objective"], ref)
    assert_close(cand.solver["objective"], dp.solver["objective"])


def test_microbatch_size_is_chosen_among_the_allowed_ones() -> None:
    profile, cluster, _ = random_instance(5)
    options = PlanOptions(global_batch=16, microbatch_sizes=[2, 4, 8], time_limit_s=60)
    cand = solve(profile, cluster, options)
    ref = brute_force(profile, cluster, options, [2, 4, 8])
    assert_close(cand.solver["objective"], ref.iteration_ms)
    assert cand.microbatch_size == ref.candidate.microbatch_size or \
        cand.solver["objective"] == pytest.approx(ref.iteration_ms, rel=REL)
    assert cand.microbatch_size * cand.num_microbatches == 16


def test_powers_of_two_replicas() -> None:
    profile, cluster, options = random_instance(11)
    options = options.model_copy(update={"powers_of_two": True})
    cand = solve(profile, cluster, options)
    assert all(s.replicas & (s.replicas - 1) == 0 for s in cand.stages)
    free = solve(profile, cluster, options.model_copy(update={"powers_of_two": False}))
    assert free.solver["objective"] <= cand.solver["objective"] * (1 + REL)


def test_reproducible() -> None:
    profile, cluster, options = random_instance(13)
    a, b = solve(profile, cluster, options), solve(profile, cluster, options)
    assert a.stages == b.stages and a.solver["objective"] == b.solver["objective"]


def test_make_plan_dispatches_and_predicts_the_simulated_time() -> None:
    profile, cluster, options = random_instance(3)
    plan = make_plan(profile, cluster, options.model_copy(update={"method": "cpsat"}))
    assert plan.solver.name == "cpsat"
    assert plan.solver.status == "OPTIMAL"
    assert_close(plan.solver.objective, plan.predicted.iteration_ms)
    assert plan.solver.gap is not None and plan.solver.gap <= 1e-5


def test_falls_back_to_the_best_baseline_at_a_tiny_time_limit() -> None:
    profile, cluster, options = random_instance(21)
    options = options.model_copy(update={"time_limit_s": 1e-6})
    cand = solve(profile, cluster, options)
    assert cand.solver["status"] in ("FALLBACK", "FEASIBLE", "OPTIMAL")
    assert cand.solver["objective"] == pytest.approx(
        evaluate(layer_table(profile), cluster, cand, options).iteration_ms, rel=REL)


def test_infeasible_names_the_layer_and_what_would_fit() -> None:
    layers = [dict(name="small", fwd_ms=1, bwd_ms=1, param_bytes=10**6, activation_bytes=10**6,
                   output_bytes=10),
              dict(name="huge", fwd_ms=1, bwd_ms=1, param_bytes=10**6, activation_bytes=5 * 10**9,
                   output_bytes=10)]
    profile = Profile(model=dict(path="x", sha256="0"), device=dict(type="cpu", name="x"),
                      batch_size=8, layers=layers)
    cluster = Cluster(nodes=1, devices_per_node=2, device_memory_gb=2, intra_node_gb_per_s=10,
                      inter_node_gb_per_s=1)
    with pytest.raises(PipeplanError) as err:
        solve(profile, cluster, PlanOptions(global_batch=8, microbatch_size=8))
    msg = str(err.value)
    assert "huge" in msg and "GB" in msg and "smaller microbatch" in msg


def test_infeasible_too_few_devices_says_how_many_stages() -> None:
    layers = [dict(name=f"l{i}", fwd_ms=1, bwd_ms=1, param_bytes=3 * 10**8, activation_bytes=10**6,
                   output_bytes=10) for i in range(6)]
    profile = Profile(model=dict(path="x", sha256="0"), device=dict(type="cpu", name="x"),
                      batch_size=8, layers=layers)
    cluster = Cluster(nodes=1, devices_per_node=2, device_memory_gb=2, intra_node_gb_per_s=10,
                      inter_node_gb_per_s=1)
    with pytest.raises(PipeplanError) as err:
        solve(profile, cluster, PlanOptions(global_batch=8, microbatch_size=8, optimizer="adam"))
    assert "more devices" in str(err.value) and "stage" in str(err.value)


@pytest.mark.parametrize("field", ["intra_node_gb_per_s", "inter_node_gb_per_s"])
def test_absurdly_small_bandwidth_is_a_user_error_naming_the_field(field: str) -> None:
    profile, _, options = random_instance(3)
    bw = {"intra_node_gb_per_s": 300.0, "inter_node_gb_per_s": 25.0, field: 5e-324}
    cluster = Cluster(nodes=2, devices_per_node=2, device_memory_gb=40, **bw)
    with pytest.raises(PipeplanError) as err:
        solve(profile, cluster, options)
    assert field in str(err.value) and "GB/s" in str(err.value)


def test_tiny_but_sane_bandwidth_keeps_every_transfer_off_the_slow_links() -> None:
    profile, _, options = random_instance(3)
    cluster = Cluster(nodes=2, devices_per_node=2, device_memory_gb=40, intra_node_gb_per_s=300,
                      inter_node_gb_per_s=1e-12)
    cand = solve(profile, cluster, options)
    ev = evaluate(layer_table(profile), cluster, cand, options)
    assert cand.solver["objective"] == pytest.approx(ev.iteration_ms, rel=REL)
    nodes = {d // 2 for s in cand.stages for d in s.devices}
    assert len(nodes) == 1  # a byte between nodes would take hours


def test_dp_bound_never_exceeds_the_optimum() -> None:
    for seed in range(400, 412):
        profile, cluster, options = random_instance(seed)
        ref = brute_force(profile, cluster, options, [options.microbatch_size])
        if ref.candidate is None:
            continue
        dpb = dp_lower_bound(layer_table(profile), cluster, options, options.microbatch_size,
                             ref.iteration_ms * 2)
        assert dpb is not None and dpb.bound_ms <= ref.iteration_ms * (1 + REL)


def test_dp_never_excludes_the_optimum_and_proves_some() -> None:
    proven = 0
    for seed in range(430, 450):
        profile, cluster, options = random_instance(seed)
        ref = brute_force(profile, cluster, options, [options.microbatch_size])
        if ref.candidate is None:
            continue
        table, b = layer_table(profile), options.microbatch_size
        assert not dp_excludes_below(table, cluster, options, b, ref.iteration_ms * (1 + 1e-9))
        proven += dp_excludes_below(table, cluster, options, b, ref.iteration_ms * (1 - 1e-9))
    assert proven >= 1


def test_solve_detailed_reports_each_microbatch_size() -> None:
    profile, cluster, _ = random_instance(8)
    options = PlanOptions(global_batch=16, microbatch_sizes=[4, 8])
    _, results = solve_detailed(profile, cluster, options)
    assert len(results) == 2


def test_enumeration_proof_equals_brute_force() -> None:
    """Where placement cannot matter (one node, or nodes of one device), simulating every plan
    the per-stage bounds cannot exclude finds the optimum from any incumbent."""
    from planner.cpsat.proof import placement_free, prove

    checked = 0
    for seed in range(600, 660):
        profile, cluster, options = random_instance(seed)
        if not placement_free(cluster):
            continue
        ref = brute_force(profile, cluster, options, [options.microbatch_size])
        if ref.candidate is None:
            continue
        table = layer_table(profile)
        start = METHODS["uniform"](profile, cluster, options.model_copy(update={"method": "uniform"}))
        ev = evaluate(table, cluster, start, options)
        start_ms = ev.iteration_ms if ev.fits else ref.iteration_ms * 10
        if not ev.fits:
            start = ref.candidate  # any plan will do as the incumbent
            start_ms = ref.iteration_ms
        res = prove(table, cluster, options, start, start_ms, float("inf"))
        assert res is not None and res.proven
        assert_close(min(res.iteration_ms, start_ms), ref.iteration_ms)
        checked += 1
    assert checked >= 10
