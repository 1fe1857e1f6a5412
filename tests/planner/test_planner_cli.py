import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main
from planner.formats import Plan
from tests.planner.helpers import chain_profile

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "pipedream-profiles"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    prof = tmp_path / "profile.json"
    prof.write_text(chain_profile([1.0, 2.0, 3.0, 2.0, 1.0, 3.0], params=[10**7] * 6,
                                  batch_size=8).model_dump_json())
    cl = tmp_path / "cluster.json"
    cl.write_text(json.dumps({"nodes": 2, "devices_per_node": 2, "device_memory_gb": 16,
                              "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10}))
    return {"profile": prof, "cluster": cl, "dir": tmp_path}


def test_plan_then_simulate(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = files["dir"] / "plan.json"
    trace = files["dir"] / "trace.json"
    rc = main(["plan", str(files["profile"]), "--cluster", str(files["cluster"]), "--global-batch",
               "32", "--microbatch-size", "4", "--method", "pipedream", "-o", str(out),
               "--trace", str(trace)])
    text = capsys.readouterr().out
    assert rc == 0
    for word in ("stage", "replicas", "memory / limit", "predicted iteration", "throughput",
                 "bubble", "lower bound"):
        assert word in text
    plan = Plan.model_validate_json(out.read_text())
    assert plan.solver.name == "pipedream"
    assert json.loads(trace.read_text())["traceEvents"]
    rc = main(["simulate", str(out), "--timeline"])
    text = capsys.readouterr().out
    assert rc == 0 and f"{plan.predicted.iteration_ms:.2f} ms" in text and "rank" in text


def test_manual_split_from_the_command_line(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = files["dir"] / "plan.json"
    rc = main(["plan", str(files["profile"]), "--cluster", str(files["cluster"]), "--global-batch",
               "16", "--microbatch-size", "4", "--split", "2,2,2", "--replicas", "1,1,2",
               "--schedule", "gpipe", "-o", str(out)])
    assert rc == 0
    plan = Plan.model_validate_json(out.read_text())
    assert [s.replicas for s in plan.stages] == [1, 1, 2] and plan.schedule == "gpipe"
    assert "note:" not in capsys.readouterr().out  # microbatches of 4 on a profile of 8
    rc = main(["plan", str(files["profile"]), "--cluster", str(files["cluster"]), "--global-batch",
               "64", "--microbatch-size", "32", "--split", "3,3", "-o", str(out)])
    assert rc == 0 and ("note: the profile was measured at batch 8; microbatches of 32 are priced "
                        "by scaling its times and bytes linearly (4x)") in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--global-batch", "30", "--microbatch-size", "4"], "not a multiple of microbatch size"),
    (["--method", "magic"], "unknown method 'magic'"),
    (["--split", "2,2"], "covers 4 layers but the profile has 6"),
    (["--replicas", "1,1"], "--replicas needs --split"),
    (["--split", "2,2,2", "--replicas", "2,2,2"], "needs 6 devices"),
    (["--microbatch-size", "4", "--microbatch-sizes", "4,8"], "give one of them"),
    (["--method", "uniform", "--powers-of-two"], "is for --method cpsat"),
    (["--split", "3,3", "--microbatch-sizes", "4,8"], "is for --method cpsat"),
    # options the method ignored without a word (an outside review)
    (["--method", "uniform", "--max-tp", "2"], "--max-tp is for --method cpsat"),
    (["--split", "3,3", "--max-tp", "2"], "give --method manual its degrees with --tp"),
    (["--split", "3,3", "--objective", "throughput"], "--objective throughput is for --method cpsat"),
    (["--max-tp", "2"], "the profile has no layer measured at a TP degree above 1"),
    # one microbatch of 16 over two replicas: the second replica idled (the table said "2 of 2")
    (["--global-batch", "16", "--microbatch-size", "16", "--split", "3,3", "--replicas", "2,1"],
     "stage 0 has 2 replicas but an iteration has 1 microbatch of 16, so 1 of them would get none"),
])
def test_bad_input_gives_a_clear_message(files: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                         args: list[str], message: str) -> None:
    rc = main(["plan", str(files["profile"]), "--cluster", str(files["cluster"]), "-o",
               str(files["dir"] / "p.json"), *args])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_bad_files(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    bad = files["dir"] / "bad.json"
    bad.write_text(json.dumps({"nodes": 0, "devices_per_node": 2, "device_memory_gb": 16,
                               "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10}))
    assert main(["plan", str(files["profile"]), "--cluster", str(bad)]) == 2
    assert "nodes" in capsys.readouterr().err
    assert main(["plan", str(files["dir"] / "missing.json"), "--cluster", str(files["cluster"])]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["simulate", str(files["cluster"])]) == 2
    assert "this file is a cluster description, not a plan" in capsys.readouterr().err
    empty = files["dir"] / "empty.json"
    empty.write_text("{}")
    assert main(["simulate", str(empty)]) == 2
    assert "not a valid Plan" in capsys.readouterr().err


@pytest.mark.parametrize(("field", "value"), [
    ("nodes", True), ("nodes", "2"), ("inter_node_gb_per_s", "10"), ("device_memory_gb", True),
    ("devices_per_node", 2.5),
])
def test_files_are_read_as_strictly_as_the_service_reads_bodies(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str], field: str, value: object) -> None:
    """`true` or `"2"` is a mistake in a file as in a request body (api/body.py): refused with the
    field named, not read as 1 or 2."""
    doc = json.loads(files["cluster"].read_text())
    doc[field] = value
    bad = files["dir"] / "lax.json"
    bad.write_text(json.dumps(doc))
    assert main(["plan", str(files["profile"]), "--cluster", str(bad), "-o",
                 str(files["dir"] / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "not a valid Cluster" in err and field in err
    assert not (files["dir"] / "p.json").exists()
    prof = json.loads(files["profile"].read_text())
    prof["layers"][0]["fwd_ms"] = "1.0"
    files["profile"].write_text(json.dumps(prof))
    assert main(["plan", str(files["profile"]), "--cluster", str(files["cluster"]), "-o",
                 str(files["dir"] / "p.json")]) == 2
    assert "fwd_ms" in capsys.readouterr().err


@pytest.mark.parametrize(("field", "value"), [
    ("allreduce_efficiency", 1e-300), ("inter_node_gb_per_s", 1e-9), ("device_memory_gb", 1e-12),
])
def test_a_tiny_divisor_in_a_cluster_file_is_refused_as_the_service_refuses_it(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str], field: str, value: float) -> None:
    """An outside review: allreduce_efficiency 1e-300 planned on the command line (9.5 ms) and
    was a 422 from the service ("at least 1e-06 when positive"). Both refuse it now, also in the
    cluster a plan file holds; a latency of 1e-7 us stays a number both take."""
    doc = json.loads(files["cluster"].read_text())
    doc[field] = value
    bad = files["dir"] / "tiny.json"
    bad.write_text(json.dumps(doc))
    out = files["dir"] / "p.json"
    assert main(["plan", str(files["profile"]), "--cluster", str(bad), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{field}: {value!r} is too small (at least 1e-06 when positive)" in err, err
    assert not out.exists()
    doc = json.loads(files["cluster"].read_text())
    doc["intra_node_latency_us"] = 1e-7
    bad.write_text(json.dumps(doc))
    assert main(["plan", str(files["profile"]), "--cluster", str(bad), "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    plan["cluster"][field] = value
    out.write_text(json.dumps(plan))
    assert main(["simulate", str(out)]) == 2
    assert "too small" in capsys.readouterr().err


def test_tight_memory_says_what_it_needs(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    prof = files["dir"] / "big.json"
    prof.write_text(chain_profile([1.0] * 4, params=[5 * 10**9] * 4, batch_size=8).model_dump_json())
    rc = main(["plan", str(prof), "--cluster", str(files["cluster"]), "--method", "uniform"])
    err = capsys.readouterr().err
    assert rc == 2 and "GB per device" in err and "Traceback" not in err


@pytest.mark.skipif(not (DATA / "vgg16.txt").is_file(), reason="no PipeDream profiles")
def test_import_pipedream_as_a_process(tmp_path: Path) -> None:
    out = tmp_path / "vgg16.json"
    r = subprocess.run([sys.executable, "-m", "planner", "import-pipedream", str(DATA / "vgg16.txt"),
                        "--batch-size", "128", "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "40 layers" in r.stdout and json.loads(out.read_text())["batch_size"] == 128
    r = subprocess.run([sys.executable, "-m", "planner", "import-pipedream", str(DATA / "vgg16.txt"),
                        "--batch-size", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--batch-size" in r.stderr


def test_hostile_files_and_outputs_are_refused_before_any_work(files: dict[str, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Each a one-line error (exit 2), nothing written: a non-UTF-8 cluster, Infinity, a memory
    whose bytes overflow, two nodes of one name, a device count given as a string, a number of
    5000 digits, JSON nested 100000 deep, an output that
    is a directory or lies under a file or is the input itself, a FIFO, or in a folder no file
    can be made in, a million microbatches, an infinite time limit."""
    d, prof = files["dir"], str(files["profile"])
    base = {"intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10}
    node = {"name": "a", "devices": 2, "device_memory_gb": 16}
    clusters = {
        "latin1": (b'{"nodes": 2, "devices_per_node": 2, "device_memory_gb": 16, "x\xe9": 1}', "not UTF-8"),
        "inf": (b'{"nodes": 2, "devices_per_node": 2, "device_memory_gb": 16, "speed": Infinity, '
                b'"intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10}', "finite"),
        "huge": (json.dumps({"nodes": 2, "devices_per_node": 2, "device_memory_gb": 1e308, **base}).encode(),
                 "device_memory_gb"),
        "dup": (json.dumps({"nodes": [node, node], **base}).encode(), "appears twice"),
        "str": (json.dumps({"nodes": [{**node, "devices": "2"}], **base}).encode(), "devices"),
        "digits": (b'{"nodes": ' + b"9" * 5000 + b"}", "thousands of digits"),
        # json keeps the last of two keys: this planned 64 devices per node without a word
        "dupkey": (b'{"nodes": 1, "devices_per_node": 2, "devices_per_node": 64, "device_memory_gb": 16, '
                   b'"intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10}',
                   "the key 'devices_per_node' appears twice in one object"),
        "deep": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        # refused by the service in a body; the file was read
        "nul": (b'{"nodes": [{"name": "a\\u0000b", "devices": 2, "device_memory_gb": 16}], '
                b'"intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10}', "NUL character"),
    }
    for name, (text, message) in clusters.items():
        path = d / f"{name}.json"
        path.write_bytes(text)
        assert main(["plan", prof, "--cluster", str(path), "-o", str(d / "p.json")]) == 2, name
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (name, err)
    (d / "afile").write_text("x")
    before = files["profile"].read_bytes()
    for out, message in ((d, "is a directory"), (d / "afile" / "p.json", "is a file"),
                         (files["profile"], "is the input"), ("", "an empty path"),
                         (f"{d}/newdir/", "ends in '/', a directory")):  # (it wrote a file 'newdir')
        assert main(["plan", prof, "--cluster", str(files["cluster"]), "--method", "uniform",
                     "-o", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert not (d / "newdir").exists()
    assert files["profile"].read_bytes() == before
    # nor the model file the profile was made from (`-o model.py` replaced the source with JSON)
    source = d / "model.py"
    source.write_text("def build_model(): ...\n")
    of_source = json.loads(before)
    of_source["model"]["path"] = str(source)
    (d / "of_source.json").write_text(json.dumps(of_source))
    for flag in ("-o", "--trace"):
        outs = {"-o": str(d / "p.json"), "--trace": str(d / "t.json"), flag: str(source)}
        assert main(["plan", str(d / "of_source.json"), "--cluster", str(files["cluster"]), "--method",
                     "uniform", *[x for k, v in outs.items() for x in (k, v)]]) == 2
        assert "is the input" in capsys.readouterr().err
    assert source.read_text() == "def build_model(): ...\n"
    fifo = d / "fifo"  # run as root, `-o /dev/null` replaced the system's /dev/null with a file
    os.mkfifo(fifo)
    outs = [(fifo, "not a regular file")]
    if Path("/proc/self").is_dir():  # a folder no file can be made in, even as root
        outs += [(Path("/proc/p.json"), "cannot write in /proc"),
                 (Path("/proc/none/p.json"), "cannot write in /proc")]
    for out, message in outs:
        assert main(["plan", prof, "--cluster", str(files["cluster"]), "-o", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert fifo.is_fifo()
    if Path("/proc/self").is_dir():  # a rank that does not write the file does not try the folder
        from planner.io import check_output

        check_output("/proc/p.json", probe=False)
    for args, message in ((["--global-batch", "4000000", "--microbatch-size", "4"], "at most 100000"),
                          (["--time-limit", "inf"], "finite")):
        assert main(["plan", prof, "--cluster", str(files["cluster"]), "-o", str(d / "p.json"), *args]) == 2
        assert message in capsys.readouterr().err
    assert not (d / "p.json").exists() and not list(d.glob("*.tmp"))


def test_simulate_refuses_an_incomplete_or_negative_plan(files: dict[str, Path],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A plan edited by hand: a rank's last backward gone (it simulated faster than the whole
    plan), a negative predicted time, sends to a stage that is not later (an IndexError, or
    Python's negative index read as the last stage), sends that are not a list."""
    out = files["dir"] / "plan.json"
    assert main(["plan", str(files["profile"]), "--cluster", str(files["cluster"]), "--global-batch",
                 "32", "--microbatch-size", "4", "--method", "uniform", "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    cut = json.loads(json.dumps(plan))
    rank = next(iter(cut["rank_actions"]))
    cut["rank_actions"][rank] = cut["rank_actions"][rank][:-1]
    neg = json.loads(json.dumps(plan))
    neg["stages"][0]["predicted"]["fwd_ms"] = -1.0
    far = json.loads(json.dumps(plan))  # a send to a stage the plan does not have
    far["stages"][0]["predicted"]["sends"] = [{"to": 99, "bytes": 1.0, "ms": 1.0}]
    back = json.loads(json.dumps(plan))  # the simulator read `to: -1` as the last stage
    back["stages"][-1]["predicted"]["sends"] = [{"to": 0, "bytes": 1.0, "ms": 1.0}]
    negms = json.loads(json.dumps(plan))  # accepted: 24 ms instead of 30
    negms["stages"][0]["predicted"]["sends"] = [{"to": 1, "bytes": 1.0, "ms": -100.0}]
    static = json.loads(json.dumps(plan))  # a ValueError inside the simulator
    static["stages"][0]["predicted"]["static_memory_bytes"] = "abc"
    text = json.loads(json.dumps(plan))  # a type the simulator indexed into
    text["stages"][0]["predicted"]["sends"] = "x"
    many = json.loads(json.dumps(plan))  # 10**6 microbatches simulated for 100 s in 2.8 GB
    many.update(num_microbatches=10**6, microbatch_size=1, global_batch=10**6)
    for name, edited, message in (("cut", cut, "invalid schedule"),
                                  ("neg", neg, "predicted.fwd_ms: Input should be greater than or equal to 0"),
                                  ("far", far, "stage 0 sends to stage 99"),
                                  ("back", back, "sends only to later ones (none: it is the last stage)"),
                                  ("text", text, "sends: str, not a list of {to, bytes, ms}"),
                                  ("negms", negms, "sends[0].ms: -100.0 is not a number of 0 or more"),
                                  ("static", static, "static_memory_bytes: 'abc' is not a number of 0 or more"),
                                  ("many", many, "at most 100000 are planned, simulated or run")):
        path = files["dir"] / f"{name}.json"
        path.write_text(json.dumps(edited))
        capsys.readouterr()
        assert main(["simulate", str(path)]) == 2, name
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (name, err)


def test_serve_refuses_a_database_it_cannot_open(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before the server starts (it printed its address, then logged a traceback and exit 3)."""
    (tmp_path / "notes.txt").write_text("not a database")
    os.mkfifo(tmp_path / "fifo")  # (`--db /dev/zero` left a /dev/zero-journal behind)
    for db, message in ((tmp_path, "is a directory"), (tmp_path / "no" / "x.db", "does not exist"),
                        (tmp_path / "notes.txt", "cannot be opened as an SQLite database"),
                        (tmp_path / "fifo", "is not a regular file"),
                        (":memory:", "in-memory database is not shared"),  # each thread its own
                        ("postgresql://h/db", "not at a URL"), ("", "--db is empty")):
        assert main(["serve", "--port", "1", "--db", str(db)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_serve_refuses_a_database_another_server_uses(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A second server on the same file marked the first one's live jobs lost at its start."""
    from api.storage import lock_database

    db = str(tmp_path / "p.db")
    held = lock_database(db)  # what a running server holds
    assert held is not None
    try:
        assert main(["serve", "--port", "1", "--db", db]) == 2
        err = capsys.readouterr().err
        assert f"another pipeplan server (pid {os.getpid()})" in err and "Traceback" not in err, err
    finally:
        held.close()
    again = lock_database(db)  # released with its file: the next server starts
    assert again is not None
    again.close()


def test_serve_refuses_a_database_in_use_under_another_name(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The lock was `<db path as typed>.lock`: a symbolic link, a hard link or a deleted lock
    file let a second server start on a live database and mark its jobs lost."""
    from api.storage import lock_database

    db = tmp_path / "p.db"
    held = lock_database(str(db))  # a new database: created, so its inode is locked too
    assert held is not None and db.exists()
    (tmp_path / "alias.db").symlink_to(db)
    os.link(db, tmp_path / "hard.db")
    try:
        for other in ("alias.db", "hard.db"):
            assert main(["serve", "--port", "1", "--db", str(tmp_path / other)]) == 2
            err = capsys.readouterr().err
            assert f"another pipeplan server (pid {os.getpid()})" in err and "Traceback" not in err, err
        os.unlink(str(db) + ".lock")
        assert main(["serve", "--port", "1", "--db", str(db)]) == 2
        assert "another pipeplan server" in capsys.readouterr().err
    finally:
        held.close()
    again = lock_database(str(tmp_path / "hard.db"))
    assert again is not None
    again.close()


def test_serve_refuses_an_address_it_cannot_listen_on(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Before the server starts (uvicorn logged 7-8 lines and exited 3)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--db", str(tmp_path / "a.db")]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve", "--host", "999.1.1.1", "--db", str(tmp_path / "a.db")]) == 2
    assert "--host 999.1.1.1: not an address" in capsys.readouterr().err
    # one problem, one line (it was "bad server settings:" and the problem below it)
    for flag, value, field in (("--port", "99999", "port"), ("--workers", "0", "workers")):
        assert main(["serve", flag, value, "--db", str(tmp_path / "a.db")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: bad server settings: {field}: ") and "\n" not in err, err


def test_plan_refuses_more_layers_than_it_plans(files: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """(20,000 layers took 11 GB and growing before any error.)"""
    monkeypatch.setenv("PIPEPLAN_MAX_LAYERS", "5")
    rc = main(["plan", str(files["profile"]), "--cluster", str(files["cluster"]), "--global-batch", "16",
               "-o", str(files["dir"] / "plan.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "has 6 layers; the planner plans at most 5" in err and "--granularity" in err
    assert not (files["dir"] / "plan.json").exists()
    # an imported PipeDream graph has no granularity to coarsen: the advice says what applies
    imported = files["dir"] / "imported.json"
    imported.write_text(json.dumps({**json.loads(files["profile"].read_text()), "source": "pipedream"}))
    rc = main(["plan", str(imported), "--cluster", str(files["cluster"]), "--global-batch", "16",
               "-o", str(files["dir"] / "plan.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "imported from PipeDream" in err and "--granularity" not in err, err


def test_error_excerpts_end_on_a_whole_word() -> None:
    """A long exception message in a one-line error is cut after a whole word with an
    ellipsis (it was cut mid-word: "a second time o while it was timed")."""
    from planner.errors import first_line

    assert first_line("short\nsecond line") == "short"
    cut = first_line("word " * 100, 40)
    assert cut.endswith("word …") and len(cut) <= 42
    assert first_line("x" * 50, 40) == "x" * 40 + " …"


def test_numbers_too_large_to_compute_with_are_named_never_written(files: dict[str, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A profile time of 1e308 is refused where it is read, naming the field; a profile whose
    plan would predict more than 1e15 ms gets no plan file (one pipeplan could not read back);
    a seed beyond 2**53 is refused by the option itself."""
    d = files["dir"]
    base = json.loads(files["profile"].read_text())
    cases = {"huge": (1e308, "layers.1.fwd_ms: 1e+308 is out of range"),
             "large": (9e14, "not written: stages.0.predicted")}
    for name, (value, message) in cases.items():
        prof = json.loads(json.dumps(base))
        for k, layer in enumerate(prof["layers"]):
            if name == "large" or k == 1:
                layer["fwd_ms"] = value
        path = d / f"{name}.json"
        path.write_text(json.dumps(prof))
        out = d / f"{name}.plan.json"
        assert main(["plan", str(path), "--cluster", str(files["cluster"]), "--global-batch", "32",
                     "--microbatch-size", "4", "-o", str(out)]) == 2, name
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (name, err)
        assert not out.exists() and not list(d.glob("*.tmp"))
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(files["profile"]), "--cluster", str(files["cluster"]), "--seed", str(10**30),
              "-o", str(d / "p.json")])
    assert exc.value.code == 2
    assert "give a seed from 0 to" in capsys.readouterr().err


def test_a_file_of_another_kind_is_named_as_such(files: dict[str, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A profile where the plan or the cluster goes, a cluster where the profile goes: one line
    saying which file it is (it listed six "Field required" lines)."""
    prof, cl = str(files["profile"]), str(files["cluster"])
    out = str(files["dir"] / "p.json")
    for argv, message in ((["simulate", prof], "this file is a profile, not a plan"),
                          (["plan", prof, "--cluster", prof, "-o", out], "this file is a profile, not a cluster"),
                          (["plan", cl, "--cluster", cl, "-o", out], "this file is a cluster description, not a profile")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Field required" not in err, err


def test_small_times_in_the_plan_summary_keep_their_digits() -> None:
    """A work bound of 0.004 ms (a tiny model over 60,000 devices) printed as "0.00 ms"."""
    from planner.report_table import _ms

    assert [_ms(x) for x in (0.0043, 12.345, 0.0, 0.01)] == ["0.0043", "12.35", "0.00", "0.01"]


def test_the_inode_lock_never_follows_a_link_nor_stops_a_server(tmp_path: Path) -> None:
    """The inode's lock file lived in the shared temporary folder under a predictable name: a
    link planted there made the server write its pid into the link's target, a folder there
    kept it from starting, and no usable temporary folder stopped it too. It is now a hidden
    file in the database's folder, opened without following links; one that cannot be made is
    no lock, not an error."""
    from api.storage import lock_database

    db = tmp_path / "p.db"
    db.touch()
    st = db.stat()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    name = tmp_path / f".pipeplan-db-{st.st_dev}-{st.st_ino}.lock"
    name.symlink_to(victim)
    held = lock_database(str(db))
    assert held is not None
    held.close()
    assert victim.read_text() == "keep me" and name.is_symlink()
    name.unlink()
    name.mkdir()
    held = lock_database(str(db))
    assert held is not None
    held.close()
    name.rmdir()
    held = lock_database(str(db))  # the normal case: the hidden file while held, gone after
    assert held is not None and name.is_file()
    held.close()
    assert not name.exists()


def test_an_empty_microbatch_size_is_refused(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """`--microbatch-sizes 4,,8` was read as 4,8."""
    with pytest.raises(SystemExit) as exc:
        main(["plan", str(files["profile"]), "--cluster", str(files["cluster"]), "--microbatch-sizes", "4,,8"])
    assert exc.value.code == 2 and "expected comma-separated integers, got '4,,8'" in capsys.readouterr().err


def _as_another_user() -> list[str] | None:
    """The command prefix that runs a process as a user who is not root (root reads every
    file); None where there is none to be."""
    import shutil

    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_an_input_that_cannot_be_read_is_a_clear_error() -> None:
    """An input without read permission, or in a folder without search permission, was a
    traceback (PermissionError) with exit 1, and the folder case blamed -o (an outside review)."""
    import shutil
    import tempfile

    prefix = _as_another_user()
    if prefix is None:
        pytest.skip("running as root without setpriv: every file is readable")
    root = Path(tempfile.mkdtemp(prefix="pipeplan_perm_", dir="/tmp"))
    try:
        root.chmod(0o777)
        cl = root / "cluster.json"
        cl.write_text(json.dumps({"nodes": 1, "devices_per_node": 2, "device_memory_gb": 16,
                                  "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10}))
        prof = root / "profile.json"
        prof.write_text(chain_profile([1.0, 2.0], batch_size=8).model_dump_json())
        closed = root / "closed"
        closed.mkdir()
        shutil.copy(prof, closed / "profile.json")
        for p in (cl, prof):
            p.chmod(0o644)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HOME": str(root)}
        cases = [(["plan", str(root / "unread.json"), "--cluster", str(cl)], root / "unread.json"),
                 (["plan", str(closed / "profile.json"), "--cluster", str(cl)], closed / "profile.json"),
                 (["plan", str(prof), "--cluster", str(root / "unread.json")], root / "unread.json"),
                 (["import-pipedream", str(root / "unread.json"), "--batch-size", "8"], root / "unread.json")]
        shutil.copy(prof, root / "unread.json")
        (root / "unread.json").chmod(0o600)
        if os.geteuid() != 0:
            (root / "unread.json").chmod(0o000)
        closed.chmod(0o700 if os.geteuid() == 0 else 0o000)
        for args, blamed in cases:
            out = root / "out" / "plan.json"
            r = subprocess.run([*prefix, sys.executable, "-m", "planner", *args, "-o", str(out)],
                               capture_output=True, text=True, env=env, timeout=120)
            assert r.returncode == 2, (args, r.returncode, r.stderr[-800:])
            assert "Traceback" not in r.stderr and "cannot be read (Permission denied)" in r.stderr, r.stderr
            assert str(blamed) in r.stderr and "-o" not in r.stderr.split("cannot be read")[0], r.stderr
            assert not out.exists()
    finally:
        for p in (root, root / "closed"):
            if p.exists():
                p.chmod(0o777)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("argv", [["plan", "p.json", "--cluster", "c.json", "--seed", "-1"],
                                  ["plan", "p.json", "--cluster", "c.json", "--microbatch-sizes", "0"],
                                  ["plan"], []])
def test_a_bad_option_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """An outside review: an option argparse refuses printed the usage, a dozen lines, before
    the line saying what is wrong; every other bad input is one line (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: pipeplan") and "--help lists the options" in err
