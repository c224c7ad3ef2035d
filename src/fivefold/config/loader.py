"""Loading a run configuration: defaults, then a TOML file, then `--section.key VALUE` overrides.

Every key is checked before any work starts: an unknown section or key names the valid ones and
the closest match, in its own section or in another (`--train.lr` suggests `optim.lr`); a key
that was renamed when the parallel settings were split into sections (`parallel.tp`) names its
new place (`tensor_parallel.degree`); a bad value names the key and the fix. Configs saved in
older checkpoints are translated through the same table.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Union

from fivefold.config.schema import SECTIONS, JobConfig, did_you_mean
from fivefold.errors import ConfigError
from fivefold.model.presets import PRESETS, get_preset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESET_KEY = "preset"

# The flat [parallel] section of earlier versions, key by key: where each setting lives now.
RENAMED = {
    "parallel.dp_replicate": "data_parallel.replicate",
    "parallel.dp_shard": "data_parallel.shard",
    "parallel.zero_stage": "data_parallel.zero_stage",
    "parallel.param_dtype": "data_parallel.param_dtype",
    "parallel.offload": "data_parallel.offload",
    "parallel.dp_mode": "data_parallel.mode",
    "parallel.tp": "tensor_parallel.degree",
    "parallel.sequence_parallel": "tensor_parallel.sequence_parallel",
    "parallel.cp": "context_parallel.degree",
    "parallel.cp_method": "context_parallel.method",
    "parallel.cp_heads": "context_parallel.heads",
    "parallel.pp": "pipeline_parallel.degree",
    "parallel.pp_schedule": "pipeline_parallel.schedule",
    "parallel.pp_virtual": "pipeline_parallel.virtual",
    "parallel.pp_layers_per_stage": "pipeline_parallel.layers_per_stage",
    "parallel.pp_balance": "pipeline_parallel.balance",
    "parallel.bucket_mb": "gradient_comm.bucket_mb",
    "parallel.reduce_dtype": "gradient_comm.reduce_dtype",
    "parallel.allreduce_algorithm": "gradient_comm.allreduce_algorithm",
    "parallel.node_size": "gradient_comm.node_size",
    "parallel.comm_schedule": "gradient_comm.schedule",
    "parallel.slice_mb": "gradient_comm.slice_mb",
    "parallel.compression": "gradient_comm.compression",
    "parallel.compression_block": "gradient_comm.compression_block",
    "parallel.topk_ratio": "gradient_comm.topk_ratio",
    "parallel.powersgd_rank": "gradient_comm.powersgd_rank",
    "parallel.ps_servers": "parameter_server.servers",
    "parallel.ps_sync": "parameter_server.sync",
    "parallel.ps_staleness": "parameter_server.staleness",
    "parallel.recompute": "train.recompute",
}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, raw: Any, annotation: Any) -> Any:
    """Convert a TOML or command-line value to the field's declared type."""
    origin = typing.get_origin(annotation)
    if origin is list:
        items = [x for x in raw.replace(" ", "").split(",") if x] if isinstance(raw, str) else raw
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{key} = {raw!r}: expected a list, e.g. 1,2,3")
        (item_type,) = typing.get_args(annotation)
        return [_coerce(key, item, item_type) for item in items]
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        return _coerce(key, raw, args[0])
    try:
        if annotation is bool:
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(raw, str) and raw.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if annotation is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw) if not isinstance(raw, str) else int(raw.replace("_", ""))
        if annotation is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if annotation is str:
            if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
                raise ValueError
            return str(raw)
    except ValueError:
        pass
    else:
        raise ConfigError(f"{key}: unsupported field type {annotation}")  # pragma: no cover
    kind = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(f"{key} = {raw!r}: expected {kind}")


def _keys_of(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(getattr(JobConfig(), section))]


def _unknown_key(section: str, key: str, source: str) -> ConfigError:
    valid = _keys_of(section) + ([PRESET_KEY] if section == "model" else [])
    elsewhere = [f"{other}.{key}" for other in SECTIONS if other != section and key in _keys_of(other)]
    hint = f" (did you mean {elsewhere[0]!r}?)" if elsewhere else did_you_mean(key, valid)
    return ConfigError(f"unknown key {section}.{key} in {source}; valid keys of [{section}]: {', '.join(valid)}{hint}")


def _renamed(section: str, values: dict[str, Any], source: str, translate: bool) -> dict[str, dict[str, Any]]:
    """Settings of a renamed key, regrouped by their new section; a clear error unless `translate`."""
    out: dict[str, dict[str, Any]] = {}
    for key, raw in values.items():
        new = RENAMED.get(f"{section}.{key}")
        if new is None:
            valid = sorted({name.split(".")[0] for name in RENAMED.values()})
            raise ConfigError(f"unknown key {section}.{key} in {source}: the [parallel] settings now live in "
                              f"{', '.join('[' + v + ']' for v in valid)}")
        if not translate:
            new_section, new_key = new.split(".")
            raise ConfigError(f"{section}.{key} in {source} was renamed: use {new} "
                              f"(--{new} VALUE, or {new_key} = ... under [{new_section}])")
        new_section, new_key = new.split(".")
        out.setdefault(new_section, {})[new_key] = raw
    return out


def _apply_section(cfg: JobConfig, section: str, values: dict[str, Any], source: str, translate: bool = False) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] in {source} must be a table of key = value pairs")
    values = {k.replace("-", "_"): v for k, v in values.items()}
    if section == "parallel":
        for new_section, new_values in _renamed(section, values, source, translate).items():
            _apply_section(cfg, new_section, new_values, source)
        return
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown config section [{section}] in {source}; valid sections: {', '.join(SECTIONS)}"
            f"{did_you_mean(section, SECTIONS)}"
        )
    current = getattr(cfg, section)
    if section == "model" and PRESET_KEY in values:
        name = values.pop(PRESET_KEY)
        if name not in PRESETS:
            raise ConfigError(
                f"model.preset = {name!r} is unknown; valid presets: {', '.join(PRESETS)}{did_you_mean(str(name), PRESETS)}"
            )
        current = get_preset(name)
    hints = _field_types(type(current))
    updates = {}
    for key, raw in values.items():
        if key not in hints:
            raise _unknown_key(section, key, source)
        updates[key] = _coerce(f"{section}.{key}", raw, hints[key])
    setattr(cfg, section, dataclasses.replace(current, **updates))


def parse_overrides(args: list[str]) -> dict[str, dict[str, str]]:
    """Turn `--section.key value` / `--section.key=value` pairs into {section: {key: value}}."""
    out: dict[str, dict[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE (e.g. --train.steps 100)")
        if "=" in arg:
            name, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value: write {arg} VALUE")
            name, value = arg[2:], args[i + 1]
            i += 2
        section, key = name.split(".", 1)
        out.setdefault(section.replace("-", "_"), {})[key.replace("-", "_")] = value
    return out


# Model settings a user may change on a model taken from a Hugging Face folder: they change no weight
# (the mixture-of-experts balancing and capacity settings are training choices, not the architecture).
HF_INIT_FREE = ("init_from_hf", "name", "max_seq_len", "init_std", "moe_aux_loss", "moe_aux_coeff", "moe_z_loss_coeff",
                "moe_bias_update_rate", "moe_capacity_factor", "moe_drop_policy")


def _given(sections: dict[str, Any], section: str) -> set[str]:
    values = sections.get(section)
    return {key.replace("-", "_") for key in values} if isinstance(values, dict) else set()


def apply_hf_init(cfg: JobConfig, given_model: set[str], given_data: set[str]) -> JobConfig:
    """With model.init_from_hf: the model settings from the folder's config.json (any the user also gave
    must agree), and its tokenizer unless data.tokenizer is given."""
    folder = cfg.model.init_from_hf
    if not folder:
        return cfg
    from fivefold.model.hf import read_hf_config  # torch is needed from here on anyway

    if PRESET_KEY in given_model:
        raise ConfigError(f"model.preset and model.init_from_hf = {folder} both choose the model: keep one")
    if not Path(folder).is_dir():
        raise ConfigError(f"model.init_from_hf = {folder}: no such folder (a local Hugging Face model folder "
                          "with config.json and *.safetensors)")
    model = read_hf_config(folder)
    for key in sorted(given_model - {PRESET_KEY}):
        ours, theirs = getattr(cfg.model, key), getattr(model, key, None)
        if key in HF_INIT_FREE:
            model = dataclasses.replace(model, **{key: ours})
        elif ours != theirs:
            raise ConfigError(f"model.{key} = {ours!r} conflicts with {folder}/config.json, which gives {theirs!r}: "
                              f"drop model.{key} (the folder decides the model's shape) or drop model.init_from_hf")
    cfg.model = model
    if "tokenizer" not in given_data:
        if not (Path(folder) / "tokenizer.json").is_file():
            raise ConfigError(f"model.init_from_hf = {folder} holds no tokenizer.json: set data.tokenizer to the "
                              "model's tokenizer folder or tokenizer.json")
        cfg.data = dataclasses.replace(cfg.data, tokenizer=str(folder))
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file, then `--section.key value` overrides (then model.init_from_hf); validated."""
    cfg = JobConfig()
    given_model: set[str] = set()
    given_data: set[str] = set()
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder: give the path of a .toml file")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_bytes().decode("utf-8"))
        except OSError as exc:
            raise ConfigError(f"config file {path} cannot be read ({exc.strerror})") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}): is it a TOML file?") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
        for section, values in data.items():
            _apply_section(cfg, section, values, str(path))
        given_model |= _given(data, "model")
        given_data |= _given(data, "data")
    command_line = parse_overrides(overrides or [])
    for section, values in command_line.items():
        _apply_section(cfg, section, values, "command-line overrides")
    given_model |= _given(command_line, "model")
    given_data |= _given(command_line, "data")
    return apply_hf_init(cfg, given_model, given_data).validate()


def config_from_dict(data: dict[str, Any]) -> JobConfig:
    """Rebuild a JobConfig saved with `to_dict` (e.g. from a checkpoint; older flat [parallel] sections translated)."""
    cfg = JobConfig()
    for section, values in data.items():
        _apply_section(cfg, section, dict(values), "saved config", translate=True)
    return cfg.validate()


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def config_toml(config: dict[str, dict[str, Any]]) -> str:
    """A JobConfig dictionary (sections of scalars and lists) as TOML `load_config` reads back."""
    lines = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items() if value is not None)
        lines.append("")
    return "\n".join(lines)
