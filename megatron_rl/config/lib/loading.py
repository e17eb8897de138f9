"""Loading a config file with overrides, and saving the resolved config of a run."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from megatron_rl.config.lib.errors import ConfigError
from megatron_rl.config.lib.schema import (
    canonical_data,
    canonical_key,
    from_dict,
    to_dict,
)
from megatron_rl.config.lib.yaml_io import MAX_CONFIG_BYTES, _YamlLoader, apply_overrides, parse_yaml

T = TypeVar("T")


def dump_yaml(config: Any) -> str:
    """The config tree as YAML text, fields in declaration order."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False, allow_unicode=True)


def save_resolved(config: Any, run_dir: str | os.PathLike[str], filename: str = "config.yaml") -> Path:
    """Write the resolved ``config`` to ``run_dir/filename`` atomically; returns the path.

    The text goes to a temporary file in the same directory, then ``os.replace`` swaps it
    in, so a reader (or a crash) never sees a half-written config.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / filename
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{filename}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dump_yaml(config))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the config is not secret
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


def _split_path(dotted: str) -> list[str | int]:
    """``data.train_files[0]`` -> ``['data', 'train_files', 0]``."""
    return [int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", dotted)]


def _yaml_line(text: str, dotted: str) -> int | None:
    """1-based line of the deepest part of ``dotted`` present in YAML ``text`` (None if none)."""
    try:
        node = yaml.compose(text, Loader=_YamlLoader)
    except yaml.YAMLError:
        return None
    line = None
    for part in _split_path(dotted):
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.value == part:
                    line, node = key_node.start_mark.line + 1, value_node
                    break
            else:
                break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _error_source(path: str, text: str, overrides: Sequence[str], source: str) -> str | None:
    """Where the value behind error ``path`` came from: the last override setting it, or a file line."""
    for item in reversed(overrides):
        key = item.partition("=")[0].strip()
        if path == key or path.startswith((key + ".", key + "[")):
            return f"set by override {item!r}"
    line = _yaml_line(text, path) if path else None
    return f"{source}, line {line}" if line else None


def _read_config_text(path: Path) -> str:
    """The text of config file ``path``: a regular UTF-8 file of at most ``MAX_CONFIG_BYTES``
    (``/dev/zero`` or a FIFO would otherwise be read forever)."""
    try:
        if not path.is_file():
            what = "does not exist" if not path.exists() else "is not a regular file"
            raise ConfigError("", f"config file {path} {what}")
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError("", f"cannot read config file {path}: {e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError("", f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes; a run config is a few KB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError("", f"config file {path}, line {line}: not UTF-8 text ({e.reason})") from None


def load_config(cls: type[T], yaml_path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> T:
    """Read ``yaml_path``, apply dotted ``overrides`` and build ``cls``; errors name file and line."""
    path = Path(yaml_path)
    text = _read_config_text(path)
    data = parse_yaml(text, source=str(path))
    if data is None:
        raise ConfigError("", f"config file {path} is empty; expected a mapping of config sections")
    if not isinstance(data, Mapping):
        raise ConfigError(
            "", f"config file {path}: the top level must be a mapping of config sections, got {type(data).__name__}"
        )
    overrides = list(overrides)
    # Renamed fields: the data and the override keys are rewritten to the current names
    # first (so an override wins over the file whichever name each uses); errors are
    # reported under the name the user wrote.
    written_as: dict[str, str] = {}
    data = canonical_data(cls, data, "", written_as)
    canonical = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if sep and key.strip():
            current = canonical_key(cls, key.strip())
            if current != key.strip():
                written_as[current] = key.strip()
            item = f"{current}={raw}"
        canonical.append(item)
    data = apply_overrides(data, canonical)
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        error_path = _as_written(e.path, written_as)
        where = _error_source(error_path, text, overrides, str(path))
        if where is None and error_path == e.path:
            raise
        suffix = f" ({where})" if where else ""
        raise ConfigError(error_path, f"{e.message}{suffix}") from None


def _as_written(path: str, written_as: dict[str, str]) -> str:
    """``path`` with a renamed prefix spelled as the user wrote it."""
    for current, written in written_as.items():
        if path == current or path.startswith((current + ".", current + "[")):
            return written + path[len(current) :]
    return path
