"""`profiler.allocations.peak_new_bytes` against allocations whose sizes are known."""

from __future__ import annotations

import pytest
import torch

from profiler.allocations import peak_new_bytes

CPU = torch.device("cpu")


def test_peak_of_a_cross_entropy_backward_is_two_logits() -> None:
    """nll_loss's backward allocates the log-probabilities' gradient, log_softmax's the
    logits' gradient while the first is still alive: two tensors the size of the logits."""
    n, v = 512, 3000
    logits = torch.randn(n, v, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(logits, torch.randint(0, v, (n,)))
    peak, (g,) = peak_new_bytes(lambda: torch.autograd.grad(loss, logits), CPU)
    assert g.shape == logits.shape
    assert peak == pytest.approx(2 * n * v * 4, rel=0.001)


def test_frees_inside_the_work_lower_the_running_total() -> None:
    def work() -> int:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        del a
        b = torch.empty(3 << 20, dtype=torch.uint8)
        c = torch.empty(1 << 20, dtype=torch.uint8)
        return b.numel() + c.numel()

    peak, n = peak_new_bytes(work, CPU)
    assert n == 4 << 20
    assert peak == pytest.approx(4 << 20, rel=0.01)  # not 5 MiB: the first MiB was freed


def test_under_another_profiler_the_work_runs_unmeasured() -> None:
    with torch.profiler.profile():
        peak, got = peak_new_bytes(lambda: 7, CPU)
    assert peak is None and got == 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_peak_comes_from_the_allocator() -> None:
    dev = torch.device("cuda")
    peak, _ = peak_new_bytes(lambda: torch.empty(8 << 20, dtype=torch.uint8, device=dev).sum(), dev)
    assert peak is not None and peak >= 8 << 20


def test_what_setup_allocated_and_the_work_frees_lowers_the_total() -> None:
    """A backward frees the forward's saved tensors as it goes: allocated in `setup`, those
    frees are seen on CPU too (without it the CPU profiler never sees them)."""
    def setup() -> list[torch.Tensor]:
        return [torch.empty(2 << 20, dtype=torch.uint8)]

    def work(held: list[torch.Tensor]) -> int:
        held.clear()  # frees 2 MiB
        return torch.empty(3 << 20, dtype=torch.uint8).numel()

    peak, n = peak_new_bytes(work, CPU, setup=setup)
    assert n == 3 << 20
    assert peak == pytest.approx(1 << 20, rel=0.01)
    held = setup()
    unseen, _ = peak_new_bytes(lambda: work(held), CPU)  # allocated before the profile
    assert unseen == pytest.approx(3 << 20, rel=0.01)


def test_measuring_the_loss_leaves_the_real_graph_hooks_and_rng_alone() -> None:
    """The runtime's last stage measures the loss's working memory on the first microbatch it
    trains: the model's graph, a hook on its output and the random streams must be as if it
    had not (a second backward through the real graph would fire hooks twice)."""
    from profiler.measure import loss_workspace_bytes

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 500)
    out = head(torch.randn(64, 16))
    fired = []
    out.register_hook(lambda g: fired.append(g.shape))
    target = torch.randint(0, 500, (64,))

    def loss_fn(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # draws random numbers
        return torch.nn.functional.cross_entropy(o + 0 * torch.rand_like(o), t)

    state = torch.get_rng_state()
    ws = loss_workspace_bytes(out, target, loss_fn, CPU)
    assert torch.equal(torch.get_rng_state(), state)
    assert fired == []
    assert ws >= 2 * out.numel() * 4  # two gradients the size of the logits, at least
    loss_fn(out, target).backward()  # the real backward: its graph is intact, the hook fires once
    assert fired == [out.shape] and head.weight.grad is not None


def test_an_output_that_needs_no_gradient_has_no_loss_working_memory() -> None:
    from profiler.measure import loss_workspace_bytes

    scale = torch.ones(1, requires_grad=True)  # a learned temperature inside the loss
    out = torch.randn(8, 10)  # a frozen model: its output needs no gradient
    ws = loss_workspace_bytes(out, torch.zeros(8, dtype=torch.long),
                              lambda o, t: torch.nn.functional.cross_entropy(o * scale, t), CPU)
    assert ws == 0
