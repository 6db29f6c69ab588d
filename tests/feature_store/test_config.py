"""store_config_from_options: the StoreConfig that a command line's store options name."""

import json

import pytest

from feature_store.config import StoreConfig, StoreConfigError, store_config_from_options


def test_options_name_a_store_file_first_then_redis_then_a_local_root(tmp_path):
    path = tmp_path / "store.json"
    path.write_text(json.dumps({"backend": "local", "local_root": str(tmp_path / "a")}))
    assert store_config_from_options(path, tmp_path / "b", "redis://h:1/0").local_root == str(tmp_path / "a")
    redis = store_config_from_options(None, tmp_path / "b", "redis://h:1/0", prefix="p")
    assert (redis.backend, redis.redis_url, redis.key_prefix) == ("redis", "redis://h:1/0", "p")
    assert store_config_from_options(root=tmp_path / "b") == StoreConfig(backend="local", local_root=str(tmp_path / "b"))
    assert store_config_from_options() is None  # nothing named: the command says what to give
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # building a config creates nothing


@pytest.mark.parametrize("write", [None, "{not json", json.dumps({"backend": "local"}), json.dumps({"nope": 1})])
def test_a_bad_store_file_is_one_clear_error(tmp_path, write):
    path = tmp_path / "store.json"
    if write is not None:
        path.write_text(write)
    with pytest.raises(StoreConfigError, match="bad store config"):
        store_config_from_options(path)
