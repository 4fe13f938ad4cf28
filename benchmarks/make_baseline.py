"""Materialize lightning_flce of another commit as the package ``lightning_flce_base``, for the provider
benchmark's ``flce_base`` row (the op before a change, measured in the same run as the op after it).

``git archive REV lightning_flce`` is extracted and every ``lightning_flce`` identifier in its sources is
renamed to ``lightning_flce_base``: its imports, and the ``torch.library`` namespace of its custom ops
(``lightning_flce::`` -> ``lightning_flce_base::``), so both versions register their ops in one process.

The device machine gets the working tree without git history, so make the copy here and carry it:

    python3 benchmarks/make_baseline.py REV           # -> .baseline/lightning_flce_base/ (ignored by git)
    # device call: carry [".whl", ".baseline"];  bench_flce.py reads .baseline by default (--baseline-dir)

``bench_flce.py --baseline-commit REV`` does the same into a temporary folder where git history exists.
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "lightning_flce"
BASELINE_PACKAGE = "lightning_flce_base"
COMMIT_FILE = "BASELINE_COMMIT"
# Whole identifiers only: `lightning_flce.op`, `"lightning_flce::flce_forward"`, `import lightning_flce`.
_IDENTIFIER = re.compile(r"\blightning_flce\b")


def materialize(rev: str, dest: Path) -> Path:
    """Write ``dest/lightning_flce_base/`` from commit ``rev``; return the package folder."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "archive", "--format=tar", sha, PACKAGE], cwd=REPO_ROOT, capture_output=True, check=True
    ).stdout
    package = dest / BASELINE_PACKAGE
    if package.exists():
        shutil.rmtree(package)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            rel = Path(member.name).relative_to(PACKAGE)
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            if member.name.endswith(".py"):
                data = _IDENTIFIER.sub(BASELINE_PACKAGE, data.decode()).encode()
            target = package / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    subject = subprocess.run(
        ["git", "log", "-1", "--format=%h %s", sha],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    (package / COMMIT_FILE).write_text(f"{sha}\n{subject}\n")
    return package


def describe(folder: Path) -> str:
    """'baseline <short sha> <subject>' from the copy's commit file."""
    commit_file = folder / BASELINE_PACKAGE / COMMIT_FILE
    if not commit_file.is_file():
        return f"baseline from {folder} (commit unknown)"
    sha, _, subject = commit_file.read_text().partition("\n")
    return f"baseline {sha[:7]}: {subject.strip()[len(sha[:7]) :].strip()[:80]}"


def import_baseline(folder: Path) -> ModuleType:
    """Import ``lightning_flce_base`` from ``folder`` (once per process)."""
    if BASELINE_PACKAGE in sys.modules:
        return sys.modules[BASELINE_PACKAGE]
    if not (folder / BASELINE_PACKAGE / "__init__.py").is_file():
        raise FileNotFoundError(
            f"no {BASELINE_PACKAGE} in {folder}: run `python3 benchmarks/make_baseline.py REV` and carry"
            " .baseline, or pass --baseline-commit REV / --baseline-dir PATH"
        )
    sys.path.insert(0, str(folder.resolve()))
    return importlib.import_module(BASELINE_PACKAGE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="git revision of the baseline (a commit, branch or tag)")
    ap.add_argument("--dest", type=Path, default=REPO_ROOT / ".baseline", help="folder (default .baseline)")
    args = ap.parse_args()
    package = materialize(args.rev, args.dest)
    print(f"{package}: {describe(args.dest)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
