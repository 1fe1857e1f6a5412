from pathlib import Path

import pytest

from planner.errors import PipeplanError
from planner.formats import INPUT_NODE
from planner.importers.pipedream import import_pipedream, import_pipedream_file, parse_graph

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "pipedream-profiles"
FILES = sorted(p for p in DATA.glob("*.txt") if p.name != "LICENSE.txt") if DATA.is_dir() else []


@pytest.mark.skipif(not FILES, reason="no PipeDream profiles in ../shared/data")
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_profile_imports_with_its_dag(path: Path) -> None:
    profile = import_pipedream_file(path, 64)
    nodes, edges = parse_graph(path.read_text())
    inputs = {n for n, v in nodes.items() if v["desc"].startswith("Input")}
    assert len(profile.layers) == len(nodes) - len(inputs)
    assert len(profile.edges) == len([e for e in edges if e[1] not in inputs])
    idx = profile.layer_index()
    for e in profile.edges:  # topological (the Profile validator also checks this)
        assert e.src == INPUT_NODE or idx[e.src] < idx[e.dst]
    # input nodes carry data-loading time (alexnet: 636 ms), which is not model compute
    total = sum(v["fwd_ms"] + v["bwd_ms"] for n, v in nodes.items() if n not in inputs)
    assert sum(x.fwd_ms + x.bwd_ms for x in profile.layers) == pytest.approx(total)
    assert all(x.activation_bytes == x.output_bytes for x in profile.layers)
    assert "output" in profile.activation_estimate


def test_multi_output_sizes_sum_and_inputs_become_model_inputs() -> None:
    text = (
        "node2 -- LSTM(4, 4) -- forward_compute_time=1.0, backward_compute_time=2.0, "
        "activation_size=[10.0; 5.0], parameter_size=8.000\n"
        "node1 -- Input0 -- forward_compute_time=0.0, backward_compute_time=0.0, "
        "activation_size=7.0, parameter_size=0.0\n"
        "node3 -- Linear -- forward_compute_time=1.0, backward_compute_time=1.0, "
        "activation_size=3.0, parameter_size=4.0\n"
        "\tnode1 -- node2\n\tnode2 -- node3\n\tnode1 -- node3\n"
    )
    p = import_pipedream(text, 16)
    assert [x.name for x in p.layers] == ["node2", "node3"]
    assert p.layers[0].output_bytes == 15 and p.layers[0].param_bytes == 8
    assert {(e.src, e.dst, e.bytes) for e in p.edges} == {
        (INPUT_NODE, "node2", 7), (INPUT_NODE, "node3", 7), ("node2", "node3", 15)}


def test_bad_files_say_what_is_wrong() -> None:
    with pytest.raises(PipeplanError, match="not a PipeDream node or edge line"):
        import_pipedream("hello world\n", 1)
    with pytest.raises(PipeplanError, match="unknown node"):
        import_pipedream("node1 -- X -- forward_compute_time=1, backward_compute_time=1, "
                         "activation_size=1, parameter_size=1\n\tnode1 -- node9\n", 1)
    line = ("node1 -- X -- forward_compute_time=1, backward_compute_time=1, activation_size=1, "
            "parameter_size=1\n")
    with pytest.raises(PipeplanError, match=r":2: node node1 appears twice"):
        import_pipedream(line + line.replace("forward_compute_time=1", "forward_compute_time=9"), 1)
    for size in ("activation_size=nan", "parameter_size=inf", "activation_size=[1e400; 1]"):
        key = size.split("=")[0]
        bad = line.replace(f"{key}=1", size)
        with pytest.raises(PipeplanError, match=r":1: activation_size or parameter_size is not a finite"):
            import_pipedream(bad, 1)


def test_a_file_that_is_not_text_is_a_clear_error(tmp_path: Path) -> None:
    from planner.importers.pipedream import import_pipedream_file

    path = tmp_path / "graph.txt"
    path.write_bytes(b"node1 -- X\xff\xfe -- forward_compute_time=1\n")
    with pytest.raises(PipeplanError, match="not UTF-8"):
        import_pipedream_file(path, 1)


def _node(nid: str, desc: str = "Linear", f: str = "1.0", size: str = "4.0", params: str = "2.0") -> str:
    return (f"{nid} -- {desc} -- forward_compute_time={f}, backward_compute_time={f}, "
            f"activation_size={size}, parameter_size={params}\n")


# the layout PipeDream writes: every node (not in graph order), then every edge
SMALL = (_node("node3") + _node("node1", "Input0") + _node("node2") + _node("node4")
         + "\tnode3 -- node4\n\tnode1 -- node2\n\tnode2 -- node3\n")


def test_a_file_cut_at_a_line_boundary_is_refused_naming_the_node() -> None:
    assert len(import_pipedream(SMALL, 1).layers) == 3
    lines = SMALL.splitlines(keepends=True)
    with pytest.raises(PipeplanError, match=r"4 nodes but no edge lines \(the last node read is node4\); "
                                            "the file looks truncated"):
        import_pipedream("".join(lines[:4]), 1)  # cut before the edges: no chain may be made up
    with pytest.raises(PipeplanError, match=r"node node3 \(Linear\) is not an Input node but has no "
                                            "incoming edge; the file looks truncated"):
        import_pipedream("".join(lines[:6]), 1)  # the edge into node3 is lost
    with pytest.raises(PipeplanError, match=r"only input nodes \(node1\), no layers; the file looks truncated"):
        import_pipedream(_node("node1", "Input0"), 1)


def test_real_graphs_sources_and_sinks_that_are_not_truncation_still_import() -> None:
    """GNMT's initial `hidden` state has no incoming edge but carries nothing; unused outputs
    (GNMT's `__getitem__(1)`) and auxiliary classifiers (Inception, NASNet) are sinks."""
    text = (_node("node1", "Input0") + _node("node2") + _node("node5", "hidden", "0.000", "0.0", "0.000")
            + _node("node3", "__getitem__(1)", "0.0", "8.0", "0.0") + _node("node4", "Linear aux")
            + _node("node6") + "\tnode1 -- node2\n\tnode2 -- node3\n\tnode2 -- node4\n\tnode2 -- node6\n"
            "\tnode5 -- node6\n")
    p = import_pipedream(text, 1)
    assert [x.name for x in p.layers] == ["node2", "node5", "node3", "node4", "node6"]
    with pytest.raises(PipeplanError, match="node node5 .* has no incoming edge"):  # it has a cost
        import_pipedream(text.replace("hidden -- forward_compute_time=0.000", "hidden -- forward_compute_time=1"), 1)


@pytest.mark.skipif(not (DATA / "alexnet.txt").is_file(), reason="no PipeDream profiles in ../shared/data")
@pytest.mark.parametrize(("lines", "message"), [
    (10, "10 nodes but no edge lines"), (35, r"node node10 \(Conv2d.*\(and 10 more\)")])
def test_a_truncated_real_profile_is_refused(lines: int, message: str) -> None:
    text = "".join((DATA / "alexnet.txt").read_text().splitlines(keepends=True)[:lines])
    with pytest.raises(PipeplanError, match=message + ".*the file looks truncated or incomplete"):
        import_pipedream(text, 1)


def test_a_byte_order_mark_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "graph.txt"
    path.write_bytes(b"\xef\xbb\xbf" + SMALL.encode())
    p = import_pipedream_file(path, 1)
    assert [x.name for x in p.layers] == ["node2", "node3", "node4"] and len(p.edges) == 3


@pytest.mark.parametrize("value", ["1_000", "1_0.5", "\uff11.0", "\u0663"])  # float() takes them all
def test_numbers_other_than_plain_decimal_are_refused_with_the_line(value: str) -> None:
    text = SMALL.replace("node4 -- Linear -- forward_compute_time=1.0", f"node4 -- Linear -- forward_compute_time={value}")
    assert value in text
    with pytest.raises(PipeplanError, match=rf":4: '{value}' is not a plain decimal number"):
        import_pipedream(text, 1)
    for ok in ("1000", "+1.5e3", "2.", ".5", "1E-3"):  # what the profiler and hand edits write
        assert import_pipedream(SMALL.replace("forward_compute_time=1.0", f"forward_compute_time={ok}"), 1)
