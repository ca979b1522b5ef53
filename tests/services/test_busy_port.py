"""A busy port is refused with one clear line, never shared (gRPC's default SO_REUSEPORT would share it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from services.net import NO_REUSEPORT, ListenError, check_can_listen, listen_on

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port held by a listener that itself allows SO_REUSEPORT (as a gRPC server with default
    options does): a second reuseport listener would silently share it."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_check_can_listen_refuses_a_held_port(held_port: int) -> None:
    with pytest.raises(ListenError) as err:
        check_can_listen(f"127.0.0.1:{held_port}")
    assert str(err.value) == f"cannot listen on 127.0.0.1:{held_port}: address already in use"
    with pytest.raises(ListenError, match="address already in use"):
        check_can_listen(f"localhost:{held_port}")


def test_check_can_listen_accepts_a_free_port_and_port_zero() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    check_can_listen(f"127.0.0.1:{free}")
    check_can_listen("127.0.0.1:0")


def test_check_can_listen_names_an_unknown_host() -> None:
    with pytest.raises(ListenError, match=r"^cannot listen on no-such-host\.invalid:50051: unknown host"):
        check_can_listen("no-such-host.invalid:50051")


def test_grpc_servers_with_no_reuseport_refuse_the_held_port(held_port: int) -> None:
    server = grpc.server(ThreadPoolExecutor(1), options=NO_REUSEPORT)
    with pytest.raises(ListenError, match=f"^cannot listen on 127.0.0.1:{held_port}: address already in use$"):
        listen_on(server, f"127.0.0.1:{held_port}")


def test_listen_on_reports_grpcs_own_bind_failure(held_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.net.check_can_listen", lambda listen: None)  # as if the port was taken after it
    server = grpc.server(ThreadPoolExecutor(1), options=NO_REUSEPORT)
    with pytest.raises(ListenError, match=f"^cannot listen on 127.0.0.1:{held_port}: "):
        listen_on(server, f"127.0.0.1:{held_port}")


def test_a_unix_socket_with_a_live_server_is_busy_and_a_stale_one_is_not(tmp_path: Path) -> None:
    live, stale = tmp_path / "live.sock", tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(live))
        listener.listen()
        with pytest.raises(ListenError, match=f"^cannot listen on unix:{live}: address already in use$"):
            check_can_listen(f"unix:{live}")
        with pytest.raises(ListenError):
            check_can_listen(f"unix://{live}")
    with socket.socket(socket.AF_UNIX) as gone:
        gone.bind(str(stale))  # the file stays, nobody listens: gRPC replaces it
    check_can_listen(f"unix:{stale}")


@pytest.mark.slow
def test_cdb_scheduler_on_a_held_port_exits_with_one_clear_line(held_port: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CDB_PARENT_PID", None)
    argv = [sys.executable, "-m", "cdb", "scheduler", "--in-process", "--model", "ouro-tiny"]
    proc = subprocess.run(
        [*argv, "--listen", f"127.0.0.1:{held_port}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    expected = f"cdb scheduler: cannot listen on 127.0.0.1:{held_port}: address already in use"
    assert proc.stderr.splitlines() == [expected]


def test_cdb_serve_on_a_held_port_exits_with_one_clear_line_before_starting_anything(
    held_port: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cdb import serve

    def must_not_start(*args: object, **kw: object) -> int:
        raise AssertionError("the process tree was started")

    monkeypatch.setattr(serve, "serve_forever", must_not_start)
    assert serve.serve_main(["--listen", f"127.0.0.1:{held_port}", "--model", "ouro-tiny"]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"cdb serve: cannot listen on 127.0.0.1:{held_port}: address already in use"]
