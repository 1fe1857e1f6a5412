"""The launcher's store (`runtime.launch.local_store`) on the torch versions pipeplan supports.

Before pytorch/pytorch#150215, TCPStore's libuv server (the default from torch 2.4) refused a
listening socket handed over (NotImplementedError, after an error line in the log): the launcher
then fell back to a store on every interface, the one it meant to avoid. And the socket handed
over was owned twice (ours and the store's), closed by the garbage collector with a
ResourceWarning."""
from __future__ import annotations

import gc
import warnings

import torch
import torch.distributed as dist

from runtime import launch


def test_a_torch_whose_libuv_server_refuses_a_socket_still_listens_on_127_0_0_1(monkeypatch) -> None:
    real, made = dist.TCPStore, []

    def old_torch(*args, **kwargs):  # torch 2.4 to 2.7: libuv unless use_libuv=False
        if kwargs.get("master_listen_fd") is not None and kwargs.get("use_libuv", True):
            raise NotImplementedError("The libuv TCPStore backend does not support initialization "
                                      "with an listen fd.")
        made.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "__version__", "2.6.0+cpu")
    monkeypatch.setattr(dist, "TCPStore", old_torch)
    store = launch.local_store()
    assert made and made[-1].get("master_listen_fd") is not None  # not the every-interface fallback
    store.set("k", "v")
    assert real("127.0.0.1", store.port, is_master=False).get("k") == b"v"


def test_the_socket_handed_over_is_closed_once_by_its_owner() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        store = launch.local_store()
        gc.collect()
        store.set("k", "v")
        assert dist.TCPStore("127.0.0.1", store.port, is_master=False).get("k") == b"v"
        del store
        gc.collect()
