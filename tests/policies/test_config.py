"""policies.config: defaults, range checks whose messages name the field and its range, files."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from policies.config import PolicyConfig, PolicyConfigError


def test_defaults_are_valid_and_frozen():
    cfg = PolicyConfig()
    assert cfg.tail_quantile == 0.05 and cfg.confidence_level == 0.95 and cfg.collapse_accept_length == 1.05
    with pytest.raises(ValidationError):
        cfg.tail_quantile = 0.1


@pytest.mark.parametrize("field, value, allowed", [
    ("tail_quantile", 0.7, "(0, 0.5)"),
    ("tail_quantile", 0.0, "(0, 0.5)"),
    ("confidence_level", 1.0, "(0.5, 1)"),
    ("bootstrap_resamples", 10, "[200, 100000]"),
    ("min_samples", 5, "[20, 1e7]"),
    ("domain_tolerance", -0.1, "[0, 0.5]"),
    ("mean_tolerance", 0.9, "[0, 0.5]"),
    ("canary_fraction", 0.0, "(0, 0.5]"),
    ("canary_min_requests", 1, "[20, 1e7]"),
    ("rollback_window", 0, "[20, 1e7]"),
    ("collapse_accept_length", 0.9, "[1, 2]"),
    ("rollback_margin", 0.0, "(0, 0.5]"),
    ("cold_start_tpot_quantile", 0.3, "[0.5, 1)"),
    ("seed", -1, "[0, 2**32 - 1]"),
])
def test_out_of_range_names_the_field_and_the_range(field, value, allowed):
    with pytest.raises(PolicyConfigError) as e:
        PolicyConfig.make(**{field: value})
    assert str(e.value).startswith(f"{field}: ") and allowed in str(e.value) and repr(value) in str(e.value)
    with pytest.raises(ValidationError, match=field):  # direct construction refuses too
        PolicyConfig(**{field: value})


def test_unknown_fields_and_inconsistent_pairs_are_refused():
    with pytest.raises(PolicyConfigError, match="canary_fractoin: Extra inputs"):
        PolicyConfig.make(canary_fractoin=0.2)
    with pytest.raises(PolicyConfigError, match="min_domain_samples .* min_samples"):
        PolicyConfig.make(min_samples=100, min_domain_samples=150)
    with pytest.raises(PolicyConfigError, match="collapse_min_requests .* rollback_window"):
        PolicyConfig.make(rollback_window=50, collapse_min_requests=60)
    with pytest.raises(PolicyConfigError, match="canary_max_requests .* canary_min_requests"):
        PolicyConfig.make(canary_min_requests=500, canary_max_requests=400)
    with pytest.raises(PolicyConfigError, match="canary_mode: .*got .fast. .allowed: in {auto, evidence, health}"):
        PolicyConfig.make(canary_mode="fast")


def test_every_field_is_documented_with_its_range():
    for name, field in PolicyConfig.model_fields.items():
        assert field.description and "; in " in field.description, name


def test_from_yaml_and_json(tmp_path):
    (tmp_path / "p.yaml").write_text("tail_quantile: 0.1\ncanary_fraction: 0.2\n")
    (tmp_path / "p.json").write_text(json.dumps({"confidence_level": 0.9}))
    (tmp_path / "empty.yml").write_text("")
    assert PolicyConfig.from_file(tmp_path / "p.yaml") == PolicyConfig(tail_quantile=0.1, canary_fraction=0.2)
    assert PolicyConfig.from_file(tmp_path / "p.json").confidence_level == 0.9
    assert PolicyConfig.from_file(tmp_path / "empty.yml") == PolicyConfig()


@pytest.mark.parametrize("name, text, message", [
    ("bad.yaml", "tail_quantile: [", "not valid yaml"),
    ("bad.json", "{", "not valid json"),
    ("list.yaml", "- 1\n", "expected a mapping"),
    ("range.yaml", "canary_fraction: 0.9\n", "canary_fraction: Input should be less than or equal to 0.5"),
])
def test_bad_files_name_the_path(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(PolicyConfigError) as e:
        PolicyConfig.from_file(tmp_path / name)
    assert str(tmp_path / name) in str(e.value) and message in str(e.value)


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(PolicyConfigError, match="no such policy config file"):
        PolicyConfig.from_file(tmp_path / "nope.yaml")
    assert not (tmp_path / "nope.yaml").exists()
