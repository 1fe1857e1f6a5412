"""Import PipeDream's per-layer GPU profiles (msr-fiddle/pipedream `graph.txt`) as pipeplan
profiles, their DAGs included.

Format, one line per node, then one line per edge:
    nodeID -- description -- forward_compute_time=F, backward_compute_time=B, activation_size=A, parameter_size=P
    \\tnodeX -- nodeY
Times are ms per minibatch, sizes bytes; `activation_size` is the size of the node's output
(`[a; b; c]` for several outputs, summed). PipeDream records output sizes only, so the imported
`activation_bytes` (bytes kept for backward) is estimated as the output size; the profile says
so in its `activation_estimate` field. `Input*` nodes become model inputs (`<input>` edges).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import re
from pathlib import Path

from planner.errors import PipeplanError
from planner.formats import INPUT_NODE, Profile
from planner.io import cannot_read, is_readable_file, not_a_file, parse_model

_NODE = re.compile(
    r"^(?P<id>\S+) -- (?P<desc>.*) -- forward_compute_time=(?P<f>[^,]+), "
    r"backward_compute_time=(?P<b>[^,]+), activation_size=(?P<a>\[[^\]]*\]|[^,]+), "
    r"parameter_size=(?P<p>\S+)\s*$")
_EDGE = re.compile(r"^\s+(?P<src>\S+) -- (?P<dst>\S+)\s*$")


# A plain decimal or scientific number, as PipeDream's profiler writes them. float() also takes
# "1_000", padded or non-ASCII digits; a file carrying those was not written by the profiler, so
# guessing their value would hide the damage. nan and inf pass here so that the finiteness checks
# (below for sizes, the Profile's for times) report them by name.
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:nan|inf|infinity)",
                     re.IGNORECASE | re.ASCII)


def _number(text: str) -> float:
    """`text` as a float; ValueError naming it unless it is a plain decimal/scientific number."""
    if not _NUMBER.fullmatch(text.strip()):
        raise ValueError(text.strip())
    return float(text)


def _size(text: str) -> float:
    text = text.strip()
    if text.startswith("["):
        return sum(_number(x) for x in text.strip("[]").split(";") if x.strip())
    return _number(text)


def parse_graph(text: str, where: str = "graph") -> tuple[dict[str, dict], list[tuple[str, str]]]:
    """Nodes (id -> fields) in file order and edges (src, dst)."""
    nodes: dict[str, dict] = {}
    edges: list[tuple[str, str]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if m := _EDGE.match(line):
            edges.append((m["src"], m["dst"]))
            continue
        m = _NODE.match(line)
        if not m:
            raise PipeplanError(f"{where}:{lineno}: not a PipeDream node or edge line: {line[:80]!r}")
        if m["id"] in nodes:
            raise PipeplanError(f"{where}:{lineno}: node {m['id']} appears twice (the file is "
                                "damaged or two graphs were joined): give the graph.txt its profiler wrote")
        try:
            nodes[m["id"]] = {"desc": m["desc"].strip(), "fwd_ms": _number(m["f"]), "bwd_ms": _number(m["b"]),
                              "output_bytes": _size(m["a"]), "param_bytes": _number(m["p"])}
        except ValueError as exc:
            raise PipeplanError(f"{where}:{lineno}: {str(exc)!r} is not a plain decimal number (like 1000 or "
                                f"1.5e3); give the graph.txt its profiler wrote: {line[:80]!r}") from None
        if not all(math.isfinite(nodes[m["id"]][k]) for k in ("output_bytes", "param_bytes")):
            raise PipeplanError(f"{where}:{lineno}: activation_size or parameter_size is not a finite "
                                f"number (nan, inf, or too large): {line[:80]!r}")
    for src, dst in edges:
        for x in (src, dst):
            if x not in nodes:
                raise PipeplanError(f"{where}: edge {src} -- {dst} names unknown node {x}")
    if not nodes:
        raise PipeplanError(f"{where}: no nodes found; is this a PipeDream graph.txt?")
    return nodes, list(dict.fromkeys(edges))


def _carries_nothing(node: dict) -> bool:
    return node["fwd_ms"] == node["bwd_ms"] == node["output_bytes"] == node["param_bytes"] == 0


def check_complete(nodes: dict[str, dict], edges: list[tuple[str, str]], where: str) -> None:
    """Refuse a graph that looks cut short. PipeDream writes every node, then every edge, so a
    file truncated at a line boundary still parses but has no edges, or non-input nodes whose
    incoming edges were lost; read as they are, those become made-up chains and free-floating
    layers, and plans for them are far off. Real graphs do have other sources and sinks: GNMT's
    initial `hidden` state has no incoming edge (it carries nothing: no time, size or
    parameters, which is what lets it through), and sinks are normal (GNMT's unused
    `__getitem__` outputs, Inception's and NASNet's auxiliary classifiers), so dangling outputs
    are not refused: no rule tells an auxiliary classifier from a layer whose consumer was cut.
    Nor is a cut that only loses one of a node's several inputs (ResNet-101 without its last
    edge line, a residual edge into an Add): the graph left is a plausible one."""
    again = "the file looks truncated or incomplete; give the whole graph.txt its profiler wrote"
    if len(nodes) > 1 and not edges:
        raise PipeplanError(f"{where}: {len(nodes)} nodes but no edge lines (the last node read is "
                            f"{next(reversed(nodes))}); {again}")
    if all(is_input(v) for v in nodes.values()):
        raise PipeplanError(f"{where}: only input nodes ({', '.join(nodes)}), no layers; {again}")
    has_in = {d for _, d in edges}
    orphans = [n for n, v in nodes.items() if n not in has_in and not is_input(v) and not _carries_nothing(v)]
    if orphans:
        n, desc = orphans[0], nodes[orphans[0]]["desc"]
        desc = desc if len(desc) <= 30 else desc[:29] + "…"
        more = f" (and {len(orphans) - 1} more)" if len(orphans) > 1 else ""
        raise PipeplanError(f"{where}: node {n} ({desc}){more} is not an Input node but has no incoming "
                            f"edge; {again}")


def _topological(nodes: dict[str, dict], edges: list[tuple[str, str]], where: str) -> list[str]:
    """Kahn's algorithm; among ready nodes the one first in the file goes first."""
    order = {n: i for i, n in enumerate(nodes)}
    indeg = dict.fromkeys(nodes, 0)
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for s, d in edges:
        succ[s].append(d)
        indeg[d] += 1
    ready = [(order[n], n) for n, k in indeg.items() if k == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(n)
        for d in succ[n]:
            indeg[d] -= 1
            if indeg[d] == 0:
                heapq.heappush(ready, (order[d], d))
    if len(out) != len(nodes):
        raise PipeplanError(f"{where}: the graph has a cycle; PipeDream graphs are DAGs")
    return out


def is_input(node: dict) -> bool:
    return node["desc"].startswith("Input")


def import_pipedream(text: str, batch_size: int, source: str = "graph.txt") -> Profile:
    """A pipeplan Profile from the text of a PipeDream graph file profiled at `batch_size`."""
    nodes, edges = parse_graph(text, source)
    check_complete(nodes, edges, source)
    order = [n for n in _topological(nodes, edges, source) if not is_input(nodes[n])]
    layers = [{
        "name": n, "kind": nodes[n]["desc"], "fwd_ms": nodes[n]["fwd_ms"], "bwd_ms": nodes[n]["bwd_ms"],
        "param_bytes": round(nodes[n]["param_bytes"]), "output_bytes": round(nodes[n]["output_bytes"]),
        "activation_bytes": round(nodes[n]["output_bytes"]),
    } for n in order]
    out_edges = []
    for s, d in edges:
        if is_input(nodes[d]):
            continue
        if is_input(nodes[s]):
            out_edges.append({"src": INPUT_NODE, "dst": d, "bytes": round(nodes[s]["output_bytes"]),
                              "tensor": s})
        else:
            out_edges.append({"src": s, "dst": d, "bytes": round(nodes[s]["output_bytes"])})
    data = {
        "model": {"path": source, "sha256": hashlib.sha256(text.encode()).hexdigest()},
        "device": {"type": "gpu", "name": "pipedream-profile"},
        "batch_size": batch_size, "dtype": "float32", "layers": layers, "edges": out_edges,
        "source": "pipedream",
        "activation_estimate": "output_bytes: PipeDream records each node's output size only; "
                               "activation_bytes is that size",
    }
    return parse_model(data, Profile, source)


def import_pipedream_file(path: str | Path, batch_size: int) -> Profile:
    path = Path(path)
    if not is_readable_file(path):
        raise PipeplanError(f"{path}: {not_a_file(path)}; give a PipeDream graph.txt")
    try:
        # utf-8-sig drops a byte-order mark (editors on Windows add one), which would
        # otherwise become part of the first node's id
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise PipeplanError(f"{path}: not a PipeDream graph.txt (not UTF-8 text: byte {exc.start}); "
                            "give the graph.txt its profiler wrote") from None
    except OSError as exc:
        raise PipeplanError(cannot_read(path, exc)) from None
    return import_pipedream(text, batch_size, str(path))
