"""The kernel cache runs only code usc generated: private directory, content checked."""

import os
import types

import pytest

from usc.runtime import fused
from usc.runtime.kernel_cache import KernelCacheError, cache_directory, kernel_file

SOURCE = "VALUE = 7\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "kernels"
    monkeypatch.setenv("USC_KERNEL_CACHE", str(folder))
    return folder


def test_directory_is_created_private(cache):
    assert cache_directory() == str(cache)
    assert os.stat(cache).st_mode & 0o777 == 0o700


def test_default_directory_is_the_users_cache_not_tmp(tmp_path, monkeypatch):
    monkeypatch.delenv("USC_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_directory() == str(tmp_path / "xdg" / "usc" / "kernels")


def test_a_directory_others_can_write_is_refused(cache):
    cache.mkdir()
    os.chmod(cache, 0o777)
    with pytest.raises(KernelCacheError, match="writable by other users"):
        kernel_file("fused_abc", SOURCE)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_planted_file_in_another_users_directory_is_refused(cache):
    cache.mkdir(mode=0o755)
    (cache / "fused_planted.py").write_text("import sys; sys.exit('planted code ran')\n")
    os.chown(cache, 65534, 65534)
    with pytest.raises(KernelCacheError, match="belongs to user id 65534"):
        fused.load_kernel(types.SimpleNamespace(name="fused_planted", source=SOURCE))


def test_a_symlinked_directory_is_refused(cache, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    cache.symlink_to(target)
    with pytest.raises(KernelCacheError, match="not a plain directory"):
        cache_directory()


def test_a_file_whose_content_differs_from_the_source_is_rewritten_not_run(cache):
    cache.mkdir(mode=0o700)
    (cache / "fused_tampered.py").write_text("import sys; sys.exit('planted code ran')\nVALUE = 666\n")
    module = fused.load_kernel(types.SimpleNamespace(name="fused_tampered", source=SOURCE))
    assert module.VALUE == 7
    assert (cache / "fused_tampered.py").read_text() == SOURCE
    assert os.stat(cache / "fused_tampered.py").st_mode & 0o777 == 0o600
