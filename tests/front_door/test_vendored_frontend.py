"""The page's vendored libraries (and the tests' axe-core) are exactly what scripts/vendor_frontend.py
fetched from npm: every file matches its manifest's sha256, nothing unlisted sits beside them, each
package keeps its licence and the version pinned in the script, and the pages load nothing from a CDN."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "vendor_frontend.py"
FOLDERS = [REPO / "edge" / "static" / "vendor", REPO / "tests" / "fixtures" / "vendor"]


def vendoring_script():
    spec = importlib.util.spec_from_file_location("vendor_frontend", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda folder: str(folder.relative_to(REPO)))
def test_vendored_files_match_their_manifest(folder: Path):
    manifest = json.loads((folder / "manifest.json").read_text())
    listed = {}
    for name, package in manifest["packages"].items():
        assert any(Path(path).name.startswith("LICENSE") for path in package["files"]), (
            f"{name} has no licence"
        )
        listed.update(package["files"])
    present = {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()} - {
        "manifest.json"
    }
    assert present == set(listed), "files beside the vendored ones, or listed ones missing"
    for path, checksum in listed.items():
        assert hashlib.sha256((folder / path).read_bytes()).hexdigest() == checksum, f"{path} was changed"


def test_the_manifests_hold_the_versions_the_script_pins():
    script = vendoring_script()
    for package in script.PACKAGES:
        manifest = json.loads((package.destination / "manifest.json").read_text())
        entry = manifest["packages"][package.name]
        assert (entry["version"], entry["integrity"]) == (package.version, package.integrity)
        assert set(entry["files"]) == set(package.files.values())


def test_the_pages_load_nothing_from_elsewhere():
    static = REPO / "edge" / "static"
    for page in [*static.glob("*.html"), *static.glob("*.js"), *static.glob("*.css")]:
        text = page.read_text()
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), page.name
        assert not re.search(r"""(import|from)\s*\(?\s*["'](https?:)?//""", text), page.name
