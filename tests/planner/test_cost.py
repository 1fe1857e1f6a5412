import math

import pytest

from planner import cost
from planner.partition import Candidate, StageChoice
from tests.planner.helpers import chain_profile, cluster


def test_stage_traffic_counts_skip_tensors_once_per_stage_pair() -> None:
    # l0 -> l1 -> ... -> l5, plus l0 -> l4 and l0 -> l5 (same tensor), l2 -> l5
    p = chain_profile([1.0] * 6, out=[10, 20, 30, 40, 50, 60], skips=[(0, 4), (0, 5), (2, 5)])
    table = cost.layer_table(p)
    bounds = [0, 2, 4, 6]  # stages {0,1} {2,3} {4,5}
    traffic = cost.stage_traffic_bytes(table, bounds)
    # brute force from the edges: distinct (tensor, stage pair)
    stage = lambda i: next(s for s in range(3) if bounds[s] <= i < bounds[s + 1])  # noqa: E731
    index = p.layer_index()
    expect: dict[tuple[int, int], set[str]] = {}
    for e in p.edges:
        if e.src == "<input>":
            continue
        s, t = stage(index[e.src]), stage(index[e.dst])
        if s != t:
            expect.setdefault((s, t), set()).add(e.src)
    nbytes = {layer.name: layer.output_bytes for layer in p.layers}
    assert traffic == {k: sum(nbytes[x] for x in v) for k, v in expect.items()}
    assert traffic == {(0, 1): 20, (0, 2): 10, (1, 2): 40 + 30}


def test_formulas() -> None:
    assert cost.transfer_ms(0, 10.0, 5.0) == 0.0
    assert cost.transfer_ms(1e9, 10.0, 5.0) == pytest.approx(100.0 + 0.005)
    assert cost.allreduce_ms(1e9, 1, 10.0) == 0.0
    assert cost.allreduce_ms(1e9, 4, 10.0, 1.0) == pytest.approx(2 * 3 / 4 * 100.0 + 6 * 0.001)
    assert cost.stage_memory_bytes(100, 10, 0.5, 3, "adam") == 400 + 15
    assert cost.stage_memory_bytes(100, 10, 1.0, 1, "sgd") == 210
    assert cost.warmup_1f1b(8, [1, 1, 1, 1], 1) == 3
    assert cost.warmup_1f1b(2, [1, 1, 1, 1], 0) == 2
    assert cost.warmup_1f1b(8, [2, 1, 1], 0) == math.ceil(4 / 2)
    assert cost.peak_inflight("gpipe", 9, [2, 1], 0) == 5


def test_pipeline_costs_scale_with_microbatch_and_links() -> None:
    p = chain_profile([1.0, 2.0, 3.0, 4.0], params=[1, 2, 3, 4], act=[10, 20, 30, 40],
                      out=[100, 200, 300, 400], batch_size=8)
    c = cluster(nodes=2, per_node=2, intra=100.0, inter=10.0, latency_us=2.0)
    cand = Candidate((StageChoice(0, 2, (0, 1)), StageChoice(2, 3, (2,)), StageChoice(3, 4, (3,))),
                     microbatch_size=4, num_microbatches=4)
    costs = cost.pipeline_costs(cost.layer_table(p), c, cand, "adam")
    assert costs.fwd_ms == (1.5, 1.5, 2.0)  # scale 4/8
    assert costs.bwd_ms == (3.0, 3.0, 4.0)
    assert costs.allreduce_ms[0] == pytest.approx(cost.allreduce_ms(3, 2, 100.0, 2.0))
    assert costs.activation_bytes_per_microbatch == (15.0, 15.0, 20.0)
    assert costs.static_memory_bytes == (12, 12, 16)
    s01 = costs.sends[(0, 1)]
    assert s01.nbytes == 100.0 and s01.ms == pytest.approx(cost.transfer_ms(100.0, 10.0, 2.0))
    s12 = costs.sends[(1, 2)]  # both on node 1: intra
    assert s12.ms == pytest.approx(cost.transfer_ms(150.0, 100.0, 2.0))
    lb = cost.lower_bound_ms(cost.layer_table(p), 4, 0.5, 4.0)
    assert lb == pytest.approx(4 * 0.5 * 30.0 / 4)



def test_the_loss_is_paid_by_the_last_layer() -> None:
    """Its time (forward) and the bytes it keeps for backward."""
    from planner.cost import layer_table
    from planner.formats import Measured

    profile = chain_profile([1.0, 2.0, 3.0])
    base = layer_table(profile)
    measured = Measured(fwd_ms=6.0, bwd_ms=12.0, loss_ms=0.5, loss_activation_bytes=1000)
    with_loss = layer_table(profile.model_copy(update={"measured": measured}))
    assert with_loss.fwd_ms(0, 2) == base.fwd_ms(0, 2)
    assert with_loss.fwd_ms(2, 3) == base.fwd_ms(2, 3) + 0.5
    assert with_loss.bwd_ms(0, 3) == base.bwd_ms(0, 3)
    assert with_loss.activation_bytes(0, 2) == base.activation_bytes(0, 2)
    assert with_loss.activation_bytes(2, 3) == base.activation_bytes(2, 3) + 1000
