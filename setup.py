"""Build hook; the project's metadata is in pyproject.toml.

The wheel carries the shipped default model: ``models/defect-classifier`` (about 4 MB) goes into
the wheel as ``visionserve/default_models/defect-classifier``, so that an installed
``visionserve serve`` starts on it from any directory (``visionserve.config.default_models_dir``).
An editable install gets no copy; there the checkout's ``./models`` is the default.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

MODEL = Path(__file__).resolve().parent / "models" / "defect-classifier"


class BuildPyWithDefaultModel(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        if not (MODEL / "model.toml").is_file():
            raise SystemExit(f"{MODEL}/model.toml is missing: the wheel carries the default model")
        target = Path(self.build_lib, "visionserve", "default_models", MODEL.name)
        for src in sorted(p for p in MODEL.rglob("*") if p.is_file()):
            dest = target / src.relative_to(MODEL)
            self.mkpath(str(dest.parent))
            self.copy_file(str(src), str(dest))


setup(cmdclass={"build_py": BuildPyWithDefaultModel})
