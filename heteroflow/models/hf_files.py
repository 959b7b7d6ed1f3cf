"""The small files of a Hugging Face checkpoint directory, read strictly: `config.json` and
`model.safetensors.index.json`. Every problem is a `UserError` naming the file and what is wrong with it.

The index names the files that hold the tensors; those names come from whoever wrote the directory, so
each must be a plain relative name that stays inside it (no `..`, no absolute path, no symlink leading
out). One exception: a Hugging Face hub cache snapshot (`.../snapshots/REVISION/`) keeps its files as
symlinks into the repository's `blobs/` folder, which is where they are meant to point.
No tensor data is read here, so the launcher can check a directory before any worker starts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path, PurePosixPath

from heteroflow.errors import UserError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
MAX_SMALL_FILE_BYTES = 64 << 20
"""config.json and the index are a few kB to a few MB; anything far larger is not one."""

_POSITIVE_INTS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
_OPTIONAL_POSITIVE_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
_OPTIONAL_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


def _fail(path: Path, message: str) -> UserError:
    return UserError(f"train.init_from: {path}: {message}")


def read_json_file(path: Path) -> object:
    """The parsed JSON document at `path`, or a `UserError` saying why it cannot be read."""
    try:
        if not path.is_file():
            raise _fail(path, "not found" if not path.exists() else "not a regular file")
        if path.stat().st_size > MAX_SMALL_FILE_BYTES:
            raise _fail(path, f"{path.stat().st_size} bytes, too large for a {path.name}")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(path, f"cannot read it ({exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(path, f"invalid JSON ({exc})") from None
    except RecursionError:
        raise _fail(path, "invalid JSON (nested too deeply)") from None


def read_hf_config(ckpt_dir: str | Path) -> dict:
    """The parsed `config.json` of a checkpoint directory, checked to have the shape of a Llama-family
    config (required sizes are positive integers, optional fields of the right type)."""
    path = Path(ckpt_dir, CONFIG_FILE)
    if not path.exists():
        raise UserError(f"train.init_from: {path} not found; point init_from at a Hugging Face model "
                        "directory (config.json + *.safetensors)")
    check_inside(Path(ckpt_dir), path, source=path, name=CONFIG_FILE)
    config = read_json_file(path)
    if not isinstance(config, dict):
        raise _fail(path, f"expected a JSON object (a mapping of settings), found {_json_type(config)}")
    problems = []
    for key in _POSITIVE_INTS:
        if key not in config:
            problems.append(f"missing {key!r}")
        elif not _is_positive_int(config[key]):
            problems.append(f"{key!r} must be a positive integer, found {config[key]!r}")
    for key in _OPTIONAL_POSITIVE_INTS:
        if config.get(key) is not None and not _is_positive_int(config[key]):
            problems.append(f"{key!r} must be a positive integer or null, found {config[key]!r}")
    for key in _OPTIONAL_POSITIVE_NUMBERS:
        value = config.get(key)
        if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
            problems.append(f"{key!r} must be a finite positive number, found {value!r}")
    for key in _OPTIONAL_BOOLS:
        if config.get(key) is not None and not isinstance(config[key], bool):
            problems.append(f"{key!r} must be true or false, found {config[key]!r}")
    for key in ("model_type", "hidden_act"):
        if key in config and not isinstance(config[key], str):
            problems.append(f"{key!r} must be a string, found {config[key]!r}")
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            problems.append(f"{key!r} must be an object or null, found {_json_type(rope)}")
            continue
        theta = rope.get("rope_theta")
        if theta is not None and not (_is_number(theta) and math.isfinite(theta) and theta > 0):
            problems.append(f"'{key}.rope_theta' must be a finite positive number, found {theta!r}")
    if not problems and config.get("num_key_value_heads") and config["num_attention_heads"] % config[
            "num_key_value_heads"]:
        problems.append(f"'num_attention_heads' ({config['num_attention_heads']}) is not a multiple of "
                        f"'num_key_value_heads' ({config['num_key_value_heads']})")
    if problems:
        raise _fail(path, "; ".join(problems))
    return config


def index_files(ckpt_dir: str | Path) -> dict[str, Path] | None:
    """Tensor name -> file, from `model.safetensors.index.json`; None when the directory has no index.

    The index must be an object whose `weight_map` maps tensor names (strings) to file names (strings)
    that stay inside the directory and exist.
    """
    root = Path(ckpt_dir)
    path = root / INDEX_FILE
    if not path.exists() and not path.is_symlink():
        return None
    check_inside(root, path, source=path, name=INDEX_FILE)
    index = read_json_file(path)
    if not isinstance(index, dict):
        raise _fail(path, f"expected a JSON object with a 'weight_map', found {_json_type(index)}")
    if "weight_map" not in index:
        raise _fail(path, "no 'weight_map' (tensor name -> file name)")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise _fail(path, f"'weight_map' must map tensor names to file names, found {_json_type(weight_map)}")
    if not weight_map:
        raise _fail(path, "'weight_map' is empty")
    bad = [f"{name!r}: {file!r}" for name, file in weight_map.items() if not isinstance(file, str)]
    if bad:
        raise _fail(path, f"'weight_map' values must be file names (strings): {', '.join(bad[:3])}"
                    + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))
    files = {name: safe_member(root, file, source=path) for name, file in weight_map.items()}
    missing = sorted({str(PurePosixPath(weight_map[n])) for n, f in files.items() if not f.is_file()})
    if missing:
        raise _fail(path, f"lists {len(missing)} file{'s' * (len(missing) > 1)} not in {root}: "
                    + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
    return files


def safe_member(root: Path, name: str, *, source: Path) -> Path:
    """`root / name` for a file name read from `source`, refused unless it stays inside `root`."""
    pure = PurePosixPath(name)
    if not name or "\0" in name or "\\" in name:
        raise _fail(source, f"file name {name!r} is not a plain file name")
    if pure.is_absolute():
        raise _fail(source, f"file name {name!r} is an absolute path; the files must be inside {root}")
    if ".." in pure.parts:
        raise _fail(source, f"file name {name!r} leads out of {root} ('..'); the files must be inside it")
    path = root.joinpath(*pure.parts)
    check_inside(root, path, source=source, name=name)
    return path


def check_inside(root: Path, path: Path, *, source: Path, name: str) -> None:
    """Refuse `path` when symlinks make it lead out of `root` (but see the module docstring: a hub snapshot)."""
    real_root, real = root.resolve(), path.resolve()
    if real.is_relative_to(real_root):
        return
    if real_root.parent.name == "snapshots" and real.is_relative_to(real_root.parent.parent / "blobs"):
        return  # a Hugging Face hub cache snapshot: its files are links into the repository's blobs/
    raise _fail(source, f"file {name!r} is a symlink to {real}, outside {root}; the files must be inside it")


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)
