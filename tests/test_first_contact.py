"""First contact as a vLLM user makes it, without starting a tree: ``cdb serve MODEL`` (positional or ``--model``),
a Hugging Face id read from the local cache (never the network), ``--served-model-name``, the HTTP API on by
default (``--http`` moves it, ``--no-http`` turns it off) and ``--version``. ``cdb serve`` runs for real up to the
launch of the tree, which a stand-in records instead of starting."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cdb import cli, processes, serve
from cdb.model_source import ModelNotFoundError, hub_cache, resolve_model
from cdb.processes import scheduler_parser
from services.settings.checks import SettingsError
from services.settings.source import load_configuration

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "models" / "ouro-kjv"  # a real checkpoint folder, copied into the fake cache as links
HUB_ID = "ByteDance/Ouro-1.4B"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root: Path, repo_id: str = HUB_ID, *, ref: bool = True) -> Path:
    """A Hugging Face hub cache under ``root`` holding ``repo_id`` as ``hf download`` leaves it: files in
    ``blobs/`` (here links to the shipped checkpoint's), ``snapshots/<rev>/`` of relative links to them and
    ``refs/main`` naming the revision. Returns the snapshot folder."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, src in enumerate(sorted(p for p in SHIPPED.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"{i:040x}"
        blob.symlink_to(src)
        (snapshot / src.name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@dataclass
class Launch:
    """What ``cdb serve`` handed to the launcher: the resolved configuration (engine config and settings) and the
    listen addresses it checked."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)

    @property
    def settings(self) -> Any:
        return self.calls[-1]["resolved"].settings

    @property
    def config(self) -> Any:
        return self.calls[-1]["resolved"].engine


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Launch]:
    """``cdb serve`` with the tree's launch recorded, not run; this process's environment restored afterwards;
    ports recorded, not probed (the conventional 8000 may be taken on this machine); logging left as it is."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith(("CDB_", "HF_"))})
    seen = Launch()

    def serve_forever(resolved: Any, listen: str) -> int:
        seen.calls.append({"resolved": resolved, "listen": listen})
        return 0

    monkeypatch.setattr(serve, "serve_forever", serve_forever)
    monkeypatch.setattr(serve, "check_can_listen", seen.checked.append)
    for module in (serve, processes):  # this test process keeps its own logging
        monkeypatch.setattr(module, "configure_logging", lambda *a, **kw: None)
    yield seen


# --- the model named --------------------------------------------------------------------------------------------


def test_the_positional_model_is_the_model_and_a_different_flag_is_one_line_error(
    launch: Launch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve.serve_main(["ouro-tiny", "--no-http"]) == 0
    assert launch.config.model == "ouro-tiny"
    assert serve.serve_main(["huginn-tiny", "--model", "huginn-tiny", "--no-http"]) == 0, "the same twice is fine"
    assert launch.config.model == "huginn-tiny"
    capsys.readouterr()
    assert serve.serve_main(["ouro-tiny", "--model", "huginn-tiny", "--no-http"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["cdb serve: the model is named twice, ouro-tiny (MODEL) and huginn-tiny (--model): give one"]
    assert len(launch.calls) == 2, "nothing started for the refused command"


def test_a_hub_id_resolves_to_its_snapshot_as_huggingface_hub_finds_it(tmp_path: Path) -> None:
    snapshot = fake_hub_cache(tmp_path / "hub")
    source = resolve_model(HUB_ID, {"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert (source.name, source.path, source.from_cache) == (HUB_ID, str(snapshot), True)
    hub = pytest.importorskip("huggingface_hub")  # the layout is huggingface_hub's own: it agrees, offline
    assert hub.snapshot_download(HUB_ID, cache_dir=tmp_path / "hub", local_files_only=True) == str(snapshot)
    # a preset, a shipped name and an existing folder are left to the loader, whatever the cache holds
    for name in ("ouro-tiny", "ouro-kjv", str(SHIPPED)):
        assert resolve_model(name, {"HF_HUB_CACHE": str(tmp_path / "hub")}).path == name


def test_without_refs_main_the_only_snapshot_is_taken_and_several_are_refused(tmp_path: Path) -> None:
    snapshot = fake_hub_cache(tmp_path, ref=False)
    assert resolve_model(HUB_ID, {"HF_HUB_CACHE": str(tmp_path)}).path == str(snapshot)
    (snapshot.parent / "another").mkdir()
    with pytest.raises(ModelNotFoundError, match="holds 2 snapshots and no refs/main"):
        resolve_model(HUB_ID, {"HF_HUB_CACHE": str(tmp_path)})


def test_the_cache_folder_is_found_as_huggingface_hub_finds_it() -> None:
    assert hub_cache({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == Path("/a")
    assert hub_cache({"HUGGINGFACE_HUB_CACHE": "/legacy"}) == Path("/legacy")
    assert hub_cache({"HF_HOME": "/b", "XDG_CACHE_HOME": "/c"}) == Path("/b/hub")
    assert hub_cache({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/hub")
    assert hub_cache({}) == Path.home() / ".cache" / "huggingface" / "hub"


def test_cdb_serve_a_hub_id_loads_its_snapshot_and_serves_it_under_the_id(
    launch: Launch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = fake_hub_cache(tmp_path / "hub")
    os.environ["HF_HUB_CACHE"] = str(tmp_path / "hub")
    assert serve.serve_main([HUB_ID, "--listen", "127.0.0.1:0", "--no-http"]) == 0
    assert launch.config.model == str(snapshot), "every process loads the snapshot folder (checked by the preflight)"
    assert launch.settings.served_model_name == HUB_ID, "the API names the model as the user did"
    assert f"{HUB_ID} from the local Hugging Face cache, {snapshot}" in capsys.readouterr().out


def test_a_hub_id_not_in_the_cache_is_one_line_naming_the_cache_and_starts_nothing(
    launch: Launch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.environ["HF_HOME"] = str(tmp_path / "hf")
    assert serve.serve_main(["--model", "Nobody/Nothing-1B", "--no-http"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("cdb serve: --model Nobody/Nothing-1B: no such folder, and not in the Hugging Face cache")
    assert str(tmp_path / "hf" / "hub") in err[0] and "models--Nobody--Nothing-1B" in err[0]
    assert launch.calls == [] and launch.checked == []


# --- the names served, the HTTP API -----------------------------------------------------------------------------


def test_served_model_names_reach_the_scheduler_first_one_first(launch: Launch) -> None:
    assert serve.serve_main(["ouro-tiny", "--served-model-name", "ouro", "tiny", "--no-http"]) == 0
    assert launch.settings.served_model_name == "ouro,tiny"
    assert serve.serve_main(["ouro-tiny", "--no-http"]) == 0
    assert launch.settings.served_model_name == "", "without the option: the APIs report the model as configured"
    with pytest.raises(SystemExit):  # the names travel comma-separated: a comma in one is refused
        serve.serve_main(["ouro-tiny", "--served-model-name", "a,b", "--no-http"])
    assert len(launch.calls) == 2
    conf = load_configuration({"CDB_SERVED_MODEL_NAME": "x, y"})
    assert scheduler_parser(conf).parse_args(["--served-model-name", "z"]).served_model_name == ["z"]
    with pytest.raises(SettingsError, match=r"CDB_SERVED_MODEL_NAME.*none empty"):
        load_configuration({"CDB_SERVED_MODEL_NAME": "x,,y"})


def test_the_http_api_is_on_by_default_on_port_8000_beside_grpc(launch: Launch) -> None:
    assert serve.serve_main(["ouro-tiny", "--listen", "127.0.0.1:50999"]) == 0
    assert launch.settings.http_addr == "127.0.0.1:8000"
    assert launch.checked == ["127.0.0.1:50999", "127.0.0.1:8000"], "both ports checked before anything starts"


def test_http_moves_the_api_and_no_http_turns_it_off(launch: Launch) -> None:
    assert serve.serve_main(["ouro-tiny", "--http", "127.0.0.1:8123"]) == 0
    assert launch.settings.http_addr == "127.0.0.1:8123"
    assert serve.serve_main(["ouro-tiny", "--no-http"]) == 0
    assert launch.settings.http_addr == ""
    os.environ["CDB_HTTP_ADDR"] = ""  # configured empty: none, as --no-http
    assert serve.serve_main(["ouro-tiny"]) == 0
    assert launch.settings.http_addr == ""
    with pytest.raises(SystemExit):
        serve.serve_main(["ouro-tiny", "--http", "127.0.0.1:8123", "--no-http"])


def test_a_taken_http_port_says_how_to_move_or_drop_it(
    monkeypatch: pytest.MonkeyPatch, launch: Launch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.net import ListenError

    def taken(address: str) -> None:
        if address.endswith(":8000"):
            raise ListenError(f"cannot listen on {address}: address already in use")

    monkeypatch.setattr(serve, "check_can_listen", taken)
    assert serve.serve_main(["ouro-tiny", "--listen", "127.0.0.1:0"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "cdb serve: cannot listen on 127.0.0.1:8000: address already in use "
        "(the HTTP API: --http HOST:PORT moves it, --no-http turns it off)"
    ]
    assert launch.calls == [] and "CDB_HTTP_ADDR" not in os.environ, "a refused command changes no environment"


def test_cdb_scheduler_resolves_a_hub_id_and_serves_it_under_the_id_or_the_names_given(
    monkeypatch: pytest.MonkeyPatch, launch: Launch, tmp_path: Path
) -> None:
    """The scheduler as compose and Kubernetes run it: ``CDB_MODEL`` a hub id, then the snapshot as ``--model`` and
    the names in ``CDB_SERVED_MODEL_NAME``."""
    import services.api.server

    snapshot = fake_hub_cache(tmp_path / "hub")
    runs: list[tuple[Any, Any]] = []
    monkeypatch.setattr(processes, "die_with_parent", lambda: None)  # not this test process
    monkeypatch.setattr(services.api.server, "run_scheduler", lambda c, *a, **kw: runs.append((c, kw)))
    os.environ.update(HF_HUB_CACHE=str(tmp_path / "hub"), CDB_MODEL=HUB_ID)
    assert processes.scheduler_main(["--in-process", "--listen", "127.0.0.1:0"]) == 0
    config, kw = runs[-1]
    assert (config.model, kw["settings"].served_model_name) == (str(snapshot), HUB_ID)
    os.environ["CDB_SERVED_MODEL_NAME"] = "ouro,tiny"
    assert processes.scheduler_main(["--in-process", "--listen", "127.0.0.1:0", "--model", str(snapshot)]) == 0
    assert runs[-1][1]["settings"].served_model_name == "ouro,tiny"


# --- the version ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--version"], ["scheduler", "--version"]])
def test_cdb_version_prints_the_projects_version(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"cdb {version}\n"


def test_cdb_presets_lists_the_default_model_first(capsys: pytest.CaptureFixture[str]) -> None:
    from cdb.cli import _presets
    from cdb_model.loader import DEFAULT_MODEL

    assert _presets([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == [DEFAULT_MODEL, "*", "shipped"]
    assert any(line.startswith("ouro-tiny ") for line in lines) and "default model" in lines[-1]
