"""``clone-pipeline package``: what spark-submit needs to run a job on a cluster.

Executors import ``clone`` (the writer, the client, the codec) and its
pure-Python dependency ``uuid6``; both go into one zip for ``--py-files``.
pyzmq is compiled, so it cannot travel in a zip: it must be installed on every
node (or shipped in a packed virtualenv, docs/pipeline.md), as pyarrow must
for Spark itself.  The driver script is a copy of :mod:`clone.pipeline.submit`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DRIVER_SCRIPT", "ZIP_NAME", "Package", "write_package"]

ZIP_NAME = "clone.zip"
DRIVER_SCRIPT = "clone_pipeline_submit.py"
# Pure-Python packages the executors import besides ``clone``.
_VENDORED = ("clone", "uuid6")
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


@dataclass(frozen=True, slots=True)
class Package:
    zip_path: str
    driver_path: str
    modules: int


def _package_root(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{name} is not an installed package")
    return Path(next(iter(spec.submodule_search_locations)))


def write_package(output: str | os.PathLike[str]) -> Package:
    """Write ``output/clone.zip`` and ``output/clone_pipeline_submit.py``
    (replacing them) and return their absolute paths."""
    out = Path(output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    zip_path = out / ZIP_NAME
    tmp = zip_path.with_suffix(".zip.tmp")
    modules = 0
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in _VENDORED:
            root = _package_root(name)
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
                for filename in sorted(filenames):
                    if filename.endswith(_SKIP_SUFFIXES):
                        continue
                    path = Path(dirpath) / filename
                    arcname = Path(name) / path.relative_to(root)
                    zf.write(path, arcname.as_posix())
                    modules += filename.endswith(".py")
    os.replace(tmp, zip_path)
    driver = out / DRIVER_SCRIPT
    shutil.copyfile(Path(__file__).with_name("submit.py"), driver)
    return Package(str(zip_path), str(driver), modules)
