"""Build hook: ship ``kvcached_sglang.pth`` at the root of the wheel.

Everything else about the package lives in ``pyproject.toml``. A ``.pth`` file
only runs when it sits directly in a site directory (``site-packages``), and
setuptools has no setting that puts a file there: ``data_files`` land under the
environment's prefix (``<venv>/kvcached_sglang.pth``), where nothing reads them,
and package data lands inside the package. So ``build_py`` copies the file to
the root of ``build_lib``, which becomes the root of the (``py3-none-any``)
wheel, which pip unpacks into ``site-packages``. See
docs/sglang-integration.md, "Delivery".
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "kvcached_sglang.pth"
PTH_SOURCE = Path(__file__).resolve().parent / "kvcached" / "integrations" / "sglang" / PTH_NAME


class BuildPyWithPth(build_py):
    """``build_py`` that also puts the SGLang autopatch ``.pth`` at the wheel root."""

    def run(self) -> None:
        super().run()
        if not PTH_SOURCE.is_file():
            raise FileNotFoundError(
                f"{PTH_SOURCE} is missing: the SGLang autopatch hook cannot be shipped"
            )
        self.copy_file(str(PTH_SOURCE), str(Path(self.build_lib) / PTH_NAME), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH_NAME)]


setup(cmdclass={"build_py": BuildPyWithPth})
