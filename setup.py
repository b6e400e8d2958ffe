"""The build's one hook: a wheel carries piper's catalog inside its package.

models/, platforms/, calibration/ and validation/ sit at the source checkout's root, beside piper_plan/, where an
editable install reads them. A wheel (``pip install .``, ``pip install git+...``) installs the package alone, so its
build copies those folders into it as piper_plan/_home/ (piper_plan/catalog.py ``project_root`` finds them there).
Everything else is declared in pyproject.toml.
"""

import fnmatch
import os

from setuptools import setup
from setuptools.command.build_py import build_py

CATALOG_FOLDERS = ("models", "platforms", "calibration", "validation")
NOT_SHIPPED = ("*.out", "*.pyc", ".*")                 # a calibration job's Slurm log, bytecode, hidden files
SHIPPED_HOME = os.path.join("piper_plan", "_home")     # piper_plan/catalog.py SHIPPED_HOME


class BuildPyWithCatalog(build_py):
    """build_py, then the catalog folders' files copied into the built package (not in an editable build: the
    package is read from the checkout there, and the checkout holds the folders)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for folder in CATALOG_FOLDERS:
            for parent, _dirs, names in os.walk(folder):
                for name in sorted(names):
                    if not any(fnmatch.fnmatch(name, pattern) for pattern in NOT_SHIPPED):
                        target = os.path.join(self.build_lib, SHIPPED_HOME, parent)
                        self.mkpath(target)
                        self.copy_file(os.path.join(parent, name), os.path.join(target, name))


setup(cmdclass={"build_py": BuildPyWithCatalog})
