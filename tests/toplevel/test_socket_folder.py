"""Socket folders under TMPDIR: each holds its creator's pid, and those of processes that are gone
(a server killed by SIGKILL never runs its cleanup) are removed when the next one is made."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sparkrelay.host import remove_orphan_folders, socket_folder


@pytest.fixture
def tmpdir_env(monkeypatch):
    # a short folder of its own: pytest's tmp_path under a parallel worker (.../popen-gw0/<test>/)
    # leaves a socket path past the 107 bytes a Unix socket allows
    folder = Path(tempfile.mkdtemp(prefix="srk-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    yield folder
    tempfile.tempdir = None
    shutil.rmtree(folder, ignore_errors=True)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_new_folder_sweeps_those_of_dead_processes_only(tmpdir_env):
    gone = tmpdir_env / f"sparkrelay-engine-{dead_pid()}-abc"
    (gone / "sub").mkdir(parents=True)
    (gone / "cmd").write_text("")
    alive = tmpdir_env / f"sparkrelay-engine-{os.getppid()}-def"  # pytest's parent runs
    alive.mkdir()
    other_prefix = tmpdir_env / f"sparkrelay-pp-{dead_pid()}-ghi"
    other_prefix.mkdir()
    not_ours = tmpdir_env / "sparkrelay-engine-xyz"  # no pid in the name: not a folder of ours
    not_ours.mkdir()
    folder = socket_folder("sparkrelay-engine-", "cmd")
    assert os.path.basename(folder).startswith(f"sparkrelay-engine-{os.getpid()}-")
    assert os.path.isdir(folder) and oct(os.stat(folder).st_mode & 0o777) == "0o700"
    assert not gone.exists()
    assert alive.exists() and other_prefix.exists() and not_ours.exists()
    assert remove_orphan_folders("sparkrelay-pp-") == [str(other_prefix)]
    assert remove_orphan_folders("sparkrelay-engine-") == []  # its own folder stays: it is alive


def test_a_killed_server_leaves_no_folder_for_long(tmpdir_env):
    """A process that made a socket folder and died by SIGKILL: the next one made removes it."""
    code = (
        "import os; from sparkrelay.host import socket_folder; "
        "socket_folder('sparkrelay-engine-', 'cmd'); os.kill(os.getpid(), 9)"
    )
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmpdir_env)})
    left = [p for p in tmpdir_env.iterdir() if p.name.startswith("sparkrelay-engine-")]
    assert len(left) == 1
    mine = socket_folder("sparkrelay-engine-", "cmd")
    assert [p.name for p in tmpdir_env.iterdir()] == [os.path.basename(mine)]
