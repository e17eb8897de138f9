#!/usr/bin/env python
"""The GPU install's known-good set: resolve it, write it, or check that it still resolves.

    python tools/lock_gpu_constraints.py            # resolve and (re)write requirements/gpu-constraints.txt
    python tools/lock_gpu_constraints.py --check    # resolve with the file as constraints; exit 1 on a conflict

What is resolved: the project's requirements (``setup.py``'s ``INSTALL_REQUIRES``) plus
its ``gpu`` extra, for the GPU target -- CPython 3.12 on Linux x86-64 (manylinux glibc
2.17 through 2.35, what an Ubuntu 22.04 / NGC host runs) -- by pip's own resolver,
``pip install --dry-run --report`` with ``--only-binary=:all:`` and ``--platform``, so
nothing is installed and no sdist is built. The one part that cannot resolve this way is
``transformer_engine_torch`` (transformer-engine's ``pytorch`` extra): PyPI has it only as
an sdist, compiled against the installed torch on a machine with the CUDA toolkit. The
check therefore resolves ``transformer-engine[core_cu13]`` (the binary core library) and
verifies, on the index, that the ``transformer_engine_torch`` sdist of the same version
exists; the constraints file pins it too.

pip older than 24 mis-applies ``--python-version`` to ``Requires-Python`` (megatron-core
0.17+ declare >= 3.12), so the resolver runs with a recent pip installed into a scratch
folder (``--pip-dir``), never the interpreter's own.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "requirements" / "gpu-constraints.txt"
PYTHON_VERSION = "3.12"
# manylinux tags a glibc 2.35 host accepts (pip needs each listed when --platform is used).
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)] + ["manylinux2014_x86_64", "linux_x86_64"]
SDIST_ONLY = "transformer_engine_torch"
INDEX = "https://pypi.org/simple"


def project_requirements() -> list[str]:
    """INSTALL_REQUIRES + EXTRAS_REQUIRE['gpu'] from setup.py (read, not executed); the
    transformer-engine requirement without its sdist-only ``pytorch`` extra."""
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("INSTALL_REQUIRES", "EXTRAS_REQUIRE"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    requirements = list(values["INSTALL_REQUIRES"]) + list(values["EXTRAS_REQUIRE"]["gpu"])
    return [_drop_extra(r, "pytorch") if r.startswith("transformer-engine[") else r for r in requirements]


def _drop_extra(requirement: str, extra: str) -> str:
    match = re.match(r"([A-Za-z0-9_.-]+)\[([^\]]*)\](.*)", requirement)
    assert match, requirement
    extras = [e.strip() for e in match.group(2).split(",") if e.strip() != extra]
    return f"{match.group(1)}[{','.join(extras)}]{match.group(3)}" if extras else match.group(1) + match.group(3)


def ensure_pip(pip_dir: Path) -> list[str]:
    """A recent pip in ``pip_dir`` (installed there once); the command prefix that runs it."""
    if not (pip_dir / "pip").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                        str(pip_dir), "pip>=25"], check=True)  # fmt: skip
    return [sys.executable, str(pip_dir / "pip")]


def resolve(pip: list[str], requirements: list[str], constraints: Path | None) -> dict[str, str]:
    """name -> version of everything pip would install for the GPU target (raises on a conflict)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [*pip, "install", "--dry-run", "--ignore-installed", "--quiet", "--disable-pip-version-check",
               "--report", str(report), "--target", str(Path(tmp) / "target"), "--only-binary=:all:",
               "--python-version", PYTHON_VERSION, "--implementation", "cp"]  # fmt: skip
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        if constraints is not None:
            cmd += ["-c", str(constraints)]
        proc = subprocess.run([*cmd, *requirements], capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if not line.startswith("WARNING: Location")]
            raise RuntimeError("the GPU set does not resolve:\n" + "\n".join(errors[-30:]))
        installed = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in installed}


def sdist_exists(name: str, version: str) -> bool:
    """Whether the index lists ``name``'s sdist of ``version`` (PEP 691 JSON simple API)."""
    request = urllib.request.Request(f"{INDEX}/{name.replace('_', '-')}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    return any(f["filename"] == f"{name}-{version}.tar.gz" for f in files)


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def write_constraints(resolved: dict[str, str]) -> None:
    te_version = resolved[next(n for n in resolved if _normalise(n) == "transformer-engine")]
    lines = [
        "# The GPU install's known-good set (CPython 3.12, Linux x86-64, CUDA 13), written by",
        "#   python tools/lock_gpu_constraints.py",
        "# from setup.py's requirements + the gpu extra; CI re-resolves it (tests/install/).",
        "# Use: pip install -c requirements/gpu-constraints.txt -e '.[gpu]' (docs/install.md).",
        f"# {SDIST_ONLY} is an sdist: it compiles against the installed torch (CUDA toolkit needed).",
    ]
    pins = {**resolved, SDIST_ONLY: te_version}
    lines += [f"{name}=={pins[name]}" for name in sorted(pins, key=_normalise) if _normalise(name) != "megatron-rl"]
    CONSTRAINTS.parent.mkdir(parents=True, exist_ok=True)
    CONSTRAINTS.write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_constraints() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_normalise(name)] = version
    return pins


def check(pip: list[str]) -> list[str]:
    """Problems with the constraints file (empty: it resolves, exactly, for the GPU target)."""
    pins = read_constraints()
    # pip refuses constraints it cannot satisfy binary-only: leave the sdist-only pin out
    lines = [f"{n}=={v}" for n, v in pins.items() if n != _normalise(SDIST_ONLY)]
    with tempfile.TemporaryDirectory() as tmp:
        binary_only = Path(tmp) / "constraints.txt"
        binary_only.write_text("\n".join(lines) + "\n")
        resolved = {_normalise(n): v for n, v in resolve(pip, project_requirements(), binary_only).items()}
    problems = [f"{name}: resolved {version}, the file pins {pins.get(name)}" for name, version in resolved.items()
                if pins.get(name) != version]  # fmt: skip
    te = pins.get("transformer-engine")
    if pins.get(_normalise(SDIST_ONLY)) != te:
        problems.append(f"{SDIST_ONLY} is pinned {pins.get(_normalise(SDIST_ONLY))}, transformer-engine {te}")
    elif not sdist_exists(SDIST_ONLY, te):
        problems.append(f"the index has no sdist {SDIST_ONLY}-{te}.tar.gz")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="resolve with the constraints file; exit 1 on a problem")
    parser.add_argument("--pip-dir", type=Path, default=Path(tempfile.gettempdir()) / "megatron_rl_resolver_pip",
                        help="folder for the recent pip the resolver runs (installed there once)")  # fmt: skip
    args = parser.parse_args(argv)
    pip = ensure_pip(args.pip_dir)
    if args.check:
        problems = check(pip)
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        print(json.dumps({"constraints": str(CONSTRAINTS.relative_to(REPO)), "resolves": not problems}))
        return 1 if problems else 0
    resolved = resolve(pip, project_requirements(), None)
    write_constraints(resolved)
    print(f"wrote {CONSTRAINTS.relative_to(REPO)}: {len(resolved) + 1} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
