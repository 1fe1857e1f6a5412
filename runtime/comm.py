"""Point-to-point transfers between pipeline ranks: activations forward, gradients backward.

Internal module. Each transfer is one tensor identified by (microbatch, tensor key, direction).
The first transfer of a (peer, key, direction) in a run carries a small int64 header (dtype,
shape; tagged without a microbatch, so the two sides' first transfers may be for different
microbatches) so nothing needs to be known in advance; later ones reuse the cached shape (every
microbatch of a run has the same size), which lets receives be posted early (prefetch).
Sends are non-blocking (`isend`); their handles are kept until `flush()` at the end of the
step, so a rank never waits for a peer to consume what it produced. A failed or timed-out
wait raises `PeerError` naming the peer rank.

Two protocols. On gloo (tags, a receive thread, buffered sends) operations are issued at once
and receives are posted two actions ahead (`PIPEPLAN_RECV_LOOKAHEAD`, `runtime.executor`).
On NCCL, which matches a pair's operations by order and runs them in issue order,
`batched=True`: `send` and `post_recv` only queue, and the queue goes out as one
`batch_isend_irecv` at `end_action()` (the executor calls it after each action, having
queued that action's sends and the next action's receives) or before any blocking wait.
`planner.p2p_order` checks statically that a plan's actions, issued this way, cannot deadlock
or mismatch; the worker refuses a plan that fails it on NCCL.

`init_process_group`, `new_group` and `barrier` here pass the rank's device explicitly and,
on NCCL, turn on blocking waits with the run's timeout and async error handling, so a dead
peer raises (and is named) instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from planner.errors import PipeplanError, describe

_DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # not complex: sent as their real views they trained 3e-3 away from one process (not found why)
_MAX_DIMS = 8
# dtype code, ndim, up to 8 dims, their order in memory, and a flag: forward, whether the tensor
# needs a gradient (the receiver marks it so, and only then sends one back); backward, whether
# there is a gradient at all (none: no transfer of it follows, the sender's tensor gets none)
_HEADER_LEN = 3 + 2 * _MAX_DIMS
_FLAG = _HEADER_LEN - 1


class PeerError(RuntimeError):
    """A transfer with another rank failed or timed out: that rank died, raised or hangs."""

    def __init__(self, peer: int, message: str) -> None:
        super().__init__(message)
        self.peer = peer


def failure_reason(exc: BaseException, timeout_s: float) -> str:
    """Why a transfer failed, in a few words: the peer did not answer within the timeout, or
    the connection failed (the backend's first line)."""
    text = str(exc)
    if "imed out" in text or "timeout" in text.lower():
        return f"no answer within {timeout_s:g} s (--timeout)"
    return f"the connection failed ({describe(exc, 200)})"


@contextmanager
def collective(what: str, timeout_s: float) -> Iterator[None]:
    """A step every rank takes together (joining the process group, making a group, a barrier,
    gathering objects): a backend error in it (a timeout, a closed connection) is a PeerError
    whose peer is not known (-1), so the launcher waits for the others and names the rank that
    hangs or died, instead of printing this rank's backend traceback as its own fault. Only
    around the runtime's own calls: a user's RuntimeError stays the user's."""
    try:
        yield
    except PeerError:
        raise
    except RuntimeError as exc:  # gloo / NCCL / the store raise RuntimeErrors (DistError among them)
        if not peer_failure(exc):
            raise  # this rank's own: memory it could not allocate, NCCL that would not start
        raise PeerError(-1, f"{what}: {failure_reason(exc, timeout_s)}; another rank has died, "
                            "raised an error or hangs") from None


# what the backends and the store say when a peer is gone or silent (gloo: "Timed out waiting
# ...", "Connection closed by peer"; the store: "wait timeout after ..."; NCCL: "Connection reset
# by peer", the watchdog's "collective operation timeout", and ncclRemoteError's own text, "remote
# process exited or there was a network error", which an asynchronous error carries without any
# socket words: its "Last error" is the proxy thread's, not the caller's)
_PEER_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "closed by peer",
               "reset by peer", "broken pipe", "connection refused", "remote process exited",
               "ncclremoteerror")


def peer_failure(exc: BaseException) -> bool:
    """Whether a collective's error says a peer is gone or silent, not that this rank failed
    (an allocation that failed, an out-of-memory: those stay this rank's own error)."""
    if isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        return False
    text = str(exc).lower()
    if "allocate" in text or "out of memory" in text:
        return False
    return any(w in text for w in _PEER_WORDS)


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """The order of `t`'s dimensions in memory, outermost first, where `t` is dense (a
    permutation of a contiguous tensor: `y.t()`, channels-last); else the identity. A tensor is
    sent as `t.permute(order)`, contiguous, and received as that buffer permuted back: the
    receiver's tensor has the sender's strides, so a kernel that reads it (a matmul of a
    transposed input) takes the path it took in the single-device run, with its rounding."""
    ident = tuple(range(t.dim()))
    if t.is_contiguous():
        return ident
    order = tuple(sorted(ident, key=lambda i: (-t.stride(i), i)))
    expected = 1  # a permutation of a contiguous tensor: each stride the product of the sizes inside it
    for i in reversed(order):
        if t.shape[i] != 1 and t.stride(i) != expected:
            return ident
        expected *= t.shape[i]
    return order


# a wait on CUDA first spins this long (yielding the GIL), then polls every POLL_S
SPIN_S = 0.002
POLL_S = 50e-6


def wait_work(work: object, device: torch.device, timeout_s: float) -> None:
    """`work.wait()`; on CUDA, first polled until complete (`Work.is_completed`: a CUDA event
    query, and NCCL's asynchronous error). ProcessGroupNCCL's blocking wait
    (TORCH_NCCL_BLOCKING_WAIT, `init_process_group`) sleeps 1 ms between its own polls
    (`WorkNCCL::wait`, kSynchronizeBusyWaitMillis), which every received activation or gradient
    and every all-reduce paid on the critical path, up to a millisecond each, and which made
    calibrate's NCCL ping-pong read ~1 ms one-way. Once complete, `wait()` returns at once
    (and lets the current stream wait on NCCL's). Past `timeout_s` without completion: a
    RuntimeError saying it timed out, as the blocking wait's own."""
    if device.type == "cuda" and timeout_s > 0:
        start = time.perf_counter()
        while not work.is_completed():  # type: ignore[attr-defined]
            waited = time.perf_counter() - start
            if waited > timeout_s:
                raise RuntimeError(f"timed out after {timeout_s:g} s")
            time.sleep(0.0 if waited < SPIN_S else POLL_S)
    work.wait()  # type: ignore[attr-defined]


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for k, i in enumerate(order):
        inv[i] = k
    return tuple(inv)


def _header(t: torch.Tensor | None, order: tuple[int, ...], flag: bool) -> torch.Tensor:
    h = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    h[_FLAG] = int(flag)
    if t is None:  # no gradient
        return h
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"tensors with more than {_MAX_DIMS} dimensions cannot be sent")
    h[0] = _DTYPES.index(t.dtype)
    h[1] = t.dim()
    for i, d in enumerate(t.shape):
        h[2 + i] = d
        h[2 + _MAX_DIMS + i] = order[i]
    return h


def _parse_header(h: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]:
    ndim = int(h[1])
    return (_DTYPES[int(h[0])], tuple(int(d) for d in h[2 : 2 + ndim]),
            tuple(int(d) for d in h[2 + _MAX_DIMS : 2 + _MAX_DIMS + ndim]))


@dataclass
class _Batch:
    """Works of one issued batch (NCCL coalesces a batch into one work: wait for all)."""

    works: list[object] = field(default_factory=list)
    waited: bool = False


@dataclass
class _Pending:
    work: object  # None while queued (batched protocol) or when the batch holds the works
    buf: torch.Tensor
    peer: int
    what: str
    batch: _Batch | None = None


@dataclass
class P2P:
    """Tagged, shape-caching point-to-point channel of one rank."""

    rank: int
    device: torch.device
    key_index: dict[str, int]  # tensor key -> small int, identical on every rank
    timeout_s: float
    describe_rank: dict[int, str] = field(default_factory=dict)  # rank -> "rank 2 (stage 1)"
    comm_ms: float = 0.0  # time spent posting sends and in flush waits
    batched: bool = False  # NCCL: queue, then issue one batch_isend_irecv per action
    # every issued batch as [[is_send, peer, tag], ...] when PIPEPLAN_P2P_LOG names a folder
    # (written there as rank<N>.json at each flush; the tests compare it with planner.p2p_order)
    log: list[list[tuple[bool, int, int]]] | None = None
    _queue: list[tuple[bool, torch.Tensor, int, int, _Pending]] = field(default_factory=list)
    # (peer, key, grad, sending) -> dtype, shape, memory order (`memory_order`)
    _shapes: dict[tuple[int, str, bool, bool], tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]] = \
        field(default_factory=dict)
    _sends: list[_Pending] = field(default_factory=list)
    _recvs: dict[tuple[int, str, int, bool], _Pending] = field(default_factory=dict)
    # (peer, key, grad, sending) -> the header's flag (`_HEADER_LEN`): forward, the tensor needs
    # a gradient; backward, a gradient exists (False: none is ever sent for that key)
    _flags: dict[tuple[int, str, bool, bool], bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if os.environ.get("PIPEPLAN_P2P_LOG") and self.log is None:
            self.log = []

    def _tag(self, mb: int, key: str, grad: bool, header: bool) -> int:
        return ((mb * len(self.key_index) + self.key_index[key]) * 2 + int(grad)) * 2 + int(header)

    def _who(self, peer: int) -> str:
        return self.describe_rank.get(peer, f"rank {peer}")

    def _post(self, op: object, t: torch.Tensor, peer: int, tag: int, what: str) -> object:
        """dist.isend / dist.irecv; a broken connection at posting time is a PeerError too."""
        try:
            return op(t, peer, tag=tag)  # type: ignore[operator]
        except Exception as exc:  # noqa: BLE001
            raise PeerError(peer, f"{what} with {self._who(peer)}: the connection failed "
                                  f"({describe(exc, 200)}); {self._who(peer)} has "
                                  "died, raised an error or hangs") from None

    def _wait(self, p: _Pending) -> None:
        if p.work is None and (p.batch is None or not p.batch.works):
            self.issue()  # still queued: send the queue out first (never wait on a queued op)
        try:
            # the process group's own timeout (init_process_group(timeout=...)) bounds the wait;
            # gloo's wait(timeout) polls and costs milliseconds per message
            if p.batch is not None:
                if not p.batch.waited:
                    for w in p.batch.works:
                        wait_work(w, self.device, self.timeout_s)
                    p.batch.waited = True
            else:
                wait_work(p.work, self.device, self.timeout_s)
        except Exception as exc:  # gloo/nccl raise RuntimeError with transport details
            raise PeerError(
                p.peer,
                f"{p.what} with {self._who(p.peer)}: {failure_reason(exc, self.timeout_s)}; "
                f"{self._who(p.peer)} has died, raised an error or hangs",
            ) from None

    def _submit(self, send: bool, t: torch.Tensor, peer: int, tag: int, what: str) -> _Pending:
        """Issue one operation now (gloo) or queue it for the next batch (NCCL)."""
        p = _Pending(None, t, peer, what)
        if self.log is not None and not self.batched:
            self.log.append([(send, peer, tag)])
        if self.batched:
            self._queue.append((send, t, peer, tag, p))
        else:
            p.work = self._post(dist.isend if send else dist.irecv, t, peer, tag, what)
        return p

    def issue(self) -> None:
        """Send the queued operations out as one `batch_isend_irecv` (batched protocol)."""
        if not self._queue:
            return
        ops = [dist.P2POp(dist.isend if send else dist.irecv, t, peer, tag=tag)
               for send, t, peer, tag, _ in self._queue]
        pend = [p for *_, p in self._queue]
        if self.log is not None:
            self.log.append([(send, peer, tag) for send, _, peer, tag, _ in self._queue])
        self._queue = []
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as exc:  # noqa: BLE001
            peers = sorted({p.peer for p in pend})
            raise PeerError(peers[0], f"{pend[0].what}: the connection with "
                                      f"{', '.join(self._who(q) for q in peers)} failed "
                                      f"({describe(exc, 200)}); a peer has died, "
                                      "raised an error or hangs") from None
        batch = _Batch(list(works))
        for p in pend:
            p.batch = batch

    def end_action(self) -> None:
        """The executor finished an action and queued its sends and the next receives."""
        if self.batched:
            t0 = time.perf_counter()
            self.issue()
            self.comm_ms += (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ sends
    def needs_grad(self, peer: int, key: str) -> bool:
        """Whether `key`, received from `peer`, was marked as needing a gradient at its first
        transfer (its header's flag): a gradient of it is to be sent back."""
        return self._flags.get((peer, key, False, False), False)

    def send(self, t: torch.Tensor | None, peer: int, mb: int, key: str, grad: bool) -> None:
        """Send `t` (None: a gradient that does not exist, as autograd leaves one for a tensor
        that does not reach the loss; its producer's weights then get none, as in one process)."""
        t0 = time.perf_counter()
        skey = (peer, key, grad, True)
        if t is None:
            if not grad:
                raise ValueError("only a gradient may be missing")
            if skey not in self._flags:  # the first: a header that says none, and nothing after
                self._flags[skey] = False
                h = _header(None, (), False).to(self.device)
                what = f"sending that {key!r} of microbatch {mb} has no gradient"
                self._sends.append(self._submit(True, h, peer, self._tag(0, key, grad, True), what))
            if not self._flags[skey]:
                self.comm_ms += (time.perf_counter() - t0) * 1e3
                return
            dtype, dims, _ = self._shapes[skey]
            t = torch.zeros(dims, dtype=dtype, device=self.device)  # none this time, some before
        elif grad and self._flags.get(skey) is False:
            raise PipeplanError(
                f"the gradient of {key!r} exists in microbatch {mb} but did not in the first one: "
                "pipeplan sends a tensor's gradient in every microbatch or in none (a stage whose "
                "output reaches the loss only in some microbatches); keep the layers that make and "
                "read it in one stage (plan --method manual --split)")
        needs = bool(t.requires_grad) if not grad else True
        t = t.detach()
        if t.device != self.device:
            t = t.to(self.device)
        what = f"sending {'the gradient of ' if grad else ''}{key!r} of microbatch {mb}"
        if skey in self._shapes and self._shapes[skey][:2] != (t.dtype, tuple(t.shape)):
            raise PipeplanError(
                f"{key!r} of microbatch {mb} has dtype/shape {t.dtype}/{tuple(t.shape)} but earlier "
                f"microbatches had {self._shapes[skey][:2]}: the tensors a stage sends must have the same "
                "shape in every microbatch and step (the receiver allocates them from the first); "
                "pad variable-length batches to one length in make_batch"
            )
        if skey not in self._shapes:
            if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
                why = f"its dtype {t.dtype} is not one pipeplan sends" if t.dtype not in _DTYPES else \
                    f"it has {t.dim()} dimensions, more than the {_MAX_DIMS} pipeplan sends"
                raise PipeplanError(
                    f"{key!r} crosses a stage boundary but {why}: keep the layers that make and read "
                    "it in one stage (plan --method manual --split), or hand on a tensor that can "
                    "be sent (another dtype, or reshaped)")
            self._shapes[skey] = (t.dtype, tuple(t.shape), memory_order(t))
            self._flags[skey] = needs
            h = _header(t, self._shapes[skey][2], needs).to(self.device)
            # the header's tag names no microbatch: the receiver's first receive of this key
            # may be for another microbatch than the sender's first send (a hand-ordered
            # plan's actions), and it takes whichever header comes
            self._sends.append(self._submit(True, h, peer, self._tag(0, key, grad, True), what))
        # in the first microbatch's memory order, whatever this one's (the receiver permutes back)
        t = t.permute(self._shapes[skey][2]).contiguous()
        self._sends.append(self._submit(True, t, peer, self._tag(mb, key, grad, False), what))
        self.comm_ms += (time.perf_counter() - t0) * 1e3

    def flush(self) -> None:
        """Wait for every send of this step to be delivered."""
        t0 = time.perf_counter()
        self.issue()
        for p in self._sends:
            self._wait(p)
        self._sends.clear()
        if self.log is not None:
            import json

            path = os.path.join(os.environ["PIPEPLAN_P2P_LOG"], f"rank{self.rank}.json")
            with open(path, "w") as f:
                json.dump({"num_keys": len(self.key_index), "batches": self.log}, f)
        self.comm_ms += (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ receives
    def post_recv(self, peer: int, mb: int, key: str, grad: bool) -> bool:
        """Post the receive early if the shape is known; True if posted (or already)."""
        rkey = (peer, key, mb, grad)
        if rkey in self._recvs or (grad and self._flags.get((peer, key, grad, False)) is False):
            return True  # (posted, or no gradient ever comes)
        shape = self._shapes.get((peer, key, grad, False))
        if shape is None:
            return False
        dtype, dims, order = shape
        buf = torch.empty([dims[i] for i in order], dtype=dtype, device=self.device)
        what = f"receiving {'the gradient of ' if grad else ''}{key!r} of microbatch {mb}"
        self._recvs[rkey] = self._submit(False, buf, peer, self._tag(mb, key, grad, False), what)
        return True

    def recv(self, peer: int, mb: int, key: str, grad: bool) -> torch.Tensor | None:
        """The tensor; None for a gradient the peer has none of (`send`)."""
        rkey = (peer, key, grad, False)
        if not self.post_recv(peer, mb, key, grad):
            h = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            what = f"receiving {'the gradient of ' if grad else ''}{key!r} of microbatch {mb}"
            self._wait(self._submit(False, h, peer, self._tag(0, key, grad, True), what))
            h = h.cpu()
            self._flags[rkey] = bool(h[_FLAG])
            if grad and not self._flags[rkey]:
                return None
            self._shapes[rkey] = _parse_header(h)
            self.post_recv(peer, mb, key, grad)
        if grad and self._flags.get(rkey) is False:
            return None
        p = self._recvs.pop((peer, key, mb, grad))
        self._wait(p)
        order = self._shapes[(peer, key, grad, False)][2]
        return p.buf if order == tuple(range(len(order))) else p.buf.permute(_inverse(order))


# ---------------------------------------------------------------- process groups


def init_process_group(backend: str, device: torch.device, rank: int, world_size: int,
                       timeout_s: float) -> None:
    """The default process group, bound to `device`. On NCCL: a wait that passes `timeout_s`
    raises on the waiting rank (TORCH_NCCL_BLOCKING_WAIT, so PeerError can name the peer; torch
    then starts no watchdog for such a group, and its `wait()` polls every millisecond); the
    groups made without it (`new_group(waited_by_torch=True)`) have the watchdog, which tears
    a failed communicator and the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=1). A user's
    own setting of either variable is kept."""
    global _GROUP_TIMEOUT, _OUR_BLOCKING_WAIT
    if backend == "nccl":
        _OUR_BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    kwargs: dict[str, object] = {"device_id": device} if device.type == "cuda" else {}
    _GROUP_TIMEOUT = datetime.timedelta(seconds=timeout_s)
    with collective("joining the process group (every rank must start: a model file slow to import "
                    "or a rank that hangs before it holds the others here)", timeout_s):
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=_GROUP_TIMEOUT, **kwargs)


# the default group's timeout, for every group made after it: `dist.new_group` without one
# takes the backend's default (30 minutes), so a replica that hung held the others in their
# gradient all-reduce for half an hour whatever --timeout said
_GROUP_TIMEOUT: datetime.timedelta | None = None
# whether `init_process_group` turned TORCH_NCCL_BLOCKING_WAIT on (not the user): `new_group`
# then leaves it off for the groups whose waits are torch's own
_OUR_BLOCKING_WAIT = False


@contextmanager
def _blocking_wait(on: bool) -> Iterator[None]:
    """TORCH_NCCL_BLOCKING_WAIT as the NCCL process groups made inside see it (each reads it once,
    when it is made): off where `on` is False and the runtime set it, else as it is."""
    if on or not _OUR_BLOCKING_WAIT or "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        yield
        return
    kept = os.environ.pop("TORCH_NCCL_BLOCKING_WAIT")
    try:
        yield
    finally:
        os.environ["TORCH_NCCL_BLOCKING_WAIT"] = kept


def new_group(ranks: list[int], device: torch.device, waited_by_torch: bool = False,
              backend: str | None = None) -> object:
    """A process group over `ranks` (every rank must call this, in the same order), with the
    default group's timeout. `waited_by_torch`: a group whose collectives torch's own code waits
    for, not the runtime's (tensor parallelism's: DTensor's all-reduces and all-gathers inside
    every forward and backward). On NCCL it is made without blocking waits: a blocking
    `WorkNCCL::wait` polls for completion in 1 ms sleeps, which cost every TP collective at
    least a millisecond and serialized the host with the GPU; a hang there is the watchdog's
    (the run's timeout, TORCH_NCCL_ASYNC_ERROR_HANDLING) instead of a PeerError. `backend`:
    the group's own (the default group's where None)."""
    kwargs: dict[str, object] = {"device_id": device} if device.type == "cuda" else {}
    if backend is not None:
        kwargs["backend"] = backend
    with _blocking_wait(not waited_by_torch):
        if _GROUP_TIMEOUT is None:
            return dist.new_group(ranks, **kwargs)
        kwargs["timeout"] = _GROUP_TIMEOUT
        with collective(f"making the process group of ranks {ranks}", _GROUP_TIMEOUT.total_seconds()):
            return dist.new_group(ranks, **kwargs)


def host_group(backend: str, world_size: int) -> object | None:
    """The group over which rank 0 gathers the checkpoint's parts (--save): None (the default
    group) on gloo; on NCCL a gloo group of every rank, made by every rank at the same point.
    Over NCCL `gather_object` pickles each part into a tensor on the GPU and rank 0 receives the
    largest part times the world size there: a checkpoint of 8 stages of 10 GB of weights and
    optimizer state asked rank 0's GPU for about 80 GB more while the model was still on it.
    Gloo finds its interface by the host name (GLOO_SOCKET_IFNAME to choose it, as
    NCCL_SOCKET_IFNAME for NCCL)."""
    if backend == "gloo":
        return None
    return new_group(list(range(world_size)), torch.device("cpu"), backend="gloo")


def barrier(device: torch.device, what: str = "waiting for every rank (a barrier)") -> None:
    """A barrier on `device` (NCCL needs to be told which GPU a barrier runs on); a failure is
    a PeerError (`collective`)."""
    timeout_s = _GROUP_TIMEOUT.total_seconds() if _GROUP_TIMEOUT is not None else 0.0
    with collective(what, timeout_s):
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index or 0])
        else:
            dist.barrier()


def default_store() -> object | None:
    """The store the default process group was made with (the launcher's, or torchrun's
    agent's): for waits that are not messages (`runtime.progress`). None where this torch
    does not say."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except Exception:  # noqa: BLE001
        return None


def batched_protocol(backend: str) -> bool:
    """NCCL issues point-to-point operations in batches; gloo at once. PIPEPLAN_P2P_BATCHED=1
    forces the batched protocol on gloo too, so it runs, and is tested, there. On NCCL the
    unbatched one is refused (PIPEPLAN_P2P_BATCHED=0): NCCL runs a rank's operations in issue
    order on one stream per communicator (with `init_process_group(device_id=...)`, the default
    group's one for every peer), so a receive posted ahead (`runtime.executor.recv_lookahead`)
    blocks the sends issued after it: 2 stages of 1F1B hang at the second step (rank 0 queues
    send act 0, recv grad 0, send act 1; rank 1 recv act 0, recv act 1, send grad 0), and rank
    0's loss receive, posted at the step's start, takes the first gradient's place."""
    forced = os.environ.get("PIPEPLAN_P2P_BATCHED")
    if forced == "0" and backend == "nccl":
        raise PipeplanError(
            "PIPEPLAN_P2P_BATCHED=0 on NCCL: NCCL matches a pair's messages by order on one stream, "
            "where the unbatched protocol's receives posted ahead deadlock; unset it (the batched "
            "protocol is NCCL's)")
    if forced in ("0", "1"):
        return forced == "1"
    return backend == "nccl"
