"""`pdserve up`'s log folder is private (pdserve.logdir): created 0700 or refused when it
exists with another owner or wider permissions; the token file and the logs are new files of
mode 0600 (a pre-planted file is replaced, never written into); a temporary folder is removed
on a clean exit unless `--keep-logs`."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest

from pdserve.launcher import Cluster, ClusterConfig, ClusterError
from pdserve.logdir import LogDirError, private_dir, private_file
from tests.test_launcher_cluster import _run_up, fake_command


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_folder_is_private(tmp_path: Path) -> None:
    old = os.umask(0)  # even with a permissive umask
    try:
        made = private_dir(tmp_path / "a" / "logs")
    finally:
        os.umask(old)
    assert mode(made) == 0o700


@pytest.mark.parametrize("perm", [0o777, 0o755, 0o750, 0o701])
def test_an_open_folder_is_refused(tmp_path: Path, perm: int) -> None:
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(perm)
    with pytest.raises(LogDirError, match="chmod 700"):
        private_dir(d)
    d.chmod(0o700)
    assert private_dir(d) == d


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder of another user needs root")
def test_a_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(LogDirError, match="belongs to uid 65534"):
        private_dir(d)


def test_a_file_or_link_is_not_a_log_folder(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(LogDirError, match="not a folder"):
        private_dir(f)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(LogDirError, match="not a folder"):
        private_dir(link)


def test_a_planted_file_is_replaced_not_written_into(tmp_path: Path) -> None:
    planted = tmp_path / "cluster-token"
    planted.write_text("theirs")
    planted.chmod(0o666)
    inode = os.stat(planted).st_ino
    other = os.open(planted, os.O_RDONLY)  # what the planter kept open
    try:
        with os.fdopen(private_file(planted), "w") as f:
            f.write("secret\n")
        assert os.read(other, 100) == b"theirs"  # their file never saw the secret
    finally:
        os.close(other)
    assert os.stat(planted).st_ino != inode and mode(planted) == 0o600
    assert planted.read_text() == "secret\n"


def test_a_planted_link_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("keep")
    link = tmp_path / "decode-0.log"
    link.symlink_to(target)
    with pytest.raises(OSError):
        private_file(link, append=True)
    assert target.read_text() == "keep"


def test_the_cluster_refuses_an_open_log_dir(tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    config = ClusterConfig(kv_transfer="pull", log_dir=tmp_path, port=None, startup_timeout_s=30)
    with pytest.raises(ClusterError, match="chmod 700"):
        Cluster(config, instance_command=fake_command).start()


@pytest.mark.slow  # `pdserve up` with fake instances
@pytest.mark.timeout(120)
@pytest.mark.parametrize("keep", [False, True])
def test_a_clean_exit_removes_the_temporary_folder_unless_kept(keep: bool) -> None:
    argv = ["--kv-transfer", "pull", *(["--keep-logs"] if keep else [])]
    proc, lines = _run_up(None, *argv)
    try:
        start = next(line for line in lines if "starting; logs in" in line)
        folder = Path(start.rsplit("logs in ", 1)[1].strip())
        assert mode(folder) == 0o700
        files = sorted(p.name for p in folder.iterdir())
        assert "cluster-token" in files and "router.log" in files
        assert all(mode(folder / f) == 0o600 for f in files), files
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert folder.exists() == keep
    if keep:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
