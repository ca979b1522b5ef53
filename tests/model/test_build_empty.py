"""``build_empty``: the model's names and shapes on the meta device, without running any initialiser (a stage's
start does not pay for torch's reference kernels), and nothing changed outside it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cdb_model.models import build_empty, build_model
from cdb_model.presets import preset_config


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
def test_an_empty_model_has_the_full_models_names_and_shapes_on_the_meta_device(name: str) -> None:
    config = preset_config(name)
    empty = build_empty(config).state_dict()
    full = build_model(config).state_dict()
    assert {k: tuple(t.shape) for k, t in empty.items()} == {k: tuple(t.shape) for k, t in full.items()}
    assert all(t.is_meta for t in empty.values())
    assert all(not t.is_meta for t in full.values())


def test_initialisers_still_fill_real_tensors_after_an_empty_build() -> None:
    build_empty(preset_config("ouro-tiny"))
    t = torch.zeros(1000)
    torch.nn.init.normal_(t)
    assert t.std().item() > 0.5


def test_an_empty_build_imports_no_reference_kernels() -> None:
    code = (
        "import sys, torch\n"
        "from cdb_model.models import build_empty\n"
        "from cdb_model.presets import preset_config\n"
        "build_empty(preset_config('ouro-tiny'))\n"
        "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stdout
