"""Bounded YAML: hostile files are clear `FILE: message` errors (exit 2), quickly, never a traceback or a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import REPO
from heteroflow.config import load_job, read_yaml
from heteroflow.config.yamlfile import MAX_DEPTH, MAX_FILE_BYTES, MAX_NODES, dump_yaml
from heteroflow.errors import UserError



def error_of(path) -> str:
    with pytest.raises(UserError) as info:
        read_yaml(path)
    return str(info.value)


def billion_laughs(levels: int = 9) -> str:
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


def test_merge_keys_are_supported_and_later_keys_override(write_yaml):
    path = write_yaml("""
        cluster:
          nodes:
            - &gpu {name: g0, device: cpu, count: 2}
            - <<: *gpu
              name: g1
            - {<<: [*gpu], name: g2, count: 1}
        model: {preset: micro-llama}
        train: {global_batch_size: 4}
        """)
    job = load_job(path)
    assert [(n.name, n.device, n.count) for n in job.cluster.nodes] == [("g0", "cpu", 2), ("g1", "cpu", 2),
                                                                          ("g2", "cpu", 1)]


def test_merged_mapping_is_still_checked_strictly(write_yaml):
    path = write_yaml("""
        cluster:
          nodes:
            - &gpu {name: g0, device: cpu, count: 2}
            - {<<: *gpu, name: g1, cuont: 3}
        model: {preset: micro-llama}
        train: {global_batch_size: 4}
        """)
    with pytest.raises(UserError, match=r"cluster\.nodes\[1\]\.cuont: unknown key"):
        load_job(path)


@pytest.mark.parametrize("text,line_col,message", [
    ("a: 1\nb: 2\na: 3\n", "3:1", "duplicate key 'a'"),
    ("b: &b {x: 1}\nc: {<<: *b, <<: *b}\n", "2:13", "duplicate key '<<'"),
    ("b: &b {x: 1}\nc: {<<: *b, y: 1, y: 2}\n", "2:19", "duplicate key 'y'"),
    ("c: {<<: 1}\n", "1:9", "expected a mapping or list of mappings for merging"),
    ("? [a, b]\n: 1\n", "1:3", "a list cannot be a mapping key"),
    ("{[a]: 1}\n", "1:2", "a list cannot be a mapping key"),
    ("? {a: 1}\n: 1\n", "1:3", "a mapping cannot be a mapping key"),
    ("a: &a [1, *a]\n", "1:11", "alias *a is used inside its own anchor"),
    ("a: *nope\n", "1:4", "found undefined alias 'nope'"),
])
def test_bad_structure_is_a_located_error(write_yaml, text, line_col, message):
    path = write_yaml(text)
    assert error_of(path).startswith(f"{path}:{line_col}: YAML error: {message}")


@pytest.mark.parametrize("text,message", [
    ("x: " + "9" * 5000 + "\n", "a value cannot be read: a number with thousands of digits"),
    ("x: 2021-13-45\n", "a value cannot be read: month must be in 1..12"),
])
def test_unconvertible_scalars_are_errors(write_yaml, text, message):
    path = write_yaml(text)
    assert error_of(path) == f"{path}: YAML error: {message}"


@pytest.mark.parametrize("style", ["flow-list", "flow-map", "block"])
def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path, style):
    if style == "flow-list":
        text = "[" * 100_000 + "]" * 100_000
    elif style == "flow-map":
        text = "a: " + "{a: " * 100_000 + "1" + "}" * 100_000
    else:  # block nesting 100k deep would not fit in the size limit
        depth = MAX_DEPTH + 5
        text = "".join("  " * i + "a:\n" for i in range(depth)) + "  " * depth + "1\n"
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    message = error_of(path)
    assert message.startswith(f"{path}:") and f"nested more than {MAX_DEPTH} levels deep" in message


def test_nesting_up_to_the_limit_is_fine(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("[" * MAX_DEPTH + "]" * MAX_DEPTH)
    assert read_yaml(path) is not None


def test_alias_bomb_is_refused_quickly(write_yaml):
    path = write_yaml(billion_laughs())
    start = time.perf_counter()
    message = error_of(path)
    assert time.perf_counter() - start < 2
    assert f"more than {MAX_NODES} values (an alias counts its whole value at each use)" in message
    assert message.startswith(f"{path}:")


def test_modest_aliases_are_fine(write_yaml):
    data = read_yaml(write_yaml(billion_laughs(levels=3)))  # 10_000 expanded values
    assert len(data["a3"]) == 10 and data["a3"][0][0][0] == ["lol"] * 10


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo)
    result = subprocess.run([sys.executable, "-m", "heteroflow", "validate", str(fifo)], capture_output=True,
                            text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{fifo}: is a named pipe (FIFO), not a regular file" in result.stderr


@pytest.mark.parametrize("name", ["directory", "/dev/zero", "/dev/null"])
def test_non_regular_files_are_refused(tmp_path, name):
    path = tmp_path if name == "directory" else name
    kind = {"directory": "a directory", "/dev/zero": "a character device", "/dev/null": "a character device"}[name]
    assert error_of(path) == f"{path}: is {kind}, not a regular file; name a file"


def test_oversized_file_is_refused_without_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * (MAX_FILE_BYTES // 10 + 1))
    start = time.perf_counter()
    assert f"larger than {MAX_FILE_BYTES} bytes" in error_of(path)
    assert time.perf_counter() - start < 2


def test_binary_file_is_refused(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"\xff\xfe\x00junk")
    assert error_of(path).startswith(f"{path}: cannot read: not UTF-8 text")


@pytest.mark.parametrize("content", ["deep", "bomb", "complex-key", "dev-zero-cluster"])
def test_cli_reports_hostile_yaml_with_exit_2(write_yaml, content):
    text = {"deep": "[" * 100_000 + "]" * 100_000, "bomb": billion_laughs(), "complex-key": "? [a]\n: 1\n",
            "dev-zero-cluster": "cluster: /dev/zero\nmodel: {preset: micro-llama}\ntrain: {global_batch_size: 4}\n"}
    job = write_yaml(text[content])
    result = subprocess.run([sys.executable, "-m", "heteroflow", "validate", str(job)], capture_output=True,
                            text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr) < 2000
    assert result.stderr.startswith(f"heteroflow validate: error: {'/dev/zero' if 'zero' in content else job}")


@pytest.mark.parametrize("text, value", [("3e-4", 3e-4), ("1.2e5", 1.2e5), ("1E5", 1e5), (".5e3", 500.0),
                                         ("-2e+3", -2000.0), ("+1e5", 1e5), ("1.e3", 1000.0), ("1.5e-4", 1.5e-4)])
def test_exponent_numbers_are_floats(write_yaml, text, value):
    """YAML 1.2 reads `3e-4` as a number; PyYAML's YAML 1.1 rules would leave it a string and fail the job."""
    assert read_yaml(write_yaml(f"x: {text}\n")) == {"x": value}


@pytest.mark.parametrize("text", ["1e", "e5", "v1e5", "1e5x", "12e", "1e5e3"])
def test_exponent_lookalikes_stay_strings(write_yaml, text):
    assert read_yaml(write_yaml(f"x: {text}\n")) == {"x": text}


def test_job_learning_rates_in_exponent_form(write_yaml):
    path = write_yaml("""
        cluster: {nodes: [{name: g0, device: cpu, count: 1}]}
        model: {preset: micro-llama}
        train: {global_batch_size: 4, lr: 3e-4, min_lr: 3e-5}
        """)
    train = load_job(path).train
    assert (train.lr, train.min_lr) == (3e-4, 3e-5)


def test_written_yaml_reads_back_unchanged(tmp_path):
    """heteroflow's writer quotes a string that reads as an exponent float (a node named `1e3`)."""
    data = {"node": "1e3", "other": "2E-5", "lr": 3e-4, "tiny": 1e-300, "name": "gpu-0"}
    path = tmp_path / "out.yaml"
    path.write_text(dump_yaml(data, sort_keys=False))
    assert read_yaml(path) == data
