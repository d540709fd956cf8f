"""Check pyproject.toml's pins against the requirements of torch's CUDA wheel on PyPI.

The tested build here is torch's CPU wheel, which pins nothing of CUDA's stack; the CUDA
wheel a GPU box installs pins exact versions (triton, nccl, cudnn, ...). A project pin
that contradicts one of those cannot resolve there, and nothing on a CPU machine shows it.

This asks pip for the CUDA wheel's metadata without installing it or resolving its
dependencies (``--dry-run --no-deps`` for the target platform; pip may still download the
wheel to read it), then, for each of the wheel's requirements that applies on the target
platform and names a package pyproject.toml pins exactly (``name==version``, in
``dependencies`` or any optional-dependencies group), checks that the pinned version
satisfies the wheel's specifier. Exits 1 naming each contradiction.

    python scripts/check_requirements.py                                  # asks PyPI
    python scripts/check_requirements.py --save-report assets/install/torch-2.13.0-cu-report.json
    python scripts/check_requirements.py --report-file assets/install/torch-2.13.0-cu-report.json

The saved report is pip's ``--report`` JSON trimmed to the wheel's name, version,
``requires_dist`` and download URL; ``--report-file`` checks one offline.
``assets/install/check_requirements.txt`` is the output of the last real run.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def project_pins(pyproject: dict) -> list[tuple[str, Requirement]]:
    """``(group, requirement)`` for every exact pin, ``group`` being ``dependencies`` or the
    optional-dependencies extra it sits in."""
    project = pyproject["project"]
    groups = {"dependencies": project.get("dependencies", []), **project.get("optional-dependencies", {})}
    pins = []
    for group, lines in groups.items():
        for line in lines:
            requirement = Requirement(line)
            specs = list(requirement.specifier)
            if len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version:
                pins.append((group, requirement))
    return pins


def pinned_version(requirement: Requirement) -> str:
    return next(iter(requirement.specifier)).version


def torch_pin(pyproject: dict) -> str:
    for _, pin in project_pins(pyproject):
        if canonicalize_name(pin.name) == "torch":
            return pinned_version(pin)
    raise SystemExit("check_requirements: pyproject.toml pins no torch version")


def marker_environment(platform: str, python_version: str) -> dict[str, str]:
    """PEP 508 marker values of a manylinux target (``manylinux_2_28_x86_64``, ``3.11``)."""
    match = re.fullmatch(r"manylinux_\d+_\d+_(\w+)", platform)
    if match is None:
        raise SystemExit(f"check_requirements: only manylinux_X_Y_<arch> platforms are supported, not {platform!r}")
    return {
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": match.group(1),
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "python_version": python_version,
        # Markers on the micro version are read at its lowest release.
        "python_full_version": f"{python_version}.0",
        # No extras of the wheel are requested.
        "extra": "",
    }


def fetch_report(torch_version: str, platform: str, python_version: str) -> dict:
    """pip's installation report for ``torch==torch_version`` on the target, nothing installed."""
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--no-deps",
                   "--only-binary=:all:", "--platform", platform, "--python-version", python_version,
                   "--implementation", "cp", "--target", str(Path(tmp) / "target"),
                   "--report", str(report_path), f"torch=={torch_version}"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"check_requirements: pip failed ({' '.join(command)}):\n{done.stderr}")
        return json.loads(report_path.read_text())


def trim(report: dict) -> dict:
    """The report cut down to what identifies the wheel and what it requires."""
    (entry,) = report["install"]
    metadata = entry["metadata"]
    return {
        "version": report["version"],
        "pip_version": report["pip_version"],
        "install": [{
            "download_info": {key: entry["download_info"][key] for key in ("url", "archive_info")
                              if key in entry["download_info"]},
            "metadata": {key: metadata[key] for key in ("name", "version", "requires_python", "requires_dist")
                         if key in metadata},
        }],
    }


def compare(report: dict, pyproject: dict, environment: dict[str, str]) -> tuple[list[tuple[str, ...]], list[str]]:
    """Rows ``(package, wheel requires, project pins, ok)`` and one message per contradiction."""
    pins = project_pins(pyproject)
    (entry,) = report["install"]
    wheel_name, wheel_version = entry["metadata"]["name"], entry["metadata"]["version"]
    wheel_file = entry["download_info"]["url"].rsplit("/", 1)[-1]
    errors, torch_version = [], torch_pin(pyproject)
    if canonicalize_name(wheel_name) != "torch" or Version(wheel_version) != Version(torch_version):
        # A local build (2.13.0+cpu, from a find-links folder) is not the wheel PyPI serves.
        errors.append(f"the report is for {wheel_name} {wheel_version} ({wheel_file}), "
                      f"but pyproject.toml pins torch=={torch_version}")
    rows = []
    for line in entry["metadata"].get("requires_dist", []):
        wheel_requirement = Requirement(line)
        if wheel_requirement.marker is not None and not wheel_requirement.marker.evaluate(environment):
            continue
        for group, pin in pins:
            if canonicalize_name(pin.name) != canonicalize_name(wheel_requirement.name):
                continue
            if pin.marker is not None and not pin.marker.evaluate(environment):
                continue
            ok = wheel_requirement.specifier.contains(pinned_version(pin), prereleases=True)
            wheel_spec = f"{wheel_requirement.name}{wheel_requirement.specifier or ' (any)'}"
            rows.append((pin.name, wheel_spec, f"{pin} [{group}]", "ok" if ok else "NO"))
            if not ok:
                errors.append(f"pyproject.toml pins {pin} ({group}), but {wheel_file} requires {wheel_spec}")
    return rows, errors


def table(rows: list[tuple[str, ...]]) -> str:
    header = ("package", "wheel requires", "project pins", "ok")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in [header, *rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    parser.add_argument("--report-file", type=Path, help="check this saved report offline instead of asking pip")
    parser.add_argument("--save-report", type=Path, help="write the (trimmed) report here")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64")
    parser.add_argument("--python-version", default="3.11")
    args = parser.parse_args()

    pyproject = tomllib.loads(args.pyproject.read_text())
    if args.report_file is not None:
        report = json.loads(args.report_file.read_text())
    else:
        report = fetch_report(torch_pin(pyproject), args.platform, args.python_version)
    report = trim(report)
    if args.save_report is not None:
        args.save_report.parent.mkdir(parents=True, exist_ok=True)
        args.save_report.write_text(json.dumps(report, indent=2) + "\n")

    rows, errors = compare(report, pyproject, marker_environment(args.platform, args.python_version))
    metadata = report["install"][0]["metadata"]
    print(f"{metadata['name']} {metadata['version']}: {report['install'][0]['download_info']['url'].rsplit('/', 1)[-1]}"
          f" (markers for {args.platform}, Python {args.python_version})")
    print(table(rows))
    for error in errors:
        print(f"CONTRADICTION: {error}", file=sys.stderr)
    if errors:
        return 1
    print(f"{args.pyproject.name}: every pin agrees with the wheel's requirements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
