"""Check that the wheels in a folder, installed with ``--no-deps`` on the GPU image, have every requirement met.

    python bench/check_wheels.py .whl [--image bench/gpu_image_packages.txt] [--python 3.12.3]

Each wheel's ``Requires-Dist`` lines (markers evaluated for the image's Python on Linux, extras skipped) must be met
by another wheel in the folder or by a package of the image (``name==version`` lines are checked against the
specifier; a name without a version counts as present, and is reported as unchecked). Exit 0 when all are met, 1
otherwise, 2 on bad input. Used by ``bench/gpu_prepare.sh``; needs ``packaging`` (pip's own copy will do).
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # pragma: no cover - pip always vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_image(path: Path) -> dict[str, str | None]:
    """``{canonical name: version or None}`` from the image's package list."""
    out: dict[str, str | None] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonical(name)] = version or None
    return out


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(zf.read(meta).decode("utf-8"))
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def check(folder: Path, image: dict[str, str | None], python: str) -> tuple[list[str], list[str]]:
    """→ (problems, notes) for every wheel in ``folder``."""
    env = {"python_version": ".".join(python.split(".")[:2]), "python_full_version": python,
           "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "extra": "",
           "implementation_name": "cpython", "platform_machine": "x86_64"}
    wheels = {}
    for w in sorted(folder.glob("*.whl")):
        name, version, reqs = wheel_metadata(w)
        if canonical(name) in wheels:
            return [f"two wheels of {name}: keep one version (two stop the whole install)"], []
        wheels[canonical(name)] = (version, reqs, w.name)
    problems, notes = [], []
    for name, (_version, reqs, fname) in wheels.items():
        if canonical(name) in image:
            notes.append(f"{fname}: {name} is on the image too (ours shadows it on PYTHONPATH)")
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            have = wheels.get(canonical(req.name))
            got = have[0] if have else image.get(canonical(req.name), "")
            if got == "" and canonical(req.name) not in image:
                problems.append(f"{fname}: needs {req}, which is neither on the image nor in {folder}")
            elif got is None:
                notes.append(f"{fname}: needs {req}; the image has {req.name} (version not recorded)")
            elif req.specifier and not req.specifier.contains(Version(got), prereleases=True):
                problems.append(f"{fname}: needs {req}, but {req.name} is {got}")
    return problems, notes


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--image", type=Path, default=here / "gpu_image_packages.txt")
    ap.add_argument("--python", default="3.12.3")
    args = ap.parse_args(argv)
    if not args.folder.is_dir() or not any(args.folder.glob("*.whl")):
        sys.stderr.write(f"{args.folder}: no wheels there; run bench/gpu_prepare.sh first.\n")
        return 2
    problems, notes = check(args.folder, read_image(args.image), args.python)
    for line in notes:
        sys.stdout.write(f"note: {line}\n")
    for line in problems:
        sys.stdout.write(f"MISSING: {line}\n")
    sys.stdout.write(f"{'all requirements met' if not problems else f'{len(problems)} unmet'} "
                     f"({len(list(args.folder.glob('*.whl')))} wheels)\n")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
