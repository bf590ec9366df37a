"""Refreshes the chat page's vendored JavaScript libraries from npm, and the test-only axe-core.

Each package is fetched at its pinned version with ``npm pack`` (Node is needed only here, never at run
time), its tarball checked against the pinned npm integrity, and the listed builds and licences copied
into the destination folder, which gets a ``manifest.json`` of sha256 checksums that
tests/front_door/test_vendored_frontend.py checks the committed files against. To upgrade a library,
change its version and integrity here (``npm view PKG@VERSION dist.integrity``) and run:

    python scripts/vendor_frontend.py
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Served by the edge under /static/vendor/ (edge/static is mounted at /static).
PAGE_VENDOR = REPO / "edge" / "static" / "vendor"
# Injected into pages by the browser tests only; never served by the edge.
TEST_VENDOR = REPO / "tests" / "fixtures" / "vendor"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    integrity: str  # npm's dist.integrity of the tarball
    files: dict[str, str]  # path in the tarball (under package/) -> path under the destination
    destination: Path


PACKAGES = [
    Package(
        "marked",
        "18.3.0",
        "sha512-ed8zmPXlBb3UfGXN5iHMQyMhFpdqLgoV5umUXx/Q1R+FW3q8VpqpyoKUwlENL9appo2UMvNLURDVaT3AMOryGA==",
        {"lib/marked.esm.js": "marked/marked.esm.js", "LICENSE": "marked/LICENSE"},
        PAGE_VENDOR,
    ),
    Package(
        "dompurify",
        "3.5.0",
        "sha512-LYC0ZkE8P1V42JsRYTwMdme/2ET8SpOc5AA2eOFjP/IadvRd2fwiT4TVz5vkfy0XUx12aS2UaRkTnfVPNOv9vw==",
        # The ES module build (DOMPurify publishes its minified build only as UMD); renamed .js so any
        # static file server gives it the JavaScript MIME type that module scripts require.
        {"dist/purify.es.mjs": "dompurify/purify.es.js", "LICENSE": "dompurify/LICENSE"},
        PAGE_VENDOR,
    ),
    Package(
        "@highlightjs/cdn-assets",
        "11.12.0",
        "sha512-KvOKXODaiFmId9xaq3xc5xCL66wVLUuOngDbO9B/kewbFTqdGbn2nJxNhN3H5R1cgDTVj6R8vH0zgiNDEGjpDw==",
        {
            "es/highlight.min.js": "highlight.js/highlight.min.js",
            "styles/github.min.css": "highlight.js/github.min.css",
            "styles/github-dark.min.css": "highlight.js/github-dark.min.css",
            "LICENSE": "highlight.js/LICENSE",
        },
        PAGE_VENDOR,
    ),
    Package(
        "axe-core",
        "4.14.1",
        "sha512-FHfa+lmNjQZfJz1q8wKqIDwC6DExcHt/pkjNQb09a3NPjCKg2rhu5qb2S4r76ASyFNNtuFooJpZe37OgudVGtQ==",
        {
            "axe.min.js": "axe-core/axe.min.js",
            "LICENSE": "axe-core/LICENSE",
            "LICENSE-3RD-PARTY.txt": "axe-core/LICENSE-3RD-PARTY.txt",
        },
        TEST_VENDOR,
    ),
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def integrity_of(tarball: Path) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()


def fetch(package: Package, work: Path) -> Path:
    """The package's tarball from npm, checked against its pinned integrity."""
    spec = f"{package.name}@{package.version}"
    out = subprocess.run(
        ["npm", "pack", spec, "--json", "--pack-destination", str(work)],
        check=True,
        capture_output=True,
        text=True,
    )
    tarball = work / json.loads(out.stdout)[0]["filename"]
    if integrity_of(tarball) != package.integrity:
        raise SystemExit(f"{spec}: the tarball's integrity is not the pinned one; refusing to vendor it")
    return tarball


def vendor(package: Package, tarball: Path, work: Path) -> dict[str, str]:
    """Copies the package's files into its destination; returns their checksums by destination path."""
    unpacked = work / package.name.replace("/", "+")
    with tarfile.open(tarball) as archive:
        archive.extractall(unpacked, filter="data")
    checksums = {}
    for source, target in package.files.items():
        destination = package.destination / target
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(unpacked / "package" / source, destination)
        checksums[target] = sha256(destination)
    return checksums


def main() -> None:
    destinations = {package.destination for package in PACKAGES}
    for folder in destinations:
        shutil.rmtree(folder, ignore_errors=True)
    manifests: dict[Path, dict] = {folder: {"packages": {}} for folder in destinations}
    with tempfile.TemporaryDirectory() as scratch:
        for package in PACKAGES:
            tarball = fetch(package, Path(scratch))
            manifests[package.destination]["packages"][package.name] = {
                "version": package.version,
                "integrity": package.integrity,
                "files": vendor(package, tarball, Path(scratch)),
            }
            print(f"vendored {package.name}@{package.version} into {package.destination.relative_to(REPO)}")
    for folder, manifest in manifests.items():
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(main())
