"""pytest at the repository root, which is itself the package `fuselm`.

pytest collects a folder holding `__init__.py` as a Package and imports that file to look for
`setup_module`. It names the module after the folder, and a folder whose name is no identifier
(`fuselm-main`, as a source zip unpacks) leaves it as a top-level `__init__`, whose relative imports
fail: every test would error. The root holds no tests of its own, so collect it as a plain folder.
A conftest's own collection hooks only apply below it, hence the plugin registered here.
"""
from __future__ import annotations

import pytest


class _RootAsFolder:
    """Collect the rootdir as a plain Dir, never a Package."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if path == parent.config.rootpath:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config):
    config.pluginmanager.register(_RootAsFolder(), "fuselm-root-as-folder")
