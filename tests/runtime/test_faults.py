"""Faults end the run promptly with the failing rank's error; mismatches stop it before it starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from runtime_paths import EXAMPLES, MODELS


@pytest.fixture
def fault(monkeypatch):
    def set_fault(kind: str, rank: int) -> None:
        monkeypatch.setenv("PIPEPLAN_TEST_FAULT", f"{kind}:{rank}")
    return set_fault


def test_a_rank_that_raises_stops_every_rank_with_its_error(run, fault):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [3, 2, 1])  # Faulty is layer 2: on rank 0
    fault("raise", 0)
    rc, out, err, wall = run(plan, "--model", model, "--steps", 3, "--timeout", 300)
    assert rc == 1
    assert "rank 0" in err and "deliberate failure in Faulty.forward" in err
    assert wall < 120  # far below the 300 s timeout: the other ranks were stopped at once
    # the model's own frame and the error, without the runtime's and torch's around them
    assert "seq_mlp.py" in err and "your code's frames" in err
    assert "runtime/executor.py" not in err and "torch/nn/modules" not in err


def test_what_a_failed_rank_started_is_stopped_with_it(run, fault, tmp_path, monkeypatch):
    """A rank's own child process (a data loader's worker, a `subprocess` in the model file)
    ends with the run: it outlived a failed run before, re-parented to init, and held the
    caller's pipe open (`python -m runtime ... | tail` waited for it; an outside review)."""
    import time

    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [1, 3, 2])  # Faulty is layer 2: on rank 1
    fault("child-raise", 1)
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("PIPEPLAN_TEST_CHILD_PID", str(pid_file))
    rc, out, err, wall = run(plan, "--model", model, "--steps", 3, "--timeout", 60)
    assert rc == 1 and "deliberate failure after starting a child process" in err
    child = int(pid_file.read_text())
    deadline = time.time() + 5
    while time.time() < deadline and "Z" not in _state(child):
        time.sleep(0.1)
    try:
        assert "Z" in _state(child), f"the rank's child {child} outlived the run"
    finally:
        try:
            os.kill(child, 9)
        except OSError:
            pass


def test_ctrl_c_on_a_rank_is_one_line_not_the_runtimes_traceback(run, fault):
    """An outside review: SIGINT to a rank (as torchrun passes Ctrl-C on to every rank) printed
    the runtime's and gloo's frames down to the KeyboardInterrupt on each rank."""
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [3, 2, 1])  # Faulty is layer 2: on rank 0
    fault("sigint", 0)
    rc, out, err, wall = run(plan, "--model", model, "--steps", 3, "--timeout", 60)
    assert rc != 0 and "rank 0: interrupted (SIGINT)" in err, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert wall < 50


def test_a_hung_rank_is_detected_by_the_timeout_and_named(run, fault):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [1, 3, 2])  # Faulty is layer 2: on rank 1
    fault("hang", 1)
    rc, out, err, wall = run(plan, "--model", model, "--steps", 2, "--timeout", 3)
    assert rc == 1
    assert "rank 1 (stage 1)" in err and "3 s" in err, err
    assert wall < 120  # never an endless wait


def test_the_rank_that_hangs_is_named_not_the_one_that_waits_for_it(run, fault):
    """Rank 2 hangs; rank 1 waits for it and rank 0 for rank 1, so rank 0's timeout names
    rank 1. The launcher waits for the others to report: rank 1 names rank 2, which never
    reports, and the error names rank 2 (before, it named rank 1)."""
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [1, 1, 4])  # Faulty is layer 2: on rank 2
    fault("hang", 2)
    rc, out, err, wall = run(plan, "--model", model, "--steps", 2, "--timeout", 3)
    assert rc == 1
    last = [x for x in err.splitlines() if x.startswith("error:")][-1]
    assert last.startswith("error: rank 2 hangs"), err
    assert wall < 120


def test_a_replica_that_hangs_is_named_within_the_timeout(run, fault):
    """One stage on two replicas; rank 1 hangs in its forward while rank 0 waits in their
    gradient all-reduce. That group was made without a timeout: gloo's default, 30 minutes,
    whatever --timeout said."""
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [6], [2])
    fault("hang", 1)
    rc, out, err, wall = run(plan, "--model", model, "--steps", 2, "--timeout", 3)
    assert rc == 1
    last = [x for x in err.splitlines() if x.startswith("error:")][-1]
    assert last.startswith("error: rank 1 hangs"), err
    assert wall < 120


def test_a_rank_that_never_joins_is_named_not_the_one_that_waited(run, fault):
    """Rank 1 hangs while it imports the model file, before the process group: rank 0's
    rendezvous times out. That was rank 0's 25-line traceback, naming no rank."""
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [3, 3])
    fault("import-hang", 1)
    rc, out, err, wall = run(plan, "--model", model, "--steps", 2, "--timeout", 3)
    assert rc == 1
    last = [x for x in err.splitlines() if x.startswith("error:")][-1]
    assert last.startswith("error: rank 1 hangs") and "rank 0: joining the process group" in err, err
    assert "Traceback" not in err
    assert wall < 120


@pytest.mark.parametrize("timeout", ["nan", "inf", "1e-9", "1e14"])
def test_a_timeout_that_is_no_time_is_refused_before_any_rank(run, timeout):
    """nan and inf passed the launcher's `<= 0` and crashed every rank in init_process_group;
    1e14 overflowed the process group's timedelta on every rank."""
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [3, 3])
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1, "--timeout", timeout)
    assert rc == 2 and "--timeout" in err and "finite number of seconds" in err, err
    assert "Traceback" not in err


def test_a_loss_that_is_not_one_element_is_named() -> None:
    import torch

    from planner.errors import PipeplanError
    from runtime.executor import checked_loss

    assert checked_loss(torch.tensor(2.0)) == 2.0
    with pytest.raises(PipeplanError, match="loss_fn returned a float"):
        checked_loss(1.0)
    with pytest.raises(PipeplanError, match=r"loss_fn returned a tensor of shape \(3,\)"):
        checked_loss(torch.ones(3))


def test_a_dead_rank_is_reported(run, fault):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [1, 3, 2])
    fault("die", 1)
    rc, out, err, wall = run(plan, "--model", model, "--steps", 2, "--timeout", 30)
    assert rc != 0
    assert "rank 1 exited with status 17" in err, err


def test_a_rank_that_exits_0_mid_run_is_named(run, fault):
    """Status 0 is not success before the rank's steps are done: the headline named rank 0's
    lost connection and left the cause to a guess."""
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [1, 3, 2])  # the faulty layer on rank 1
    fault("exit0", 1)
    rc, out, err, wall = run(plan, "--model", model, "--steps", 2, "--timeout", 30)
    assert rc != 0
    assert "\nerror: rank 1 exited with status 0 before finishing its steps" in "\n" + err, err


def test_model_hash_mismatch_is_a_clear_error_before_any_process(run, tmp_path):
    model = tmp_path / "m.py"
    model.write_text((MODELS / "seq_mlp.py").read_text())
    plan = run.plan(model, 2)
    model.write_text(model.read_text() + "\n# edited\n")
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1)
    assert rc == 2
    assert "sha256" in err and "--allow-mismatch" in err and "profile" in err
    assert "running" not in out and "Traceback" not in err


def test_unknown_layer_names_are_a_clear_error(run, tmp_path):
    import json

    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2)
    data = json.loads(plan.read_text())
    data["stages"][1]["layers"][0] = "no_such_layer"
    plan.write_text(json.dumps(data))
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1)
    assert rc == 2 and "'no_such_layer'" in err and "Traceback" not in err


def test_a_model_sized_differently_than_profiled_is_a_clear_error(run, tmp_path, monkeypatch):
    """Same file, same layer names, another width (set by an environment variable): its
    parameter bytes are not the profile's. A plan made by the planner says each stage's
    (`param_bytes`); a run of such a plan trained a model 8x the planned one without a word."""
    import json

    from planner.cost import layer_table
    from planner.formats import Cluster, PlanOptions
    from planner.solve import make_plan
    from profiler.profile import profile_model_file

    model = EXAMPLES / "mlp.py"
    monkeypatch.setenv("PIPEPLAN_MLP_DIM", "16")
    monkeypatch.setenv("PIPEPLAN_MLP_BLOCKS", "2")
    profile = profile_model_file(model, 2, warmup=0, repeats=1)
    half = len(profile.layers) // 2
    plan = make_plan(profile, Cluster(nodes=1, devices_per_node=2, device_memory_gb=1,
                                      intra_node_gb_per_s=10, inter_node_gb_per_s=10),
                     PlanOptions(global_batch=8, microbatch_size=2, method="manual",
                                 split=[half, len(profile.layers) - half],
                                 optimizer="sgd"))
    table = layer_table(profile)
    assert [s.param_bytes for s in plan.stages] == [table.param_bytes(0, half),
                                                    table.param_bytes(half, table.num_layers)]
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    rc, out, err, _ = run(path, "--model", model, "--steps", 1)
    assert rc == 0, err
    monkeypatch.setenv("PIPEPLAN_MLP_DIM", "32")
    rc, out, err, _ = run(path, "--model", model, "--steps", 1)
    assert rc == 2 and "builds a different model than was profiled" in err and "stage 0" in err
    assert "Traceback" not in err and "step 1" not in out
    rc, out, err, _ = run(path, "--model", model, "--steps", 1, "--allow-mismatch")
    assert rc == 0 and "warning" in err and "running anyway" in err
    data = json.loads(path.read_text())  # a plan of before the figure: not checked
    for st in data["stages"]:
        del st["param_bytes"]
    path.write_text(json.dumps(data))
    rc, out, err, _ = run(path, "--model", model, "--steps", 1)
    assert rc == 0 and "different model" not in err


def test_parameters_frozen_since_the_profile_are_a_clear_error(run, tmp_path, monkeypatch):
    """The same bytes of parameters, but another set frozen than was profiled: the stage's
    gradients, optimizer state and memory differ from the plan's, and the run said nothing."""
    import json

    from planner.formats import Cluster, PlanOptions
    from planner.solve import make_plan
    from profiler.profile import profile_model_file

    model = MODELS / "seq_mlp.py"
    monkeypatch.setenv("PIPEPLAN_TEST_FREEZE", "0")
    profile = profile_model_file(model, 2, warmup=0, repeats=1)
    n = len(profile.layers)
    made = make_plan(profile, Cluster(nodes=1, devices_per_node=2, device_memory_gb=1,
                                      intra_node_gb_per_s=10, inter_node_gb_per_s=10),
                     PlanOptions(global_batch=8, microbatch_size=2, method="manual",
                                 split=[n // 2, n - n // 2], optimizer="sgd"))
    plan = tmp_path / "plan.json"
    plan.write_text(made.model_dump_json())
    assert [s["frozen_param_bytes"] for s in json.loads(plan.read_text())["stages"]] == [(8 * 16 + 16) * 4, 0]
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1)
    assert rc == 0, err
    monkeypatch.setenv("PIPEPLAN_TEST_FREEZE", "")
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1)
    assert rc == 2 and "frozen parameters" in err and "stage 0" in err, err
    assert "Traceback" not in err and "step 1" not in out
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1, "--allow-mismatch")
    assert rc == 0 and "running anyway" in err


def test_a_forward_that_hangs_before_any_rank_starts_is_named_within_the_timeout(run, fault):
    """The launcher runs the model once without gradients to trace it, and under torchrun every
    rank does; a forward that hung there held the job for ever without a word (--timeout
    covered only what ranks do together)."""
    import socket

    model = MODELS / "seq_mlp.py"
    plans = run.plan(model, [3, 3]), run.plan(model, 1, name="one.json")  # (they trace the model)
    fault("trace-hang", "any")
    rc, _, err, wall = run(plans[0], "--model", model, "--steps", 1, "--timeout", 3)
    assert rc == 2 and "the check before the ranks start" in err and "within 3 s (--timeout)" in err, err
    assert "While executing" not in err and wall < 60
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    env.pop("PIPEPLAN_ERROR_FILE", None)
    p = subprocess.run([sys.executable, "-m", "runtime", str(plans[1]),
                        "--model", str(model), "--timeout", "3"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "rank 0's setup (build_model, make_batch and one forward" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_ctrl_c_before_the_ranks_start_names_where_it_waited(run, fault, tmp_path, monkeypatch):
    """Ctrl-C while the launcher checks the model (build_model, the traced forward) printed a
    traceback and the process died of the signal; after the ranks started it said
    "interrupted", 130 (an outside review). Now the same everywhere, naming the user's line."""
    import shutil
    import signal
    import time

    model = tmp_path / "user_model.py"  # outside pipeplan's folders, as a user's is
    shutil.copy(MODELS / "seq_mlp.py", model)
    plan = run.plan(model, [3, 3])
    fault("trace-hang", "any")
    mark = tmp_path / "hanging"
    monkeypatch.setenv("PIPEPLAN_TEST_HANG_MARK", str(mark))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.Popen([sys.executable, "-m", "runtime", str(plan), "--model", str(model), "--steps", "1",
                          "--timeout", "300"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not mark.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    assert mark.exists(), "the check before the ranks did not reach the traced forward"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, (p.returncode, err[-1500:])
    assert "Traceback" not in err and "interrupted while running" in err and "user_model.py" in err, err


def test_world_size_must_match_under_torchrun(run):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2)
    env = dict(os.environ, RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29999")
    env.pop("PIPEPLAN_ERROR_FILE", None)
    p = subprocess.run([sys.executable, "-m", "runtime", str(plan), "--model", str(model)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "needs 2 processes" in p.stderr and "WORLD_SIZE is 3" in p.stderr


@pytest.mark.parametrize("differ", ["plan", "options"])
def test_ranks_started_with_other_plans_or_options_are_named(run, differ):
    """An outside review: two torchrun nodes given different plan files (a stale copy on one)
    deadlocked and each rank named a healthy peer as hung, or sent tensors of another shape
    that failed in the user's loss. Ranks compare what they run once the process group stands."""
    from runtime.launch import free_port

    model = MODELS / "seq_mlp.py"
    plans = [run.plan(model, [3, 3]), run.plan(model, [2, 4], name="other.json")]
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.pop("PIPEPLAN_ERROR_FILE", None)
        plan = plans[rank] if differ == "plan" else plans[0]
        steps = str(2 + rank) if differ == "options" else "2"
        procs.append(subprocess.Popen([sys.executable, "-m", "runtime", str(plan), "--model", str(model),
                                       "--steps", steps, "--timeout", "60"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=120)[1] for p in procs]
    said = ("rank 1 runs another plan than rank 0" if differ == "plan" else
            "rank 1 was started with other training options than rank 0")
    for p, err in zip(procs, errs, strict=True):
        assert p.returncode == 2 and said in err, err[-2000:]
        assert "Traceback" not in err


def test_a_save_after_one_node_s_restart_is_waited_on_by_every_rank(run, tmp_path):
    """After a torchrun restart the agents' TORCHELASTIC_RESTART_COUNT differ (the failed node's
    agent counts the restart, a healthy one restarting its ranks for the new round does not);
    the save's progress keys held that count, so the other ranks waited on keys rank 0 never
    wrote and failed the save after --timeout (an outside review of torchrun restarts)."""
    from runtime.launch import free_port

    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [3, 3])
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   TORCHELASTIC_RESTART_COUNT=str(1 - rank))
        env.pop("PIPEPLAN_ERROR_FILE", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "runtime", str(plan), "--model", str(model),
                                       "--steps", "2", "--timeout", "10", "--save", str(tmp_path / "ck")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert (tmp_path / "ck" / "model.pt").is_file()


def test_a_torchrun_layout_other_than_the_plans_cluster_is_warned_about(run):
    """A plan for 2 nodes of 1 device started by torchrun as 1 node of 2 ranks: it trains (the
    layout changes only which links are fast), with one warning that says how to start it."""
    from planner.formats import Cluster, Plan, ScheduleGenerator
    from planner.runnable import runnable_plan
    from runtime.launch import free_port
    from runtime.worker import DistEnv, layout_warning

    model = MODELS / "seq_mlp.py"
    path = run.plan(model, 2)
    plan = Plan.model_validate_json(path.read_text())
    plan = plan.model_copy(update={"cluster": Cluster(
        nodes=2, devices_per_node=1, device_memory_gb=16, intra_node_gb_per_s=100, inter_node_gb_per_s=10)})
    path.write_text(plan.model_dump_json())
    plan = runnable_plan(plan)
    assert layout_warning(plan, DistEnv(0, 2, 0, 1)) is None  # one rank per node: as planned
    # a plan that uses 3 of 2 x 4 devices (2 on node 0, 1 on node 1): nodes of 2 and 1 ranks
    wide = runnable_plan(plan.model_copy(update={
        "cluster": Cluster(nodes=2, devices_per_node=4, device_memory_gb=16, intra_node_gb_per_s=100,
                           inter_node_gb_per_s=10),
        "stages": [plan.stages[0].model_copy(update={"devices": [0, 1], "replicas": 2}),
                   plan.stages[1].model_copy(update={"devices": [4]})],
        "rank_actions": None, "generator": ScheduleGenerator(name="1f1b", params={})}))
    assert layout_warning(wide, DistEnv(0, 3, 0, 2)) is None and layout_warning(wide, DistEnv(2, 3, 0, 1)) is None
    said = layout_warning(wide, DistEnv(0, 3, 0, 3))  # all three on one node
    assert said is not None and "--nproc-per-node 2" in said and "ranks 0-1 (2 of its 4 devices)" in said
    env = dict(os.environ, PYTHONPATH=str(MODELS.parents[2]))
    env.pop("PIPEPLAN_ERROR_FILE", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                        "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                        str(free_port()), "-m", "runtime", str(path), "--model", str(model),
                        "--steps", "1", "--timeout", "60"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("warning: torchrun started")]
    assert len(said) == 1 and "--nproc-per-node 1" in said[0] and "node 'node0'" in said[0]
    assert "Traceback" not in p.stderr


def test_calibrated_nodes_in_another_order_are_warned_about(run):
    """A cluster calibrate measured node by node ("host#GROUP_RANK" names, nodes that differ):
    a rank whose node is not the one the plan gave it is told so; a plan of uniform nodes,
    whose names say nothing, is not checked."""
    from planner.formats import Cluster, NodeSpec, Plan
    from planner.runnable import runnable_plan
    from runtime.worker import DistEnv, node_name_warning

    path = run.plan(MODELS / "seq_mlp.py", 2)
    plan = Plan.model_validate_json(path.read_text())
    nodes = [NodeSpec(name="a#0", devices=1, device_memory_gb=80, speed=1.0),
             NodeSpec(name="b#1", devices=1, device_memory_gb=40, speed=0.5)]
    cal = runnable_plan(plan.model_copy(update={"cluster": Cluster(
        nodes=nodes, intra_node_gb_per_s=100, inter_node_gb_per_s=10)}))
    assert node_name_warning(cal, DistEnv(0, 2, 0, 1), "a#0") is None
    assert node_name_warning(cal, DistEnv(1, 2, 0, 1), "b#1") is None
    said = node_name_warning(cal, DistEnv(0, 2, 0, 1), "b#0")  # host b came first this time
    assert said is not None and "b#0" in said and "a#0" in said and "--rdzv-backend static" in said and "ignores --node-rank" in said
    assert node_name_warning(runnable_plan(plan), DistEnv(0, 2, 0, 1), "b#0") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_ranks_end_when_their_launcher_is_killed(run, tmp_path, monkeypatch):
    """A launcher killed outright (SIGKILL: no chance to stop its ranks) takes its ranks with
    it; they trained on for nobody before (their connections to each other outlive it). (Its
    temporary folders, which nothing can remove after a SIGKILL, go with tmp_path: they were
    left in /tmp, a pipeplan-run-* and a pipeplan-trace-* per run of the suite.)"""
    import signal
    import time

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    launcher, ranks = _endless_run(run, subprocess.DEVNULL)
    try:
        time.sleep(3)  # training
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 20
        while time.time() < deadline and any(os.path.exists(f"/proc/{r}") and
                                             "Z" not in _state(r) for r in ranks):
            time.sleep(0.2)
        alive = [r for r in ranks if os.path.exists(f"/proc/{r}") and "Z" not in _state(r)]
        assert not alive, f"ranks {alive} outlived their launcher"
    finally:
        launcher.kill()
        for r in ranks:
            try:
                os.kill(r, signal.SIGKILL)
            except OSError:
                pass


def _endless_run(run, stderr: int) -> tuple[subprocess.Popen, list[int]]:
    """A launcher training a 2-stage plan without end, and its two ranks' pids once they run."""
    import time

    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    launcher = subprocess.Popen([sys.executable, "-m", "runtime", str(plan), "--model", str(model),
                                 "--steps", "1000000", "--threads", "1"], cwd=root,
                                stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    ranks: list[int] = []
    deadline = time.time() + 60
    while len(ranks) < 2 and time.time() < deadline:
        time.sleep(0.5)
        kids = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
        ranks = [int(x) for x in kids.stdout.split()]
    if len(ranks) != 2:
        launcher.kill()
    assert len(ranks) == 2, "the ranks did not start"
    return launcher, ranks


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_options_that_would_fail_late_or_lose_files_are_refused_before_any_rank(run, tmp_path):
    """A learning rate beyond float32 failed in every rank's first optimizer step (a traceback);
    --save into a directory of the user's own overwrote its model.pt."""
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [3, 3])
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1, "--lr", "1e300")
    assert rc == 2 and "--lr 1e+300: give a learning rate from 0 to 1e+06" in err, err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.pt").write_text("the user's own")
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1, "--save", mine)
    assert rc == 2 and "holds files but no checkpoint" in err and "Traceback" not in err, err
    assert (mine / "model.pt").read_text() == "the user's own" and "running" not in out
    # what a first --save killed while writing leaves (its own *.tmp files) was refused the same
    # way, though that --save wrote it
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "model.pt.tmp").write_bytes(b"half a checkpoint")
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1, "--save", cut)
    assert rc == 0, err
    assert (cut / "meta.json").is_file() and not (cut / "model.pt.tmp").exists()

    # a checkpoint's files are inputs (--resume) and outputs (--save): a report or trace over
    # one destroyed it; the report and the trace in one file lost the report
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1, "--save", tmp_path / "ck")
    assert rc == 0, err
    kept = (tmp_path / "ck" / "model.pt").read_bytes()
    for args, message in (
            (["--resume", tmp_path / "ck", "--report", tmp_path / "ck" / "model.pt"], "writing it would destroy it"),
            (["--save", tmp_path / "ck", "--trace", tmp_path / "ck" / "meta.json"], "writing it would destroy it"),
            (["--report", tmp_path / "r.json", "--trace", tmp_path / "r.json"], "give each its own file")):
        rc, out, err, _ = run(plan, "--model", model, "--steps", 1, *args)
        assert rc == 2 and message in err and "Traceback" not in err, (args, err)
    assert (tmp_path / "ck" / "model.pt").read_bytes() == kept and not (tmp_path / "r.json").exists()


def test_a_seed_torch_would_cut_to_32_bits_is_refused() -> None:
    """torch's CPU generator keeps 32 bits: --seed 2**32 trained exactly as --seed 0."""
    import argparse

    from planner.limits import run_seed_arg

    assert run_seed_arg(str(2**32 - 1)) == 2**32 - 1
    with pytest.raises(argparse.ArgumentTypeError, match="keeps 32 bits"):
        run_seed_arg(str(2**32))


def test_more_local_ranks_than_the_memory_holds_are_refused(monkeypatch):
    from planner.errors import PipeplanError
    from runtime import launch

    monkeypatch.setattr(launch, "available_memory_bytes", lambda: 4 * 2**30)
    launch.check_room(12, "the plan")  # 12 x 320 MB fit in 4 GB
    with pytest.raises(PipeplanError, match="needs 1000 rank processes.*enough for about 12"):
        launch.check_room(1000, "--nproc-per-node 1000")


def test_a_run_with_another_optimizer_is_warned_about_and_a_diverged_loss_is_named(run, tmp_path):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [3, 3])  # made for sgd
    rc, out, err, _ = run(plan, "--model", model, "--steps", 6, "--optimizer", "momentum",
                          "--lr", "1e6", "--timeout", 60, "--report", tmp_path / "r.json")
    assert rc == 0, err
    assert "the plan was made for --optimizer sgd and this run uses momentum" in err
    assert err.count("the loss is") == 1 and "training diverged" in err, err
    import json
    assert json.loads((tmp_path / "r.json").read_text())["optimizer"] == "momentum"


def test_a_terminated_launcher_stops_its_ranks_and_exits_143(run):
    """SIGTERM (a scheduler cancelling the job) stopped the ranks but exited 130, Ctrl-C's
    status, saying "interrupted"."""
    import signal
    import time

    launcher, ranks = _endless_run(run, subprocess.PIPE)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 143 and "terminated (SIGTERM)" in err, err
    time.sleep(1)
    assert not [r for r in ranks if "Z" not in _state(r)]


def test_a_model_run_on_other_input_sizes_than_profiled_is_a_clear_error(run, tmp_path, monkeypatch):
    """Names, hash and parameters match, the sequence length does not: what a stage sends is 512x
    the plan's price (its memory and times are not this model's). It ran unwarned, its peaks
    1.6x the devices' memory; now refused before the ranks start, or run with a warning under
    --allow-mismatch."""
    from planner.formats import Cluster, PlanOptions
    from planner.solve import make_plan
    from profiler.profile import profile_model_file

    model = MODELS / "seq_sized.py"
    monkeypatch.setenv("PIPEPLAN_TEST_SEQ", "8")
    profile = profile_model_file(model, 2, warmup=0, repeats=1)
    plan = make_plan(profile, Cluster(nodes=1, devices_per_node=2, device_memory_gb=1,
                                      intra_node_gb_per_s=10, inter_node_gb_per_s=10),
                     PlanOptions(global_batch=4, microbatch_size=2, method="manual", split=[2, 2],
                                 optimizer="sgd"))
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    rc, _, err, _ = run(path, "--model", model, "--steps", 1)
    assert rc == 0 and "input sizes" not in err, err
    monkeypatch.setenv("PIPEPLAN_TEST_SEQ", "4096")
    rc, out, err, _ = run(path, "--model", model, "--steps", 1)
    assert rc == 2 and "runs on other input sizes than were profiled" in err and "stage 0 sends stage 1" in err, err
    assert "Traceback" not in err and "step 1" not in out
    rc, _, err, _ = run(path, "--model", model, "--steps", 1, "--allow-mismatch")
    assert rc == 0 and "running anyway" in err, err


def test_a_tensor_that_does_not_grow_with_the_batch_is_no_input_size_mismatch(run, tmp_path):
    """A position bias of (heads, S, S) sent to every block is priced at microbatch / profiled
    batch of its bytes: profiled at 8, run at microbatches of 1, it is 8x its price, and the
    first version of the input-size check refused this correct run (a review)."""
    from planner.formats import Cluster, PlanOptions
    from planner.solve import make_plan
    from profiler.profile import profile_model_file

    model = MODELS / "position_bias.py"
    profile = profile_model_file(model, 8, warmup=0, repeats=1)
    plan = make_plan(profile, Cluster(nodes=1, devices_per_node=2, device_memory_gb=1,
                                      intra_node_gb_per_s=10, inter_node_gb_per_s=10),
                     PlanOptions(global_batch=2, microbatch_size=1, method="manual",
                                 split=[3, len(profile.layers) - 3], optimizer="sgd"))
    assert plan.model_extra["profile_batch_size"] == 8
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    rc, _, err, _ = run(path, "--model", model, "--steps", 1)
    assert rc == 0 and "input sizes" not in err, err


def test_a_hung_up_launcher_stops_its_ranks_what_they_started_and_its_files(run, fault, tmp_path,
                                                                             monkeypatch):
    """SIGHUP (the terminal or ssh session the run was started from closed) ended the launcher
    by its default action: the ranks followed by their parent-death signal, but a process a rank
    had started (a data loader's worker) lived on, and the launcher's temporary folders
    (pipeplan-run-*, pipeplan-trace-*) stayed in /tmp, a pair per run. Now stopped as SIGTERM
    stops them, exit 129."""
    import signal
    import time

    fault("child", 0)
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("PIPEPLAN_TEST_CHILD_PID", str(pid_file))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    # (a suite started under nohup hands its ignored SIGHUP down, which the launcher keeps)
    kept = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        launcher, ranks = _endless_run(run, subprocess.PIPE)
    finally:
        signal.signal(signal.SIGHUP, kept)
    deadline = time.time() + 60
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(0.2)
    child = int(pid_file.read_text())
    launcher.send_signal(signal.SIGHUP)
    try:
        _, err = launcher.communicate(timeout=60)
        time.sleep(1)
        assert launcher.returncode == 129 and "terminated (SIGHUP)" in err, (launcher.returncode, err)
        assert not [r for r in ranks if "Z" not in _state(r)]
        assert "Z" in _state(child), f"the rank's child {child} outlived the run"
        assert not [p.name for p in tmp.iterdir() if p.name.startswith("pipeplan-")]
    finally:
        for pid in [child, *ranks]:
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def test_a_launcher_terminated_in_its_check_before_the_ranks_leaves_no_files(run, fault, tmp_path,
                                                                            monkeypatch):
    """SIGTERM (a scheduler cancelling the job) while the launcher checks the model, before any
    rank starts: the default action ended it without a word and left its pipeplan-trace-*
    folder in /tmp. Now one line, exit 143, nothing left."""
    import signal
    import time

    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2)
    fault("trace-hang", "any")
    mark = tmp_path / "hanging"
    monkeypatch.setenv("PIPEPLAN_TEST_HANG_MARK", str(mark))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    launcher = subprocess.Popen([sys.executable, "-m", "runtime", str(plan), "--model", str(model),
                                 "--steps", "2"], cwd=root, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not mark.exists() and time.time() < deadline:
            time.sleep(0.1)
        assert mark.exists(), "the check did not start"
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 143 and "terminated (SIGTERM)" in err, (launcher.returncode, err)
        assert "Traceback" not in err
        assert not [p.name for p in tmp.iterdir() if p.name.startswith("pipeplan-")]
    finally:
        launcher.kill()


def test_a_torchrun_agent_killed_outright_takes_its_ranks_with_it(run):
    """`kill -9` to a node's torchrun agent: its ranks, reparented, trained on with the other
    nodes to the end of the run (an outside review: 4000 steps finished after the agent of
    rank 0's node was gone). They end with their agent now, as with pipeplan's launcher."""
    import signal
    import time

    from runtime.launch import free_port

    model = MODELS / "seq_mlp.py"
    path = run.plan(model, 2, global_batch=8, microbatch_size=2)
    env = dict(os.environ, PYTHONPATH=str(MODELS.parents[2]))
    env.pop("PIPEPLAN_ERROR_FILE", None)
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "runtime",
         str(path), "--model", str(model), "--steps", "100000", "--threads", "1", "--timeout", "60"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert agent.stdout is not None
        for line in agent.stdout:  # training has started
            if line.startswith("step 2:"):
                break
        ranks = [int(p) for p in open(f"/proc/{agent.pid}/task/{agent.pid}/children").read().split()]
        assert len(ranks) == 2
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        deadline = time.time() + 20
        while time.time() < deadline and any(os.path.exists(f"/proc/{r}") and
                                             open(f"/proc/{r}/stat").read().split()[2] != "Z"
                                             for r in ranks):
            time.sleep(0.2)
        alive = [r for r in ranks if os.path.exists(f"/proc/{r}")
                 and open(f"/proc/{r}/stat").read().split()[2] != "Z"]
        for r in alive:
            os.kill(r, signal.SIGKILL)
        assert not alive, "ranks outlived their torchrun agent"
    finally:
        if agent.poll() is None:
            agent.kill()
