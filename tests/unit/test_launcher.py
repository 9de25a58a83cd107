"""The supervisor's signal handling, with a real child process standing in for the frontend."""

from __future__ import annotations

import select
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from services.launcher.serve import Launcher, listening_sockets
from shared.config import Config, ConfigError
from shared.replicas import replica_devices

FRONTEND_STAND_IN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_sigterm_reaches_the_frontend_at_once() -> None:
    """The frontend refuses new work from the moment the signal arrives, not a beat later."""
    launcher = Launcher(Config())
    frontend = subprocess.Popen(
        [sys.executable, "-c", FRONTEND_STAND_IN], stdout=subprocess.PIPE, text=True
    )
    try:
        assert frontend.stdout is not None and frontend.stdout.readline() == "ready\n"
        launcher.procs["frontend"] = frontend
        launcher._on_signal(signal.SIGTERM, None)
        assert launcher.stopping
        assert frontend.wait(timeout=30) == 7  # its SIGTERM handler ran
    finally:
        frontend.kill()
        shutil.rmtree(launcher.runtime, ignore_errors=True)


def test_each_replica_gets_its_own_gpus_and_too_few_are_refused(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    config = Config(device="cuda", data_parallel_size=2, tensor_parallel_size=2, port=_free_port())
    launcher = Launcher(config)
    assert len(launcher.listeners) == 4  # two frontends per replica
    for listener in launcher.listeners:
        listener.close()
    shutil.rmtree(launcher.runtime, ignore_errors=True)
    assert [replica_devices(launcher.gpus, r, launcher.config) for r in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "3,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    ]
    assert launcher.config.addresses("scheduler_address")[1].endswith("/scheduler-1")
    assert len(launcher.config.addresses("kv_events_address")) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ConfigError, match="needs 4 GPUs; 3 are visible"):
        Launcher(config)


def test_several_frontends_get_their_own_addresses_and_sockets_on_one_port() -> None:
    """--api-server-count 2: one ipc address per frontend, both named to the components, a
    folder for their shared metrics, and one listening socket each on the same port; a port
    another server holds stops serve instead of being shared with it."""
    port = _free_port()
    launcher = Launcher(Config(api_server_count=2, port=port))
    try:
        assert [s.getsockname()[1] for s in launcher.listeners] == [port, port]
        addresses = launcher.config.addresses("frontend_address")
        assert len(addresses) == 2 and addresses[0] != addresses[1]
        assert launcher.config.metrics_share_dir is not None
        with pytest.raises(OSError):
            Launcher(Config(api_server_count=2, port=port))
    finally:
        for listener in launcher.listeners:
            listener.close()
        shutil.rmtree(launcher.runtime, ignore_errors=True)


def test_the_frontends_sockets_each_take_a_share_of_new_connections() -> None:
    """The kernel spreads connections over the sockets (by their addresses' hash): of 64, each
    of two sockets takes some (all on one: a chance of 2 in 2^64). One shared socket let
    whichever frontend woke first take most of a burst."""
    port = _free_port()
    listeners = listening_sockets(Config(api_server_count=2, port=port), 2)
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
    try:
        taken = [0, 0]
        while sum(taken) < 64:  # each connection is queued on one socket or the other
            ready, _, _ = select.select(listeners, [], [], 30)
            assert ready, f"{64 - sum(taken)} connections never arrived"
            for listener in ready:
                listener.accept()[0].close()
                taken[listeners.index(listener)] += 1
        assert min(taken) > 0, taken
    finally:
        for sock in clients + listeners:
            sock.close()


def _free_port() -> int:
    with socket.socket() as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_replicas_share_gpus_where_each_ones_kv_cache_is_sized_in_bytes(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    config = Config(
        device="cuda",
        data_parallel_size=2,
        prefill_replicas=1,
        kv_cache_memory_bytes=2 << 30,
        port=_free_port(),
    )
    launcher = Launcher(config)
    for listener in launcher.listeners:
        listener.close()
    shutil.rmtree(launcher.runtime, ignore_errors=True)
    assert [replica_devices(launcher.gpus, r, launcher.config) for r in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "4"},
        {"CUDA_VISIBLE_DEVICES": "4"},
    ]
    # Handed over in GPU memory: each replica sees the others' GPUs too, its own first.
    cuda = config.replace(data_parallel_size=3, kv_buffer_device="cuda")
    assert [replica_devices(["4", "5", "6"], r, cuda) for r in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "4,5,6"},
        {"CUDA_VISIBLE_DEVICES": "5,4,6"},
        {"CUDA_VISIBLE_DEVICES": "6,4,5"},
    ]
    # The prefill replica's executor serves its KV where the decode replica's fetches it.
    addresses = launcher.config.addresses("kv_transfer_address")
    assert [a.rsplit("/", 1)[1] for a in addresses] == ["kv-transfer-0", "kv-transfer-1"]
    with pytest.raises(ConfigError, match="replicas may share GPUs"):
        Launcher(config.replace(kv_cache_memory_bytes=None))
