"""The layer graph and its stages: layers, edges and cut bytes against brute force, and
stages that reproduce the whole model's forward and gradients exactly."""

from __future__ import annotations

import random

import pytest
import torch
from profiler_helpers import load_example, run_pipeline

from planner.formats import INPUT_NODE
from profiler.graph import build_stage, trace


def _setup(name: str, env: dict[str, str], batch: int = 2, **extra: str):
    mf = load_example(name, **{**env, **extra})
    torch.manual_seed(0)
    ref = mf.build_model()
    torch.manual_seed(0)
    model = mf.build_model()
    torch.manual_seed(1)
    inputs, target = mf.make_batch(batch)
    return mf, ref, model, inputs, target


def _cut(names: list[str], sizes: list[int]) -> list[list[str]]:
    """The layer names in consecutive stages of `sizes` layers each."""
    parts, i = [], 0
    for s in sizes:
        parts.append(names[i:i + s])
        i += s
    return parts


def _partitions(n: int, rng: random.Random) -> list[list[int]]:
    """Every layer alone, everything in one stage, and a few random contiguous splits."""
    out = [[1] * n, [n]]
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 3))))
        bounds = [0, *cuts, n]
        out.append([b - a for a, b in zip(bounds, bounds[1:], strict=False)])
    return out


@pytest.mark.parametrize("name,extra", [("mlp", {}), ("gpt", {}), ("gpt", {"PIPEPLAN_GPT_TIED": "1"}),
                                        ("unet", {})])
def test_stages_reproduce_forward_and_gradients_exactly(small_env, name, extra) -> None:
    mf, ref, model, inputs, target = _setup(name, small_env, **extra)
    ref_out = ref(*inputs)
    mf.loss_fn(ref_out, target).backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False)}
    lg = trace(model, inputs)
    names = lg.layer_names()
    rng = random.Random(0)
    for sizes in _partitions(len(names), rng):
        model.zero_grad(set_to_none=True)
        parts = _cut(names, sizes)
        out, _, stages = run_pipeline(lg, parts, inputs, target, mf.loss_fn)
        assert torch.equal(out, ref_out), sizes
        keys = set()
        for st in stages.values():
            for k, p in st.named_parameters(remove_duplicate=False):
                keys.add(k)
                assert p.grad is not None and torch.equal(p.grad, ref_grads[k]), (sizes, k)
        merged = {}
        for st in stages.values():
            merged.update(st.state_dict())
        full = lg.complete_state_dict(merged)
        assert set(full) == set(ref.state_dict())
        fresh = mf.build_model()
        fresh.load_state_dict(full)  # strict


def test_stage_holds_only_its_layers_parameters(small_env) -> None:
    mf, _, model, inputs, _ = _setup("gpt", small_env)
    lg = trace(model, inputs)
    st = build_stage(lg, ["blocks.1"])
    assert set(st.state_dict()) == {f"blocks.1.{k}" for k in model.blocks[1].state_dict()}
    assert st.input_keys and st.output_keys and "<output>" not in st.output_keys
    last = build_stage(lg, lg.layer_names()[-1:])
    assert last.output_keys == ["<output>"]


def test_gpt_layers_are_embedding_blocks_head_and_tied_weight_is_shared(small_env) -> None:
    mf, _, model, inputs, _ = _setup("gpt", small_env, PIPEPLAN_GPT_TIED="1")
    lg = trace(model, inputs)
    assert lg.layer_names() == ["tok_emb+pos_emb", "blocks.0", "blocks.1", "ln_f+head"]
    assert len(lg.shared_parameters) == 1
    sp = lg.shared_parameters[0]
    assert set(sp.keys) == {"tok_emb.weight", "head.weight"}
    assert sp.layers == ["tok_emb+pos_emb", "ln_f+head"]


def test_unet_skip_edges_carry_the_encoder_features(small_env) -> None:
    mf, _, model, inputs, _ = _setup("unet", small_env, batch=3)
    lg = trace(model, inputs)
    assert lg.layer_names() == ["stem", "down.0", "down.1", "mid", "up.0", "up.1", "head"]
    b, ch, size = 3, 4, 8  # SMALL_ENV: CH=4, SIZE=8, DEPTH=2
    # skip connections: stem -> up.1 (full resolution, CH channels), down.0 -> up.0 (half, 2CH)
    skip = {(e.src, e.dst): e.bytes for e in lg.edges()}
    assert skip[("stem", "up.1")] == b * ch * size * size * 4
    assert skip[("down.0", "up.0")] == b * 2 * ch * (size // 2) ** 2 * 4
    assert lg.graph.has_edge("stem", "up.1") and lg.graph.edges["stem", "up.1"]["bytes"] == skip[("stem", "up.1")]


@pytest.mark.parametrize("name", ["mlp", "gpt", "unet"])
def test_cut_bytes_equal_bytes_actually_crossing(small_env, name) -> None:
    """Brute force: split the model after layer i, run both halves, and add up the bytes of
    every tensor the first half hands to the second."""
    from planner.formats import DeviceInfo, LayerProfile, ModelRef, Profile

    mf, _, model, inputs, _ = _setup(name, small_env)
    lg = trace(model, inputs)
    names = lg.layer_names()
    profile = Profile(
        model=ModelRef(path="x", sha256="0"), device=DeviceInfo(type="cpu", name="cpu"), batch_size=2,
        layers=[LayerProfile(name=n, fwd_ms=0, bwd_ms=0, param_bytes=0, activation_bytes=0, output_bytes=0)
                for n in names],
        edges=[e for e in lg.edges() if e.src != INPUT_NODE],
    )
    expected = []
    for i in range(len(names) - 1):
        first, second = build_stage(lg, names[: i + 1]), build_stage(lg, names[i + 1:])
        values = {f"<input>:{j}": t for j, t in enumerate(inputs)}
        with torch.no_grad():
            out = first({k: values[k] for k in first.input_keys})
        crossing = [k for k in second.input_keys if not k.startswith("<input>")]
        assert set(crossing) <= set(out)
        expected.append(sum(out[k].numel() * out[k].element_size() for k in crossing))
    assert profile.cut_bytes() == expected
    assert lg.cut_bytes() == expected


@pytest.mark.parametrize("granularity", ["modules", "depth:1", "depth:2"])
def test_other_granularities_reproduce_the_model(small_env, granularity) -> None:
    mf, ref, model, inputs, target = _setup("gpt", small_env)
    lg = trace(model, inputs, granularity=granularity)
    names = lg.layer_names()
    if granularity == "depth:1":
        assert names == ["tok_emb", "pos_emb", "blocks", "ln_f", "head"]
    if granularity == "modules":
        assert "blocks.0.attn.q" in names and "blocks.0.mlp.0" in names
    out, _, _ = run_pipeline(lg, [[n] for n in names], inputs, target, mf.loss_fn)
    assert torch.equal(out, ref(*inputs))


def test_bad_granularity_is_a_clear_error(small_env) -> None:
    from planner.errors import PipeplanError

    _, _, model, inputs, _ = _setup("mlp", small_env)
    with pytest.raises(PipeplanError, match="granularity"):
        trace(model, inputs, granularity="tiny")


def test_tracing_leaves_batchnorm_statistics_untouched() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trace(model, (torch.randn(6, 4),), granularity="modules")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_untraceable_submodule_becomes_part_of_one_layer() -> None:
    """Data-dependent control flow inside a block: fx makes that module a leaf and goes on."""

    class Gate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            return y if y.sum() > 0 else -y  # not symbolically traceable

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.out = Gate(), torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.out(self.gate(x))

    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), Block())
    x = torch.randn(3, 4)
    lg = trace(model, (x,))
    assert lg.method == "fx" and lg.layer_names() == ["0", "1", "2"]
    values = {"<input>:0": x}
    for name in lg.layer_names():
        st = build_stage(lg, [name])
        values.update(st({k: values[k] for k in st.input_keys}))
    assert torch.equal(values["<output>"], model(x))


def test_untraceable_top_level_is_a_clear_error() -> None:
    from planner.errors import PipeplanError

    class Bad(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            for _ in range(int(y.abs().sum().item() * 0)):  # a Python int from tensor data
                y = y * 2
            return y if bool(y.sum() > 0) else -y

    with pytest.raises(PipeplanError, match="cannot trace Bad"):
        trace(Bad(), (torch.randn(3, 4),))


def test_two_inputs_default_argument_and_dict_output() -> None:
    """A mask derived from the second input is recomputed in every block (never sent), a
    defaulted forward argument is fixed, and a dict output comes out of the last stage."""

    class Blk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return x + self.b(torch.relu(self.a(x))) * m

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
            self.blocks = torch.nn.ModuleList([Blk(), Blk(), Blk()])

        def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: float = 2.0) -> dict:
            m = mask.float().unsqueeze(-1) * scale  # (B, T, 1)
            h = self.emb(x)
            for blk in self.blocks:
                h = blk(h, m)
            return {"y": self.out(h), "h": h}

    torch.manual_seed(0)
    model, x, mask = Net(), torch.randn(2, 5, 3), torch.randint(0, 2, (2, 5))
    lg = trace(model, (x, mask))
    assert lg.layer_names() == ["emb", "blocks.0", "blocks.1", "blocks.2", "out"]
    for name in ["blocks.0", "blocks.1", "blocks.2"]:
        st = build_stage(lg, [name])
        assert "<input>:1" in st.input_keys and len(st.input_keys) == 2
    assert all(e.bytes == 2 * 5 * 4 * 4 for e in lg.edges() if e.src != INPUT_NODE)
    ref = model(x, mask)
    out, _, _ = run_pipeline(lg, [["emb", "blocks.0"], ["blocks.1"], ["blocks.2", "out"]], (x, mask),
                             ref["y"].detach(), lambda o, t: ((o["y"] - t) ** 2).sum() + o["h"].sum())
    assert torch.equal(out["y"], ref["y"]) and torch.equal(out["h"], ref["h"])


class _MutatingBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shift = torch.nn.Parameter(torch.full((6,), 0.1))
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(self.shift)  # its input, modified in place
        return self.lin(torch.tanh(x))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) + ids.unsqueeze(-1).float() * 0.1


class _InPlace(torch.nn.Module):
    """In place across layers: a ReLU(inplace=True) after a Linear; a block that changes its
    input; glue that changes a tensor between two blocks that read it."""

    def __init__(self, through_view: bool = False) -> None:
        super().__init__()
        self.through_view = through_view
        self.inp = torch.nn.Linear(4, 6)
        self.act = torch.nn.ReLU(inplace=True)
        self.mid = torch.nn.Linear(6, 6)
        self.muts = torch.nn.Sequential(_MutatingBlock(), _MutatingBlock())
        self.gate = torch.nn.Linear(6, 3)
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(3)])
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.muts(self.mid(self.act(self.inp(x))))
        ids = self.gate(h).argmax(-1)
        h = self.blocks[0](h, ids)
        if self.through_view:  # the same change, made on a view of ids
            ids.view(-1, 1)[:, 0].add_(1)
        else:
            ids.add_(1)  # blocks.0 reads ids before, blocks.1 after
        h = self.blocks[1](h, ids)
        return self.out(self.blocks[2](h, ids))


@pytest.mark.parametrize("through_view", [False, True])
@pytest.mark.parametrize("granularity", ["modules", "blocks"])
def test_tensors_modified_in_place_keep_their_readers_in_one_layer(granularity: str, through_view: bool
                                                                    ) -> None:
    """Each tensor modified in place stays in one layer with its producer, the node that
    modifies it and every node that reads it: at every cut the stages reproduce the whole
    model's output and gradients exactly (a cut between them fails on the stage's input, a
    leaf, or gives blocks.0 the changed ids), also where the change is made through a view of
    the tensor. A rank that traces from the launcher's record (no user code run) gets the same
    layers."""
    from runtime import stages as rt_stages

    torch.manual_seed(0)
    ref = _InPlace(through_view)
    torch.manual_seed(0)
    model = _InPlace(through_view)
    x, target = torch.randn(5, 4), torch.randn(5, 2)
    ref_out = ref(x)
    torch.nn.functional.mse_loss(ref_out, target).backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    lg = trace(model, (x,), granularity=granularity)
    names = lg.layer_names()
    if granularity == "modules":
        assert "inp+act" in names, names  # the ReLU modifies the Linear's output
    else:  # each of the opaque blocks modifies its input, the layer before's output; the
        # blocks read ids, which the glue between blocks.0 and blocks.1 modifies
        assert not any(n.startswith("muts.") for n in names), names
        assert [n for n in names if "blocks.0" in n] == [n for n in names if "blocks.1" in n], names
    rng = random.Random(1)
    for sizes in _partitions(len(names), rng):
        model.zero_grad(set_to_none=True)
        parts = _cut(names, sizes)
        out, _, stages = run_pipeline(lg, parts, (x,), target, torch.nn.functional.mse_loss)
        assert torch.equal(out, ref_out), sizes
        for st in stages.values():
            for k, p in st.named_parameters():  # (the gate's: no gradient through argmax)
                assert (p.grad is None and ref_grads[k] is None) or torch.equal(p.grad, ref_grads[k]), (sizes, k)
    # the launcher's record, as a rank traces with it
    again = rt_stages.trace_model(model, (x,), granularity, (lg.is_tensor, lg.mutations))
    assert again.layer_names() == names
    bare = rt_stages.trace_model(model, (x,), granularity, (lg.is_tensor, {}))
    assert bare.layer_names() != names  # the record is what keeps them together


class _DecayBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        scale.mul_(0.9)  # the model's buffer, passed in, updated in place
        return x + torch.tanh(self.lin(x)) * scale.clone()


class _SharedBuffer(torch.nn.Module):
    """A buffer of the model itself, passed to every block, which updates it in place: fx reads
    it anew at each use (`scale`, `scale_1`, ...), so each change was seen on one read only,
    and stages cut between the blocks trained otherwise than one process (an outside review)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 6)
        self.blocks = torch.nn.ModuleList([_DecayBlock() for _ in range(3)])
        self.out = torch.nn.Linear(6, 2)
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, self.scale)
        return self.out(h)


def test_a_buffer_the_blocks_update_in_place_keeps_them_in_one_layer() -> None:
    torch.manual_seed(0)
    ref = _SharedBuffer()
    torch.manual_seed(0)
    model = _SharedBuffer()
    x, target = torch.randn(5, 4), torch.randn(5, 2)
    ref_out = ref(x)
    torch.nn.functional.mse_loss(ref_out, target).backward()
    lg = trace(model, (x,))
    names = lg.layer_names()
    assert "blocks.0+blocks.1+blocks.2" in names, names
    for sizes in _partitions(len(names), random.Random(2)):
        model.zero_grad(set_to_none=True)
        model.scale.fill_(1.0)
        out, _, stages = run_pipeline(lg, _cut(names, sizes), (x,), target, torch.nn.functional.mse_loss)
        assert torch.equal(out, ref_out), sizes
        assert torch.equal(model.scale, ref.scale), sizes
        for st in stages.values():
            for k, p in st.named_parameters():
                assert torch.equal(p.grad, dict(ref.named_parameters())[k].grad), (sizes, k)


def test_a_module_with_buffers_called_by_two_layers_is_warned_about() -> None:
    """Its parameters are tied across stages (gradients summed), its buffers cannot be: each
    stage would update its own running statistics. A module without buffers: no warning."""
    import warnings

    from profiler.tracing import TracingWarning

    class Twice(torch.nn.Module):
        def __init__(self, norm: bool) -> None:
            super().__init__()
            self.shared = torch.nn.Sequential(torch.nn.Linear(4, 4),
                                              torch.nn.BatchNorm1d(4) if norm else torch.nn.Identity())
            self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
                                               for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.shared(x)
            for b in self.blocks:
                x = b(x)
            return self.shared(x)

    for norm in (True, False):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            lg = trace(Twice(norm), (torch.randn(3, 4),))
        assert lg.shared_parameters
        told = [str(w.message) for w in said if issubclass(w.category, TracingWarning) and "buffers" in str(w.message)]
        assert len(told) == (1 if norm else 0), told
        if norm:
            assert "shared.1.running_mean" in told[0] and "in different stages" in told[0]


class _Table(torch.nn.Module):
    """A positional table: a buffer the module only reads, not persisted."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pe", torch.randn(8, 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[: x.size(0)]


class _TableNet(torch.nn.Module):
    """Three blocks that each read `_Table`'s buffer and the model's own `scale` (and, with
    `pos`, a non-persistent `pos` of the model itself)."""

    def __init__(self, pos: bool) -> None:
        super().__init__()
        if pos:
            self.register_buffer("pos", torch.randn(8, 4), persistent=False)
        self.register_buffer("scale", torch.full((4,), 0.5))
        self.table = _Table()
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
                                           for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = x + self.pos[: x.size(0)] if hasattr(self, "pos") else x
            x = b(self.table(h) * self.scale)
        return x


def test_a_buffer_only_read_by_two_layers_is_not_warned_about() -> None:
    """A constant table (positional encodings) read by several layers is the same in every
    stage: no warning, on the model itself and in a submodule, read by attribute or by call."""
    import warnings

    from profiler.tracing import TracingWarning

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trace(_TableNet(pos=False), (torch.randn(3, 4),))
    told = [str(w.message) for w in said if issubclass(w.category, TracingWarning) and "buffers" in str(w.message)]
    assert told == []


def test_buffers_the_model_does_not_persist_stay_out_of_the_stages_state_dicts() -> None:
    """`register_buffer(..., persistent=False)` on the model itself and on a submodule: every
    stage holds the buffers it reads, its state dict only the model's own keys (a checkpoint
    merged from the stages loads into build_model()), and the stages compute the model."""
    torch.manual_seed(0)
    model = _TableNet(pos=True)
    x, target = torch.randn(3, 4), torch.randn(3, 4)
    ref = model(x)
    lg = trace(model, (x,))
    names = lg.layer_names()
    assert len(names) >= 3
    for parts in ([names[:1], names[1:]], [[n] for n in names]):
        out, _, stages = run_pipeline(lg, parts, (x,), target, torch.nn.functional.mse_loss)
        assert torch.equal(out, ref)
        keys: set[str] = set()
        for st in stages.values():
            keys |= set(st.state_dict())
        assert keys == set(model.state_dict()), sorted(keys ^ set(model.state_dict()))
        model.load_state_dict({k: v for st in stages.values() for k, v in st.state_dict().items()})


def test_blocks_that_pass_non_tensors_on_are_one_layer_with_a_warning() -> None:
    """A block returning a dict with a None beside its tensor (a Hugging Face style cache),
    passed to the next block: no cut may fall between them, and the warning says why."""
    import warnings

    from profiler.tracing import TracingWarning

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, cache: object = None) -> dict:
            return {"hidden": x + torch.tanh(self.lin(x)), "cache": None}

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            cache = None
            for b in self.blocks:
                o = b(x, cache=cache)
                x, cache = o["hidden"], o["cache"]
            return self.head(x)

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        lg = trace(Net(), (torch.randn(2, 4),))
    assert lg.layer_names()[0] == "blocks.0+blocks.1+blocks.2", lg.layer_names()
    text = [str(w.message) for w in said if issubclass(w.category, TracingWarning)]
    assert any("not tensors cross between layers" in t and "blocks.0 -> blocks.1" in t for t in text), text


class _GainBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor, gain: float = 1.0) -> torch.Tensor:
        return x + gain * torch.tanh(self.bn(self.fc(x)))


class _ExportOnly(torch.nn.Module):
    """A top-level forward torch.fx cannot trace (`if h.requires_grad`), so torch.export
    captures it; `glue` says what else it does there."""

    def __init__(self, glue: str) -> None:
        super().__init__()
        self.glue = glue
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([_GainBlock() for _ in range(3)])
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            h = b(h, 0.5) if self.glue == "number" else b(h)
            if i == 0 and h.requires_grad:
                if self.glue == "hook":
                    h.register_hook(lambda g: 4.0 * g)
                else:
                    h = torch.nn.functional.dropout(h, 0.3) * 2.0  # tensor glue: export keeps it
        return self.out(h)


@pytest.mark.parametrize("glue", ["hook", "number"])
def test_an_exported_graph_that_is_not_the_model_is_refused(glue: str) -> None:
    """A hook registered on a tensor in the top-level forward, or a number passed to a block,
    is lost by torch.export: profiling refuses it with what to do (before, the hook was
    dropped silently and training differed; the number became None and a traceback)."""
    from planner.errors import PipeplanError

    torch.manual_seed(0)
    model = _ExportOnly(glue)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PipeplanError, match="torch.export's graph of _ExportOnly .*register_hook"):
        trace(model, (torch.randn(6, 4),), granularity="blocks")
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items())  # statistics left as they were
    assert all(p.grad is None for p in model.parameters())


def test_an_exported_graph_with_dropout_and_batchnorm_is_kept_and_reproduces_the_model() -> None:
    torch.manual_seed(0)
    model = _ExportOnly("dropout")
    x = torch.randn(6, 4)
    lg = trace(model, (x,), granularity="blocks")
    assert lg.layer_names()[1:4] == ["blocks.0", "blocks.1", "blocks.2"]
    with torch.random.fork_rng():
        torch.manual_seed(1)
        want = model(x)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        names = lg.layer_names()
        got, _, _ = run_pipeline(lg, [[n] for n in names], (x,), torch.zeros(6, 2),
                                 torch.nn.functional.mse_loss)
    assert torch.allclose(got, want, atol=1e-6)


def test_blocks_holding_their_parameters_directly_are_blocks() -> None:
    """A ModuleList of the user's blocks written with nn.Parameter and F.linear (no submodules)
    is cut at its blocks, as one of blocks built from nn.Linear is; it was one layer the
    planner could not cut. A Sequential of torch.nn layers stays one layer's parts."""
    class Raw(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(torch.nn.functional.linear(x, self.w))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
            self.blocks = torch.nn.ModuleList([Raw() for _ in range(3)])
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    lg = trace(Net(), (torch.randn(2, 4),))
    assert lg.layer_names() == ["inp", "blocks.0", "blocks.1", "blocks.2", "head"]


def test_a_torch_built_in_holding_layers_is_one_layer_named_for_itself() -> None:
    """nn.TransformerEncoder holds a ModuleList of layers, taken for the blocks; torch.fx calls
    the encoder whole, so its node counted as glue and the whole model became one layer named
    after its head ("h", kind Linear, with the encoder's parameters)."""
    from torch import nn

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.h = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.h(self.enc(x).mean(1))

    model = M()
    lg = trace(model, (torch.randn(2, 5, 16),))
    assert [layer.name for layer in lg.layers] == ["enc", "h"]
    stage = build_stage(lg, ["enc"])
    assert sum(p.numel() for p in stage.parameters()) == sum(p.numel() for p in model.enc.parameters())
