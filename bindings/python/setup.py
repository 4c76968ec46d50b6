"""Packages zeroalloc-startup.pth at the top of site-packages, where Python's site module
runs it at start-up (see zeroalloc/_startup.py); everything else is in pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py


class build_py_with_startup_hook(build_py):
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        self.copy_file(os.path.join(here, "zeroalloc-startup.pth"),
                       os.path.join(self.build_lib, "zeroalloc-startup.pth"))


setup(cmdclass={"build_py": build_py_with_startup_hook})
