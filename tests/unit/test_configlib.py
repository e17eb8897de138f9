"""The generic config machinery: from_dict, overrides, YAML loading, saving, field docs.

Uses small throw-away dataclasses so each rule is tested apart from the real run config
(``test_config.py`` covers that).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
import yaml

from megatron_rl.config.lib import (
    ALLOW_NONFINITE,
    ConfigError,
    ConfigRenameWarning,
    ConfigWarning,
    Registry,
    UnknownNameError,
    apply_overrides,
    dump_yaml,
    field_docs,
    from_dict,
    iter_sections,
    load_config,
    parse_override_value,
    parse_yaml,
    renamed_fields,
    render_docs,
    require_range,
    save_resolved,
    to_dict,
    type_label,
    warn_config,
)


@dataclass(kw_only=True)
class Inner:
    """A nested section."""

    alpha: float = 0.0
    """Strength in [0, 1]."""

    mode: Literal["a", "b"] = "a"
    """Which mode."""

    def __post_init__(self) -> None:
        require_range("alpha", self.alpha, ge=0.0, le=1.0)


@dataclass(kw_only=True)
class Outer:
    """The top level."""

    inner: Inner = field(default_factory=Inner)
    """A section."""

    maybe: Inner | None = None
    """An optional section."""

    count: int = 1
    """A count."""

    rate: float = 0.5
    """A rate."""

    flag: bool = False
    """A flag."""

    name: str = "x"
    """A name."""

    cap: float | None = None
    """An optional float."""

    files: list[str] = field(default_factory=list)
    """Some files."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Passed through."""

    sizes: dict[str, int] = field(default_factory=dict)
    """Typed mapping."""


def _error(data: Any, cls: type = Outer) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        from_dict(cls, data)
    return info.value


# --------------------------------------------------------------------------- from_dict


def test_from_dict_builds_nested_sections_and_keeps_defaults():
    cfg = from_dict(Outer, {"inner": {"alpha": 0.3}, "maybe": {"mode": "b"}, "files": ["a", "b"]})
    assert cfg == Outer(inner=Inner(alpha=0.3), maybe=Inner(mode="b"), files=["a", "b"])
    assert from_dict(Outer, {}) == Outer()


def test_unknown_key_top_level_suggests_closest_and_lists_valid():
    err = _error({"cuont": 3})
    assert err.path == "cuont"
    assert "did you mean 'count'?" in str(err)
    assert "the top level" in str(err) and "inner, maybe, count" in str(err)


def test_unknown_key_nested_names_full_path():
    err = _error({"inner": {"alpah": 0.1}})
    assert err.path == "inner.alpah"
    assert "config field 'inner.alpah'" in str(err)
    assert "did you mean 'alpha'?" in str(err)
    assert "section 'inner'" in str(err)


def test_unknown_key_without_close_match_has_no_suggestion():
    err = _error({"zzzzzz": 1})
    assert "did you mean" not in str(err) and "valid fields" in str(err)


@pytest.mark.parametrize(
    ("data", "path", "expected"),
    [
        ({"count": "3"}, "count", "expected int"),
        ({"count": 1.5}, "count", "expected int"),
        ({"count": True}, "count", "expected int"),  # bool is an int subclass; still wrong
        ({"rate": True}, "rate", "expected float"),
        ({"rate": "fast"}, "rate", "expected float"),
        ({"flag": 1}, "flag", "expected bool"),
        ({"name": 5}, "name", "quote it"),
        ({"cap": "big"}, "cap", "expected float | null"),
        ({"files": "a.jsonl"}, "files", "expected list[str]"),
        ({"files": ["a", 3]}, "files[1]", "expected str"),
        ({"sizes": {"a": "x"}}, "sizes.a", "expected int"),
        ({"inner": 3}, "inner", "expected a mapping"),
        ({"inner": None}, "inner", "expected a mapping"),
        ({"maybe": [1]}, "maybe", "expected a mapping"),
    ],
)
def test_wrong_type_names_path_value_and_expected_type(data, path, expected):
    err = _error(data)
    assert err.path == path
    assert expected in str(err)
    bad = data[path.split(".")[0].split("[")[0]]
    if not isinstance(bad, (dict, list)):
        assert repr(bad) in str(err)


def test_int_is_accepted_and_converted_where_float_expected():
    cfg = from_dict(Outer, {"rate": 1, "cap": 2, "inner": {"alpha": 1}})
    assert cfg.rate == 1.0 and isinstance(cfg.rate, float)
    assert isinstance(cfg.cap, float) and isinstance(cfg.inner.alpha, float)


def test_optional_section_and_none():
    assert from_dict(Outer, {"maybe": None, "cap": None}).maybe is None
    assert from_dict(Outer, {"maybe": {}}).maybe == Inner()


def test_literal_rejects_value_and_lists_allowed():
    err = _error({"inner": {"mode": "c"}})
    assert err.path == "inner.mode"
    assert "'c'" in str(err) and "allowed values: 'a', 'b'" in str(err)


def test_post_init_error_is_reraised_with_full_path():
    err = _error({"maybe": {"alpha": 2}})
    assert err.path == "maybe.alpha"
    assert "got 2.0" in str(err) and "[0.0, 1.0]" in str(err)


def test_any_values_pass_through():
    cfg = from_dict(Outer, {"extra": {"gpu_memory_utilization": 0.8, "nested": {"x": [1, None]}}})
    assert cfg.extra == {"gpu_memory_utilization": 0.8, "nested": {"x": [1, None]}}


def test_top_level_must_be_mapping():
    err = _error([1, 2])
    assert "expected a mapping" in str(err)


@dataclass(kw_only=True)
class NeedsValue:
    """A section with a required field."""

    value: int
    """Required."""


def test_missing_required_field_is_named():
    err = _error({}, NeedsValue)
    assert err.path == "value" and "required" in str(err)


@dataclass(kw_only=True)
class Warns:
    """A section that warns about an ignored setting."""

    x: int = 0
    """Ignored when set."""

    def __post_init__(self) -> None:
        if self.x:
            warn_config("x", "is ignored")


@dataclass(kw_only=True)
class HasWarns:
    """Holds a warning section."""

    w: Warns = field(default_factory=Warns)
    """The section."""


def test_post_init_warning_is_reemitted_once_with_full_path():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_dict(HasWarns, {"w": {"x": 1}})
    assert [str(w.message) for w in caught] == ["config field 'w.x': is ignored"]
    assert isinstance(caught[0].message, ConfigWarning) and caught[0].message.path == "w.x"


# --------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-6", 1e-6),
        ("-3E+2", -300.0),
        ("1.5e3", 1500.0),
        ("2", 2),
        ("0.25", 0.25),
        ("true", True),
        ("false", False),
        ("null", None),
        ("[1,2]", [1, 2]),
        ("[a.jsonl, b.jsonl]", ["a.jsonl", "b.jsonl"]),
        ("'1e-6'", "1e-6"),  # quoted stays a string
        ("pkg.mod:fn", "pkg.mod:fn"),
        ("*.jsonl", "*.jsonl"),  # not valid YAML (an alias): kept as text
        ("", ""),
    ],
)
def test_parse_override_value(text, value):
    parsed = parse_override_value(text)
    assert parsed == value and type(parsed) is type(value)


def test_apply_overrides_sets_nested_values_and_creates_sections():
    data = {"inner": {"alpha": 0.1}, "maybe": None}
    out = apply_overrides(data, ["inner.alpha=0.5", "maybe.mode=b", "rate=1e-6", "files=[x]", "new.deep.key=1"])
    assert out["inner"] == {"alpha": 0.5}
    assert out["maybe"] == {"mode": "b"}
    assert out["rate"] == 1e-6 and out["files"] == ["x"]
    assert out["new"] == {"deep": {"key": 1}}
    assert data == {"inner": {"alpha": 0.1}, "maybe": None}  # input untouched


def test_apply_overrides_later_wins_and_value_may_contain_equals():
    out = apply_overrides({}, ["name=a", "name=b=c"])
    assert out["name"] == "b=c"


@pytest.mark.parametrize("bad", ["inner.alpha", "=3", "a..b=1", ".a=1"])
def test_malformed_override_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="malformed override"):
        apply_overrides({}, [bad])


def test_override_through_a_scalar_is_an_error():
    with pytest.raises(ConfigError) as info:
        apply_overrides({"count": 3}, ["count.x=1"])
    assert info.value.path == "count" and "not a section" in str(info.value)


def test_override_of_unknown_field_gets_suggestion():
    err = _error(apply_overrides({}, ["inner.alpah=0.2"]))
    assert err.path == "inner.alpah" and "did you mean 'alpha'?" in str(err)


# --------------------------------------------------------------------------- YAML files


def test_yaml_reads_exponent_floats_and_rejects_duplicate_keys():
    assert parse_yaml("lr: 1e-6\nx: 5e3") == {"lr": 1e-6, "x": 5000.0}
    with pytest.raises(ConfigError, match=r"c.yaml, line 3.*duplicate key 'a'"):
        parse_yaml("a: 1\nb: 2\na: 3\n", source="c.yaml")


def test_load_config_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(Outer, tmp_path / "nope.yaml")
    assert "nope.yaml" in str(info.value)


def test_load_config_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("count: 1\ninner:\n  alpha: [1, 2\nrate: 3\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error in .*bad\.yaml, line \d+"):
        load_config(Outer, path)


@pytest.mark.parametrize(("text", "match"), [("", "empty"), ("- 1\n- 2\n", "top level must be a mapping")])
def test_load_config_top_level_must_be_mapping(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(Outer, path)


def test_load_config_error_names_the_file_line_or_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("count: 1\ninner:\n  alpha: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(Outer, path)
    assert info.value.path == "inner.alpha" and f"{path}, line 3" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(Outer, path, ["inner.alpha=0.5", "inner.mode=z"])
    assert info.value.path == "inner.mode" and "set by override 'inner.mode=z'" in str(info.value)


def test_load_config_applies_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("count: 1\nrate: 1e-3\n")
    cfg = load_config(Outer, path, ["count=4", "maybe.alpha=1"])
    assert cfg.count == 4 and cfg.rate == 1e-3 and cfg.maybe == Inner(alpha=1.0)


# --------------------------------------------------------------------------- saving


def test_to_dict_is_plain_data():
    cfg = Outer(maybe=Inner(alpha=0.2), files=["a"], extra={"t": (1, 2)})
    data = to_dict(cfg)
    assert data["maybe"] == {"alpha": 0.2, "mode": "a"}
    assert data["extra"] == {"t": [1, 2]}
    yaml.safe_dump(data)  # representable without custom tags


def test_save_resolved_round_trip_and_atomic(tmp_path):
    cfg = Outer(maybe=Inner(alpha=0.2), rate=1e-6, files=["a", "b"], extra={"k": None})
    path = save_resolved(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    assert load_config(Outer, path) == cfg
    assert path.read_text() == dump_yaml(cfg)
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)
    save_resolved(Outer(), tmp_path / "run")  # overwrite in place
    assert load_config(Outer, path) == Outer()


# --------------------------------------------------------------------------- docs


def test_field_docs_reads_docstrings_under_fields():
    docs = field_docs(Outer)
    assert docs["inner"] == "A section." and docs["files"] == "Some files."
    assert set(docs) == {"inner", "maybe", "count", "rate", "flag", "name", "cap", "files", "extra", "sizes"}


def test_iter_sections_walks_nested_and_optional_sections():
    assert [(p, c) for p, c in iter_sections(Outer)] == [("", Outer), ("inner", Inner), ("maybe", Inner)]


def test_type_label():
    assert type_label(float | None) == "float | null"
    assert type_label(Literal["a", "b"]) == "'a' | 'b'"
    assert type_label(list[str]) == "list[str]"
    assert type_label(dict[str, Any]) == "dict[str, any]"


def test_render_docs_lists_every_field():
    text = render_docs(Outer, title="T")
    assert text.startswith("# T\n")
    for name in field_docs(Outer):
        assert f"**`{name}`**" in text
    assert "## `inner`" in text and "Strength in [0, 1]." in text
    assert "(`'a' | 'b'`; default `a`)" in text


# --------------------------------------------------------------------------- renamed fields


@renamed_fields(old_name="new_name")
@dataclass(kw_only=True)
class Renamed:
    """A section whose field was renamed."""

    new_name: int = 1
    """The field (formerly ``old_name``)."""

    def __post_init__(self) -> None:
        require_range("new_name", self.new_name, ge=0)


@dataclass(kw_only=True)
class HoldsRenamed:
    """Top level holding the renamed section."""

    sec: Renamed = field(default_factory=Renamed)
    """The section."""


def test_old_name_in_yaml_and_override_is_accepted_with_a_rename_warning(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sec:\n  old_name: 5\n")
    with pytest.warns(ConfigRenameWarning, match="'sec.old_name': is renamed; write 'sec.new_name'"):
        assert load_config(HoldsRenamed, path).sec.new_name == 5
    path.write_text("sec:\n  new_name: 5\n")
    with pytest.warns(ConfigRenameWarning, match="sec.old_name"):
        assert load_config(HoldsRenamed, path, ["sec.old_name=7"]).sec.new_name == 7  # the override wins
    with pytest.warns(ConfigRenameWarning):
        assert from_dict(HoldsRenamed, {"sec": {"old_name": 3}}).sec.new_name == 3


def test_errors_about_a_renamed_field_name_the_key_the_user_wrote(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sec:\n  new_name: 5\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigRenameWarning)
        with pytest.raises(ConfigError) as info:
            load_config(HoldsRenamed, path, ["sec.old_name=-1"])
        assert info.value.path == "sec.old_name" and "set by override 'sec.old_name=-1'" in str(info.value)
        with pytest.raises(ConfigError) as info:
            load_config(HoldsRenamed, path, ["sec.old_name=x"])
        assert info.value.path == "sec.old_name" and "expected int" in str(info.value)
        path.write_text("sec:\n  old_name: 5\n  new_name: 6\n")
        with pytest.raises(ConfigError, match="set only one of 'sec.new_name' and its old name"):
            load_config(HoldsRenamed, path)


def test_a_rename_warning_is_not_a_config_warning():
    # Places that turn config warnings into errors (strict tests) still accept old names.
    assert not issubclass(ConfigRenameWarning, ConfigWarning) and issubclass(ConfigRenameWarning, FutureWarning)


# --------------------------------------------------------------------------- registry


def test_registry_registers_once_and_lists_names_on_a_miss():
    class UnknownThing(UnknownNameError):
        pass

    reg: Registry[int] = Registry("thing", unknown_error=UnknownThing, unknown_hint="(or write module:attr)")
    reg.register("b", 2)

    @reg.register("a")
    def a():
        return 1

    assert reg.get("a") is a and reg.get("b") == 2 and reg.names() == ["a", "b"] and "a" in reg
    assert [name for name, _ in reg.items()] == ["b", "a"] and len(reg) == 2
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        reg.register("a", 3)
    with pytest.raises(UnknownThing) as info:
        reg.get("c")
    assert str(info.value) == "unknown thing 'c'; registered: a, b (or write module:attr)"
    assert isinstance(info.value, KeyError)


# --------------------------------------------------------------------------- finite values and size limits


@dataclass(kw_only=True)
class Floats:
    """Float fields with and without a stated range."""

    scale: float = 1.0
    """No range of its own: only the loader's finiteness check applies."""

    bounded: float | None = None
    """A range, and null allowed."""

    horizon: float = field(default=float("inf"), metadata=ALLOW_NONFINITE)
    """Infinity means "no horizon"."""

    def __post_init__(self) -> None:
        require_range("bounded", self.bounded, gt=0.0)
        require_range("horizon", self.horizon, gt=0.0, allow_nonfinite=True)


@pytest.mark.parametrize(
    "text", [".inf", "-.inf", ".nan", "1e400", str(10**400)], ids=["inf", "-inf", "nan", "1e400", "10**400"]
)
@pytest.mark.parametrize("key", ["scale", "bounded"])
def test_non_finite_floats_are_refused_naming_the_field(key, text):
    with pytest.raises(ConfigError, match="must be a finite number") as info:
        from_dict(Floats, parse_yaml(f"{key}: {text}"))
    assert info.value.path == key


def test_a_field_may_allow_non_finite_values():
    assert from_dict(Floats, {"horizon": float("inf")}).horizon == float("inf")


def test_require_range_refuses_non_finite_values_of_configs_built_in_python():
    with pytest.raises(ConfigError, match="'bounded': got inf; must be a finite number"):
        Floats(bounded=float("inf"))
    with pytest.raises(ConfigError, match="must be a finite number"):
        require_range("x", float("nan"))
    require_range("x", float("inf"), allow_nonfinite=True)


def _alias_bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_expands():
    text = _alias_bomb(9)  # 1e9 values from ~600 bytes
    assert len(text) < 1000
    with pytest.raises(ConfigError, match="expands to more than 100000 values"):
        parse_yaml(text, "bomb.yaml")
    assert parse_yaml(_alias_bomb(3), "ok.yaml")["a2"][0][0] == ["x"] * 10  # shared anchors stay legal


@pytest.mark.parametrize(
    "text, message",
    [("a: &a [*a]", "recursive YAML alias"), ("[" * 3000 + "]" * 3000, "nested too deeply")],
    ids=["recursive", "deep"],
)
def test_recursive_and_deeply_nested_yaml_are_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_yaml(text, "x.yaml")


def test_config_files_must_be_small_regular_utf8_files(tmp_path):
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_config(Floats, "/dev/zero")
    big = tmp_path / "big.yaml"
    big.write_text("scale: 1.0\n" + "#" * (2 << 20))
    with pytest.raises(ConfigError, match="larger than"):
        load_config(Floats, big)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"scale: 1.0\n# caf\xe9\n")
    with pytest.raises(ConfigError, match="line 2: not UTF-8"):
        load_config(Floats, latin)
    with pytest.raises(ConfigError, match="expands to more than"):
        parse_override_value("[" + ", ".join(["&a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + ["*a"] * 20000) + "]")
