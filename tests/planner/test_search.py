"""The planner's search (method `cpsat`) against brute force over every plan of small instances
(`cpsat_reference.py`, judged by the core's `evaluate()`), the baselines, and its own promises:
a bound that no plan beats, the same plan for the same input, no device for a stage that
computes nothing, clear errors when nothing fits."""

from __future__ import annotations

import random

import pytest

from planner.build import evaluate
from planner.cost import layer_table
from planner.errors import PipeplanError
from planner.formats import Cluster, PlanOptions, Profile
from planner.search import solve
from planner.solve import METHODS, make_plan
from tests.planner.cpsat_reference import brute_force

REL = 1e-9


def random_profile(rng: random.Random, num_layers: int, dag: bool) -> Profile:
    layers = [dict(name=f"l{i}", fwd_ms=rng.uniform(0.2, 3), bwd_ms=rng.uniform(0.4, 6),
                   param_bytes=int(rng.uniform(1e5, 3e8)),
                   activation_bytes=int(rng.uniform(1e6, 4e8)),
                   output_bytes=int(rng.uniform(1e5, 5e7))) for i in range(num_layers)]
    for x in layers:  # an optimizer step per iteration, from the parameters (no draw: the
        # instances stay those of earlier rounds); adam ~1 ms per 100 MB, as on a GPU
        x["optimizer_ms"] = {"sgd": x["param_bytes"] / 3e8, "momentum": x["param_bytes"] / 2e8,
                             "adam": x["param_bytes"] / 1e8}
    edges = []
    for i in range(1, num_layers):
        edges.append(dict(src=f"l{i - 1}", dst=f"l{i}", bytes=layers[i - 1]["output_bytes"]))
        if dag and i >= 2 and rng.random() < 0.4:
            k = rng.randrange(0, i - 1)
            edges.append(dict(src=f"l{k}", dst=f"l{i}", bytes=layers[k]["output_bytes"]))
    return Profile(model=dict(path="random", sha256="0"), device=dict(type="cpu", name="x"),
                   batch_size=8, layers=layers, edges=edges)


def random_cluster(rng: random.Random, mixed: bool, max_nodes: int = 2) -> Cluster:
    # slow links (communication dominates) as well as fast ones (compute dominates)
    bw = dict(intra_node_gb_per_s=rng.choice([0.5, 50, 300]),
              inter_node_gb_per_s=rng.choice([0.1, 1, 5, 25]), latency_us=rng.choice([0, 5]))
    if mixed:
        return Cluster(nodes=[
            dict(name="fast", devices=rng.randint(1, 3), device_memory_gb=rng.choice([2, 4, 8]),
                 speed=1.0),
            dict(name="slow", devices=rng.randint(1, 3), device_memory_gb=rng.choice([2, 8, 16]),
                 speed=0.5)], **bw)
    return Cluster(nodes=rng.randint(1, max_nodes), devices_per_node=rng.randint(1, 3),
                   device_memory_gb=rng.choice([1, 2, 4, 8, 40]), **bw)


def random_instance(seed: int, mixed: bool | None = None, max_nodes: int = 2
                    ) -> tuple[Profile, Cluster, PlanOptions]:
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(2, 7), dag=rng.random() < 0.5)
    cluster = random_cluster(rng, mixed=rng.random() < 0.4 if mixed is None else mixed,
                             max_nodes=max_nodes)
    options = PlanOptions(global_batch=rng.choice([8, 16, 32]), microbatch_size=rng.choice([2, 4, 8]),
                          optimizer=rng.choice(["sgd", "adam"]), time_limit_s=2,
                          schedule=rng.choice(["1f1b", "1f1b", "gpipe"]))
    return profile, cluster, options


def _check_against_brute_force(seed: int, mixed: bool, max_nodes: int = 2
                               ) -> tuple[float | None, float | None]:
    profile, cluster, options = random_instance(seed, mixed, max_nodes)
    ref = brute_force(profile, cluster, options, [options.microbatch_size])
    try:
        cand = solve(profile, cluster, options)
    except PipeplanError:
        assert ref.candidate is None, f"seed {seed}: no plan, but {ref.iteration_ms} fits"
        return None, None
    assert ref.candidate is not None, f"seed {seed}: a plan that does not fit"
    ev = evaluate(layer_table(profile), cluster, cand, options)
    assert ev.fits and cand.solver["objective"] == pytest.approx(ev.iteration_ms, rel=REL)
    bound = float(cand.solver["bound"])  # type: ignore[arg-type]
    assert bound <= ref.iteration_ms * (1 + REL), f"seed {seed}: bound above the optimum"
    assert ev.iteration_ms >= ref.iteration_ms * (1 - REL)
    return ev.iteration_ms, ref.iteration_ms


@pytest.mark.slow
@pytest.mark.parametrize("block", range(3))
def test_uniform_clusters_equal_brute_force(block: int) -> None:
    """Chains and DAGs, 1-2 nodes of 1-3 devices, memory from tight to generous, slow and fast
    links, 1F1B and GPipe: the plan's simulated time is the exhaustive optimum and the bound
    never exceeds it."""
    for seed in range(block * 25, block * 25 + 25):
        got, ref = _check_against_brute_force(seed, mixed=False)
        if got is not None:
            assert got == pytest.approx(ref, rel=REL), f"seed {seed}: {got} vs optimum {ref}"


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [True, False])
def test_mixed_and_three_node_clusters_near_brute_force(mixed: bool) -> None:
    """Fast and slow nodes, or three nodes: the bound holds everywhere, and the plan is the
    optimum on every instance. (Until the enumeration of every plan the bound allows, with
    every node placement, `exhaust.py`, the search missed some by up to 3.1 %, placing stages
    over the nodes in ways it did not reach from its local optima.)"""
    for seed in range(1000, 1030):
        got, ref = _check_against_brute_force(seed, mixed=mixed, max_nodes=3)
        if got is not None:
            assert got == pytest.approx(ref, rel=REL), f"seed {seed}: {got} vs optimum {ref}"


def test_microbatch_size_is_chosen_among_the_allowed_ones() -> None:
    profile, _, _ = random_instance(5, mixed=False)
    cluster = Cluster(nodes=2, devices_per_node=2, device_memory_gb=40, intra_node_gb_per_s=50,
                      inter_node_gb_per_s=1)
    options = PlanOptions(global_batch=16, microbatch_sizes=[2, 4, 8], time_limit_s=2)
    cand = solve(profile, cluster, options)
    ref = brute_force(profile, cluster, options, [2, 4, 8])
    assert cand.solver["objective"] == pytest.approx(ref.iteration_ms, rel=REL)
    assert cand.microbatch_size in (2, 4, 8) and cand.microbatch_size * cand.num_microbatches == 16


def test_never_worse_than_any_baseline() -> None:
    for seed in range(200, 212):
        profile, cluster, options = random_instance(seed)
        table = layer_table(profile)
        try:
            ours = solve(profile, cluster, options).solver["objective"]
        except PipeplanError:
            ours = None
        for name in ("pipedream", "blocks", "params", "uniform"):
            try:
                base = METHODS[name](profile, cluster, options.model_copy(update={"method": name}))
            except PipeplanError:
                continue
            ev = evaluate(table, cluster, base, options)
            if ev.fits:
                assert ours is not None and ours <= ev.iteration_ms * (1 + REL), (seed, name)


def gnmt_like(seed: int = 0) -> Profile:
    """Layers that compute nothing (reshapes, getitems) between heavy ones, big activations."""
    rng = random.Random(seed)
    layers = []
    for i in range(24):
        zero = i % 3 != 0
        layers.append(dict(name=f"l{i}", fwd_ms=0.0 if zero else rng.uniform(2, 6),
                           bwd_ms=0.0 if zero else rng.uniform(3, 9),
                           param_bytes=0 if zero else int(rng.uniform(1e7, 1e8)),
                           activation_bytes=int(6e6), output_bytes=int(6e6)))
    return Profile(model=dict(path="g", sha256="0"), device=dict(type="gpu", name="x"),
                   batch_size=64, layers=layers)


def test_no_device_for_a_stage_that_computes_nothing_and_same_plan_twice() -> None:
    profile = gnmt_like()
    cluster = Cluster(nodes=16, devices_per_node=1, device_memory_gb=16, intra_node_gb_per_s=1,
                      inter_node_gb_per_s=1)
    options = PlanOptions(global_batch=1024, microbatch_size=64, optimizer="sgd", time_limit_s=3)
    a = make_plan(profile, cluster, options)
    assert all(s.predicted.compute_ms > 0 for s in a.stages)
    b = make_plan(profile, cluster, options)
    assert [(s.layers, s.devices) for s in a.stages] == [(s.layers, s.devices) for s in b.stages]
    assert a.predicted.iteration_ms == b.predicted.iteration_ms
    assert a.solver.bound is not None and a.solver.bound <= a.predicted.iteration_ms


def test_a_slower_or_busier_machine_gives_the_same_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is work: a machine on which that work takes 5x --time-limit (slower, or
    its cores busy with other work: a clock that runs faster stands for both; a plan may spend
    MAX_WORK x the budget, so 3x --time-limit, the net until 2026-11-27, cut it) still does all
    of it and gives the same plan and bound. The wall clock stops it only at `wall_net_s`;
    at 1 x the limit (the service's WALL_LIMIT), the same clock cuts the work short (the
    test's own check that it could)."""
    import time

    import planner.search as search

    profile = gnmt_like()
    cluster = Cluster(nodes=16, devices_per_node=1, device_memory_gb=16, intra_node_gb_per_s=1,
                      inter_node_gb_per_s=1)
    options = PlanOptions(global_batch=1024, microbatch_size=64, optimizer="sgd", time_limit_s=1)
    solve(profile, cluster, options)  # imports and caches warm
    t0 = time.perf_counter()
    ref = solve(profile, cluster, options)
    factor = 5 * options.time_limit_s / (time.perf_counter() - t0)  # this machine, 5x over
    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: factor * real())
    slow = solve(profile, cluster, options)
    key = [(s.start, s.stop, s.devices) for s in ref.stages]
    assert [(s.start, s.stop, s.devices) for s in slow.stages] == key
    for field in ("objective", "bound", "work"):
        assert slow.solver[field] == ref.solver[field], field
    assert not ref.solver["clock_stopped"] and not slow.solver["clock_stopped"]
    monkeypatch.setattr(search, "WALL_LIMIT", 1.0)
    cut = solve(profile, cluster, options)
    assert cut.solver["work"] < ref.solver["work"] and cut.solver["clock_stopped"]


def test_a_proof_out_of_reach_gives_its_work_to_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the tightened bound is more than HOPELESS_GAP below the plan, `prove` (1 % below
    the plan) is not tried and its work searches on: the plan is no worse and the bound is the
    same as when it is tried."""
    import planner.search as search

    profile = gnmt_like()
    cluster = Cluster(nodes=16, devices_per_node=1, device_memory_gb=16, intra_node_gb_per_s=1,
                      inter_node_gb_per_s=1)
    options = PlanOptions(global_batch=1024, microbatch_size=64, optimizer="sgd", time_limit_s=1)
    calls: list[float] = []
    real = search.prove

    def counted(c, T, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(T)
        return real(c, T, *args, **kwargs)

    monkeypatch.setattr(search, "prove", counted)
    # (the plan's gap here is about 10 %: the threshold below it, so the proof is out of reach)
    monkeypatch.setattr(search, "HOPELESS_GAP", 0.05)
    now = solve(profile, cluster, options)
    assert now.solver["gap"] > search.HOPELESS_GAP and not calls
    monkeypatch.setattr(search, "HOPELESS_GAP", 10.0)  # always tried
    tried = solve(profile, cluster, options)
    assert calls  # the instance is one where it is tried otherwise
    assert now.solver["objective"] <= tried.solver["objective"] * (1 + REL)
    assert now.solver["bound"] == tried.solver["bound"]


def test_powers_of_two_replicas() -> None:
    profile, cluster, options = random_instance(11, mixed=False)
    cluster = Cluster(nodes=1, devices_per_node=7, device_memory_gb=40, intra_node_gb_per_s=300,
                      inter_node_gb_per_s=25)
    cand = solve(profile, cluster, options.model_copy(update={"powers_of_two": True}))
    assert all(s.replicas & (s.replicas - 1) == 0 for s in cand.stages)
    free = solve(profile, cluster, options)
    assert free.solver["objective"] <= cand.solver["objective"] * (1 + REL)


def test_powers_of_two_keep_the_plans_that_give_an_idle_layer_a_device() -> None:
    """A 0-ms layer of 1.5 GB on two fast 6-GB devices and one slow 40-GB one: the best plan
    puts it alone on the slow device (one replica a stage: powers of two). With
    `--powers-of-two` the planner skipped the step that finds such plans: 2416.7 ms against
    150.4."""
    from tests.planner.helpers import chain_profile

    n = 24
    params = [50_000_000] * n
    params[12] = 1_500_000_000
    fwd = [1.0] * n
    fwd[12] = 0.0
    profile = chain_profile(fwd, params=params, act=[50_000_000] * n, out=[1_000_000] * n)
    cluster = Cluster.model_validate({
        "nodes": [{"name": "fast", "devices": 2, "device_memory_gb": 6, "speed": 2.0},
                  {"name": "slow", "devices": 1, "device_memory_gb": 40, "speed": 0.01}],
        "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10, "latency_us": 10})
    options = PlanOptions(global_batch=64, microbatch_size=8, optimizer="momentum")
    free = solve(profile, cluster, options)
    assert all(len(st.devices) == 1 for st in free.stages) and len(free.stages) == 3
    two = solve(profile, cluster, options.model_copy(update={"powers_of_two": True}))
    assert two.solver["objective"] == pytest.approx(free.solver["objective"], rel=REL)


def test_a_plan_whenever_one_fits_tight_memory() -> None:
    """Memory so tight that only uneven replicas fit (e.g. 4, 2, 1, 1: few microbatches in
    flight per device), which no baseline tries."""
    layers = [dict(name=f"l{i}", fwd_ms=1, bwd_ms=2, param_bytes=10**7, activation_bytes=3 * 10**8,
                   output_bytes=10**6) for i in range(4)]
    profile = Profile(model=dict(path="x", sha256="0"), device=dict(type="cpu", name="x"),
                      batch_size=8, layers=layers)
    cluster = Cluster(nodes=2, devices_per_node=4, device_memory_gb=1.0, intra_node_gb_per_s=10,
                      inter_node_gb_per_s=1)
    options = PlanOptions(global_batch=64, microbatch_size=8, optimizer="sgd", time_limit_s=2)
    for name in ("uniform", "params", "blocks", "pipedream"):
        with pytest.raises(PipeplanError):
            make_plan(profile, cluster, options.model_copy(update={"method": name}))
    plan = make_plan(profile, cluster, options)
    assert plan.predicted.fits_memory
    assert all(s.predicted.memory_bytes <= s.predicted.memory_limit_bytes for s in plan.stages)


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


def test_infeasible_too_little_memory_in_total_says_so() -> None:
    layers = [dict(name=f"l{i}", fwd_ms=1, bwd_ms=1, param_bytes=3 * 10**8, activation_bytes=10**6,
                   output_bytes=10) for i in range(6)]
    profile = Profile(model=dict(path="x", sha256="0"), device=dict(type="cpu", name="x"),
                      batch_size=8, layers=layers)
    cluster = Cluster(nodes=1, devices_per_node=2, device_memory_gb=2, intra_node_gb_per_s=10,
                      inter_node_gb_per_s=1)
    with pytest.raises(PipeplanError) as err:
        solve(profile, cluster, PlanOptions(global_batch=8, microbatch_size=8, optimizer="adam"))
    msg = str(err.value)
    assert "more devices" in msg and "no plan can fit" in msg


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
    nodes = {d // 2 for s in cand.stages for d in s.devices}
    assert len(nodes) == 1  # a byte between nodes would take hours


def test_tiny_time_limit_still_returns_the_best_seed() -> None:
    profile, cluster, options = random_instance(21, mixed=False)
    cand = solve(profile, cluster, options.model_copy(update={"time_limit_s": 1e-6}))
    ev = evaluate(layer_table(profile), cluster, cand, options)
    assert cand.solver["objective"] == pytest.approx(ev.iteration_ms, rel=REL)


def test_idle_stage_is_the_definition_for_every_stage() -> None:
    """`Evaluator.idle_stage` (precomputed `idle_ends`) says a stage [a, z) computes nothing
    exactly where `compute_ms(a, z) <= 0`, for every a < z: runs of 0-ms layers at the ends,
    in the middle, single ones, and layers that are 0 ms in forward or backward only."""
    from planner.search.space import Evaluator
    from tests.planner.helpers import chain_profile, cluster

    rng = random.Random(3)
    for trial in range(30):
        n = rng.randint(1, 14)
        fwd = [rng.choice([0.0, 0.0, rng.uniform(0.1, 3)]) for _ in range(n)]
        bwd = [rng.choice([0.0, f, rng.uniform(0.1, 3)]) for f in fwd]
        table = layer_table(chain_profile(fwd, bwd))
        ev = Evaluator(table, cluster(), PlanOptions(global_batch=8, microbatch_size=8, optimizer="sgd"))
        whole_idle = table.compute_ms(0, n) <= 0
        for a in range(n):
            for z in range(a + 1, n + 1):
                want = not whole_idle and table.compute_ms(a, z) <= 0
                assert ev.idle_stage((a, z)) == want, (trial, fwd, bwd, a, z)


@pytest.mark.parametrize("ms", [0.0, 5e-324, 1e-30])
def test_a_profile_of_no_time_is_a_clear_error(ms: float) -> None:
    """All-zero or subnormal layer times: a plan of them has no throughput a plan.json can
    hold (infinity was written as null, which `simulate` then refused) and the bound's
    arithmetic overflowed (an OverflowError traceback, a 500 in the service)."""
    from planner.search.bound import steps_to_prove
    from tests.planner.helpers import chain_profile, cluster

    profile = chain_profile([ms] * 4, [ms] * 4)
    with pytest.raises(PipeplanError, match="profile the model again|Profile the model again"):
        make_plan(profile, cluster(), PlanOptions(global_batch=16, microbatch_size=8, optimizer="sgd"))
    assert steps_to_prove(5e-324, 1.0) > 0


@pytest.mark.parametrize(("params", "act", "memory_gb", "recompute"), [
    ([10**8, 3 * 10**9, 10**8], [10**7, 0, 10**7], 6.1, False),  # a 0-ms layer of 3 GB parameters
    # one that saves 4 GB for its backward: it fits recomputed, on a device of its own
    ([10**9, 0, 10**9], [10**7, 4 * 10**9, 10**7], 5.0, True),
])
def test_a_0_ms_layer_gets_devices_of_its_own_where_nothing_else_fits(params, act, memory_gb,
                                                                      recompute) -> None:
    """The search and the bound leave out stages that compute nothing (their devices would do
    no work), and said "no plan found that fits" where every plan that fits gives the 0-ms
    layer a device of its own (found by a probe with profiles of its own). Now the search
    runs once more with such stages allowed: the plan is the brute force's optimum, and the
    bound is the one that holds for every plan."""
    from tests.planner.helpers import chain_profile, cluster

    profile = chain_profile([10.0, 0.0, 10.0], params=params, act=act, out=[10**6] * 3)
    cl = cluster(per_node=3, memory_gb=memory_gb)
    options = PlanOptions(global_batch=32, microbatch_size=8, optimizer="sgd", allow_recompute=recompute)
    ref = brute_force(profile, cl, options, [8])
    cand = solve(profile, cl, options)
    assert [len(s.devices) for s in cand.stages] == [1, 1, 1]
    assert cand.solver["objective"] == pytest.approx(ref.iteration_ms, rel=REL)
    assert cand.solver["bound"] <= cand.solver["objective"] and cand.solver["idle_stages"]
    # where a plan without such a stage fits, the first search's plan stands
    roomy = solve(profile, cluster(per_node=3, memory_gb=16.0), options)
    assert len(roomy.stages) == 2 and "idle_stages" not in roomy.solver


@pytest.mark.parametrize(("fwd", "params", "act", "memory_gb", "optimizer", "schedule"), [
    # 0-ms layers saving 3 GB and 1 GB around the one that computes: recomputed on a device of
    # their own, the compute layer gets two replicas (25.25 ms); in one stage with it, 43.36 ms
    ([0.0, 0.0, 4.02, 0.0], [10**7, 10**9, 10**7, 10**8], [3 * 10**9, 10**9, 3 * 10**9, 10**8],
     6.0, "sgd", "1f1b"),
    # a 0-ms last layer saving 3 GB under GPipe with Adam: alone, the others need no recomputation
    ([4.73, 6.75, 0.0], [10**8, 10**9, 10**7], [10**9, 3 * 10**9, 3 * 10**9], 16.0, "adam", "gpipe"),
])
def test_a_bound_holds_over_plans_with_a_stage_that_computes_nothing(fwd, params, act, memory_gb,
                                                                     optimizer, schedule) -> None:
    """Plans without a 0-ms stage fit here, so the search never tries one, and the bound's
    DP left them out as well: the planner called a plan OPTIMAL that the brute force beats by
    71.7 % and 0.6 % (`benchmarks/idle_stages.py`, seeds 146 and 55). The bound now holds over
    every plan, and enumerating the plans it allows finds the optimum."""
    from tests.planner.helpers import chain_profile, cluster

    profile = chain_profile(fwd, params=params, act=act, out=[10**6] * len(fwd))
    cl = cluster(per_node=3, memory_gb=memory_gb)
    options = PlanOptions(global_batch=32, microbatch_size=8, optimizer=optimizer, schedule=schedule,
                          time_limit_s=2)
    ref = brute_force(profile, cl, options, [8])
    cand = solve(profile, cl, options)
    assert cand.solver["bound"] <= ref.iteration_ms * (1 + REL)
    assert cand.solver["objective"] == pytest.approx(ref.iteration_ms, rel=REL)
    assert cand.solver["idle_stages"]


def test_no_plan_found_suggests_only_what_the_options_leave_to_try() -> None:
    # it said "Try a smaller microbatch size, --optimizer sgd, ..." at microbatch size 1 with sgd
    from tests.planner.helpers import chain_profile, cluster

    profile = chain_profile([10.0, 5.0, 10.0], params=[2 * 10**9] * 3, act=[6 * 10**8] * 3,
                            out=[10**6] * 3, batch_size=1)
    options = PlanOptions(global_batch=8, microbatch_size=1, optimizer="sgd", allow_recompute=False)
    with pytest.raises(PipeplanError, match="no 1f1b plan fits") as exc:
        solve(profile, cluster(per_node=4, memory_gb=5.0), options)
    text = str(exc.value)
    assert "leave out --no-recompute" in text and "--optimizer sgd" not in text
    assert "smaller microbatch" not in text
    # the bound's DP proved that none fits: a longer search would not find one
    assert "--time-limit" not in text
