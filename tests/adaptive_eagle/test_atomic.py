"""Atomic writes: the old version or the new one, never a torn file, no temp files left behind."""

import pytest

from adaptive_eagle.atomic import atomic_write_bytes, atomic_write_text, staging_dir


def test_file_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "a.json"
    atomic_write_text(p, "old")
    atomic_write_bytes(p, b"new", fsync=False)
    assert p.read_bytes() == b"new"
    assert [q.name for q in tmp_path.iterdir()] == ["a.json"]


def test_failed_file_write_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "a.json"
    atomic_write_text(p, "old")

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr("adaptive_eagle.atomic.os.replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(p, "new")
    assert p.read_text() == "old" and [q.name for q in tmp_path.iterdir()] == ["a.json"]


def test_staging_dir_renames_into_place(tmp_path):
    with staging_dir(tmp_path / "v1", overwrite=False) as d:
        (d / "x").write_text("1")
        (d / "sub").mkdir()
        (d / "sub" / "y").write_text("2")
    assert (tmp_path / "v1" / "sub" / "y").read_text() == "2"
    assert [q.name for q in tmp_path.iterdir()] == ["v1"]


def test_staging_dir_refuses_an_existing_version_and_overwrites_on_request(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "x").write_text("old")
    with pytest.raises(FileExistsError, match="immutable"):
        with staging_dir(tmp_path / "v1", overwrite=False):
            pass
    with staging_dir(tmp_path / "v1", overwrite=True) as d:
        (d / "x").write_text("new")
    assert (tmp_path / "v1" / "x").read_text() == "new"
    assert [q.name for q in tmp_path.iterdir()] == ["v1"]


def test_staging_dir_error_or_race_leaves_final_untouched(tmp_path):
    with pytest.raises(RuntimeError):
        with staging_dir(tmp_path / "v1", overwrite=False) as d:
            (d / "x").write_text("1")
            raise RuntimeError("body failed")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileExistsError, match="appeared"):
        with staging_dir(tmp_path / "v1", overwrite=False) as d:
            (d / "x").write_text("mine")
            (tmp_path / "v1").mkdir()  # another writer wins the race (even with an empty directory)
    assert [q.name for q in tmp_path.iterdir()] == ["v1"] and list((tmp_path / "v1").iterdir()) == []
