"""Static types of the public API as a user's type checker sees them: ``mypy --strict`` on
``tests/typing/user_project.py`` (every README pattern, with ``assert_type`` of the real classes and return
types) against the built wheel. ``.ci/run`` runs the same check against the editable install
(``cd tests/typing && mypy``); this test shares its mypy cache, so torch and Lightning are analysed once."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "tests" / "typing"
# what `# type: ignore[code]` marks: lines that must stay type errors
EXPECTED_ERROR = re.compile(r"\s*# type: ignore\[([a-z-]+)\]$")

pytest.importorskip("mypy")


def _venv_with_the_wheel(tmp_path: Path) -> Path:
    """A venv holding only the wheel of this checkout; its dependencies come from the running environment's
    site-packages through a path entry (its own .pth files, an editable install among them, are not read)."""
    wheels = tmp_path / "wheel"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", str(ROOT), "--no-deps", "-q", "-w", str(wheels)], check=True, timeout=600)
    (wheel,) = wheels.glob("lightning_flce-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "-q", str(wheel)], check=True)
    return python


def _mypy(project: Path, python: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--python-executable",
            str(python),
            "--cache-dir",
            str(PROJECT / ".mypy_cache"),
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_user_project_type_checks_against_the_wheel(tmp_path):
    python = _venv_with_the_wheel(tmp_path)
    found = subprocess.run(
        [str(python), "-c", "import lightning_flce.functional as f; print(f.__file__)"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert str(tmp_path / "venv") in found  # the wheel's copy, not the checkout

    project = tmp_path / "project"
    shutil.copytree(PROJECT, project, ignore=shutil.ignore_patterns(".mypy_cache"))
    result = _mypy(project, python)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout

    # The marked lines are real errors of the expected kind (warn_unused_ignores fails on a marker that no
    # longer hides one; here each must be reported once its marker is gone).
    source = (project / "user_project.py").read_text().splitlines()
    expected = {}
    for number, line in enumerate(source, 1):
        match = EXPECTED_ERROR.search(line)
        if match:
            expected[number] = match.group(1)
            source[number - 1] = line[: match.start()]
    assert len(expected) >= 3 and "arg-type" in expected.values()
    (project / "user_project.py").write_text("\n".join(source) + "\n")
    result = _mypy(project, python)
    reported = {
        int(number): code
        for number, code in re.findall(
            r"^user_project\.py:(\d+): error: .*\[([a-z-]+)\]$", result.stdout, re.M
        )
    }
    assert reported == expected, result.stdout
