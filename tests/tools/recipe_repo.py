"""A model repository for recipe tests: model ``tiny`` in two versions whose answers say which
version computed them, and a recipes file over it."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import TINY_TOML, export_onnx

RECIPES = """\
[recipe.housing-black]
description = "Housing, black"
model = "tiny"
version = 1
verdict = { ok_threshold = 0.5 }

[recipe.housing-white]
model = "tiny"
version = 2
verdict = { ok_threshold = 0.6 }

[recipe.housing-grey]
model = "tiny"
version = 1
verdict = { ok_threshold = 0.55 }

[station.st1]
recipe = "housing-black"
cameras = ["cam-1"]

[station.st2]
"""

# what each version answers for any frame: version 1 says "ok", version 2 says "dent"
LOGITS = {1: [2.0, 0.0, 0.0], 2: [0.0, 2.0, 0.0]}


def versioned_tiny(folder: Path) -> Path:
    """Model ``tiny`` with versions 1 and 2, whose answers tell which version computed them."""
    import torch

    class Constant(torch.nn.Module):
        def __init__(self, logits) -> None:
            super().__init__()
            self.register_buffer("logits", torch.tensor(logits))

        def forward(self, x):
            return x.mean(dim=(1, 2, 3))[:, None] * 0 + self.logits

    for v, logits in LOGITS.items():
        export_onnx(Constant(logits), folder / "tmp", (2, 3, 32, 32), TINY_TOML)
        shutil.move(folder / "tmp" / "1", folder / str(v))
    shutil.move(folder / "tmp" / "model.toml", folder / "model.toml")
    (folder / "tmp").rmdir()
    return folder
