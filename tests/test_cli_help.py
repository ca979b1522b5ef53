"""Every option of ``cdb serve``, ``cdb scheduler``, ``cdb stage`` and ``cdb demo`` has help text and shows its
default; every enum option lists its choices; the engine options' help, the ``CDB_*`` table of
``services/settings.py`` and the config-file keys come from one place, the fields' metadata. The parsers are built
as the commands build them, without running anything."""

from __future__ import annotations

import argparse
import enum

import pytest

import services.settings
from cdb.processes import STAGE_ENGINE_FIELDS, scheduler_parser, stage_parser
from cdb.serve import demo_parser, serve_parser
from cdb_engine.options import FIELDS, field_help, field_kind
from services.settings.knobs import Settings
from services.settings.source import load_configuration
from services.settings.table import variables_table

pytestmark = pytest.mark.timeout(30)
BUILDERS = {"serve": serve_parser, "scheduler": scheduler_parser, "stage": stage_parser, "demo": demo_parser}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def parser(request: pytest.FixtureRequest) -> argparse.ArgumentParser:
    return BUILDERS[request.param](load_configuration({}))


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def _rendered_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


def test_every_option_has_help(parser: argparse.ArgumentParser) -> None:
    missing = [a.option_strings[0] for a in _options(parser) if not (a.help or "").strip()]
    assert missing == [], f"{parser.prog}: options without help"
    parser.format_help()  # every help string formats (no stray %)


def test_every_optional_option_shows_its_default(parser: argparse.ArgumentParser) -> None:
    for action in _options(parser):
        text = _rendered_help(parser, action)
        if action.required:
            assert "(default:" not in text, action.option_strings
        else:
            assert "(default: " in text, f"{parser.prog} {action.option_strings[0]}: {text!r}"


def test_every_enum_option_lists_its_choices(parser: argparse.ArgumentParser) -> None:
    enums = 0
    for action in _options(parser):
        kind = field_kind(action.dest)[0] if action.dest in FIELDS else action.type
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            enums += 1
            assert action.choices, f"{parser.prog} {action.option_strings[0]}: an enum without choices"
            assert {m.value for m in kind} <= set(action.choices), action.option_strings[0]
    role = [a for a in _options(parser) if a.dest == "role"]
    assert enums >= (1 if parser.prog == "cdb stage" else 5)
    assert all(list(a.choices or ()) == ["prelude", "loop", "head"] for a in role)


def test_the_engine_options_help_is_the_fields_help(parser: argparse.ArgumentParser) -> None:
    engine = [a for a in _options(parser) if a.dest in FIELDS]
    assert {a.dest for a in engine} == (set(FIELDS) if parser.prog != "cdb stage" else set(STAGE_ENGINE_FIELDS))
    for action in engine:
        assert action.help == field_help(action.dest)


def test_the_default_shown_is_the_sources() -> None:
    """``CDB_MAX_NUM_SEQS=16 cdb serve --help`` shows 16: the flags' defaults are the source's values."""
    parser = serve_parser(load_configuration({"CDB_MAX_NUM_SEQS": "16", "CDB_DTYPE": "bfloat16"}))
    shown = {a.dest: _rendered_help(parser, a) for a in _options(parser)}
    assert shown["max_num_seqs"].endswith("the width of the loop batch (default: 16)")
    assert shown["dtype"].endswith("(default: bfloat16)") and shown["max_depth"].endswith("(default: auto)")
    assert shown["model"].endswith("(default: ouro-kjv)"), "cdb serve's own default: the shipped model"


def test_the_settings_table_is_generated_from_the_fields_help() -> None:
    """One source for the flag help, the variable table and the config-file keys: the fields' metadata. After
    changing a help text, paste ``python -m services.settings`` into the docstring of services/settings.py."""
    doc = services.settings.__doc__ or ""
    assert variables_table() in doc, "the docstring's tables are stale: run python -m services.settings"
    for name in FIELDS:
        assert f"| ``CDB_{name.upper()}`` | " in doc and field_help(name) in doc
    for f in Settings.__dataclass_fields__.values():
        assert f.metadata["help"] in doc, f.name
    assert "``CDB_CONFIG``" in doc
