"""Read Megatron's and NeMo's YAML files the way their own loaders do: PyYAML's safe loader, where a
duplicate key keeps its last value and merge keys (`<<: *anchor`) apply, unlike heteroflow's strict
job loader."""

from __future__ import annotations

import os

import yaml

from heteroflow.config.yamlfile import read_text_file
from heteroflow.errors import UserError


def read_megatron_yaml_file(path: str | os.PathLike) -> object:
    """The data of a Megatron / NeMo YAML file; YAML errors are `UserError`s naming the file and line."""
    text = read_text_file(path)
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise UserError(f"{where}: YAML error: {exc.problem or exc.context}") from None
    except (yaml.YAMLError, RecursionError, ValueError, OverflowError, TypeError) as exc:
        raise UserError(f"{path}: YAML error: {exc}") from None
