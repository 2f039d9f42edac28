"""A ``sitecustomize`` that makes torch and torchvision unimportable in a child process, as on the
CPU install; every attempt to import them is noted in a file."""

from __future__ import annotations

import textwrap
from pathlib import Path

_NO_TORCH = """
import sys
from importlib.abc import MetaPathFinder

class _NoTorch(MetaPathFinder):
    # the CPU install: torch and torchvision are not there; every attempt is noted
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchvision"):
            with open({log!r}, "a") as f:
                f.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
open({log!r} + ".loaded", "w").close()
"""


def no_torch_site(folder: Path, attempts: Path) -> Path:
    """``folder`` holding the ``sitecustomize.py``: put it first on the child's PYTHONPATH.
    ``attempts`` lists every import of torch tried; ``<attempts>.loaded`` says it ran."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(textwrap.dedent(_NO_TORCH.format(log=str(attempts))))
    return folder
