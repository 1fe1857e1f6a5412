"""Point-to-point transfers between pipeline ranks: activations forward, gradients backward.

Internal module. Each transfer is one tensor identified by (microbatch, tensor key, direction).
The first transfer of a (peer, key, direction) in a run carries a small int64 header (dtype,
shape) so nothing needs to be known in advance; later ones reuse the cached shape (every
microbatch of a run has the same size), which lets receives be posted early (prefetch).
Sends are non-blocking (`isend`); their handles are kept until `flush()` at the end of the
step, so a rank never waits for a peer to consume what it produced. A failed or timed-out
wait raises `PeerError` naming the peer rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]
_HEADER_LEN = 10  # dtype code, ndim, up to 8 dims
_MAX_DIMS = _HEADER_LEN - 2


class PeerError(RuntimeError):
    """A transfer with another rank failed or timed out: that rank died, raised or hangs."""

    def __init__(self, peer: int, message: str) -> None:
        super().__init__(message)
        self.peer = peer


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"tensors with more than {_MAX_DIMS} dimensions cannot be sent")
    h = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    h[0] = _DTYPES.index(t.dtype)
    h[1] = t.dim()
    for i, d in enumerate(t.shape):
        h[2 + i] = d
    return h


def _parse_header(h: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    ndim = int(h[1])
    return _DTYPES[int(h[0])], tuple(int(d) for d in h[2 : 2 + ndim])


@dataclass
class _Pending:
    work: object
    buf: torch.Tensor
    peer: int
    what: str


@dataclass
class P2P:
    """Tagged, shape-caching point-to-point channel of one rank."""

    rank: int
    device: torch.device
    key_index: dict[str, int]  # tensor key -> small int, identical on every rank
    timeout_s: float
    describe_rank: dict[int, str] = field(default_factory=dict)  # rank -> "rank 2 (stage 1)"
    comm_ms: float = 0.0  # time spent posting sends and in flush waits
    _shapes: dict[tuple[int, str, bool, bool], tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    _sends: list[_Pending] = field(default_factory=list)
    _recvs: dict[tuple[int, str, int, bool], _Pending] = field(default_factory=dict)

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
                                  f"({str(exc).splitlines()[0][:200]}); {self._who(peer)} has "
                                  "died, raised an error or hangs") from None

    def _wait(self, p: _Pending) -> None:
        try:
            # the process group's own timeout (init_process_group(timeout=...)) bounds the wait;
            # gloo's wait(timeout) polls and costs milliseconds per message
            p.work.wait()  # type: ignore[attr-defined]
        except Exception as exc:  # gloo/nccl raise RuntimeError with transport details
            text = str(exc)
            reason = (
                f"no answer within {self.timeout_s:g} s (--timeout)"
                if "imed out" in text or "timeout" in text.lower()
                else f"the connection failed ({text.splitlines()[0][:200]})"
            )
            raise PeerError(
                p.peer,
                f"{p.what} with {self._who(p.peer)}: {reason}; "
                f"{self._who(p.peer)} has died, raised an error or hangs",
            ) from None

    # ------------------------------------------------------------------ sends
    def send(self, t: torch.Tensor, peer: int, mb: int, key: str, grad: bool) -> None:
        t0 = time.perf_counter()
        t = t.detach().contiguous()
        if t.device != self.device:
            t = t.to(self.device)
        skey = (peer, key, grad, True)
        what = f"sending {'the gradient of ' if grad else ''}{key!r} of microbatch {mb}"
        if skey in self._shapes and self._shapes[skey] != (t.dtype, tuple(t.shape)):
            raise ValueError(
                f"{key!r} of microbatch {mb} has dtype/shape {t.dtype}/{tuple(t.shape)} but earlier "
                f"microbatches had {self._shapes[skey]}: every microbatch must have the same shapes"
            )
        if skey not in self._shapes:
            self._shapes[skey] = (t.dtype, tuple(t.shape))
            h = _header(t).to(self.device)
            w = self._post(dist.isend, h, peer, self._tag(mb, key, grad, True), what)
            self._sends.append(_Pending(w, h, peer, what))
        w = self._post(dist.isend, t, peer, self._tag(mb, key, grad, False), what)
        self._sends.append(_Pending(w, t, peer, what))
        self.comm_ms += (time.perf_counter() - t0) * 1e3

    def flush(self) -> None:
        """Wait for every send of this step to be delivered."""
        t0 = time.perf_counter()
        for p in self._sends:
            self._wait(p)
        self._sends.clear()
        self.comm_ms += (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ receives
    def post_recv(self, peer: int, mb: int, key: str, grad: bool) -> bool:
        """Post the receive early if the shape is known; True if posted (or already)."""
        rkey = (peer, key, mb, grad)
        if rkey in self._recvs:
            return True
        shape = self._shapes.get((peer, key, grad, False))
        if shape is None:
            return False
        buf = torch.empty(shape[1], dtype=shape[0], device=self.device)
        what = f"receiving {'the gradient of ' if grad else ''}{key!r} of microbatch {mb}"
        w = self._post(dist.irecv, buf, peer, self._tag(mb, key, grad, False), what)
        self._recvs[rkey] = _Pending(w, buf, peer, what)
        return True

    def recv(self, peer: int, mb: int, key: str, grad: bool) -> torch.Tensor:
        if not self.post_recv(peer, mb, key, grad):
            h = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            what = f"receiving {'the gradient of ' if grad else ''}{key!r} of microbatch {mb}"
            w = self._post(dist.irecv, h, peer, self._tag(mb, key, grad, True), what)
            self._wait(_Pending(w, h, peer, what))
            self._shapes[(peer, key, grad, False)] = _parse_header(h.cpu())
            self.post_recv(peer, mb, key, grad)
        p = self._recvs.pop((peer, key, mb, grad))
        self._wait(p)
        return p.buf
