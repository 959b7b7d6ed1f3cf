"""Every value that reaches a worker's process environment (cluster, device type and node `env`, node names)
or its sockets (`host`) is checked by `validate`: one `path: message` line each, never a failure at launch."""

from __future__ import annotations

import pytest

from conftest import problems, run_heteroflow
from heteroflow.config.cluster import MAX_ENV_ENTRY_BYTES, MAX_NODE_ENV_BYTES


def job(env=None, node_env=None, type_env=None, name="a", host=None) -> dict:
    node = {"name": name, "device": "cpu", "count": 2, **({"env": node_env} if node_env else {}),
            **({"host": host} if host is not None else {})}
    cluster = {"nodes": [node], **({"env": env} if env else {}),
               **({"device_types": {"cpu": {"env": type_env}}} if type_env else {})}
    return {"cluster": cluster, "model": {"preset": "micro-llama"}, "train": {"global_batch_size": 4}}


@pytest.mark.parametrize("where, data", [
    ("cluster.env.X", job(env={"X": "a\0b"})),
    ("cluster.nodes[0].env.X", job(node_env={"X": "\0"})),
    ("cluster.device_types.cpu.env.X", job(type_env={"X": "ok\0"})),
])
def test_a_nul_byte_in_any_env_is_refused_with_its_path(where, data):
    assert problems(data) == [f"{where}: the value holds a NUL byte (\\0), which no process environment can hold; "
                              "remove it"]


def test_an_entry_longer_than_the_kernel_takes_is_refused():
    fits = "x" * (MAX_ENV_ENTRY_BYTES - len("X="))
    assert problems(job(env={"X": fits})) == []
    [line] = problems(job(env={"X": fits + "y"}))
    assert line.startswith(f"cluster.env.X: NAME=VALUE is {MAX_ENV_ENTRY_BYTES + 1:,} bytes; a process environment "
                           f"entry holds at most {MAX_ENV_ENTRY_BYTES:,}")


def test_a_lone_surrogate_is_refused():
    [line] = problems(job(env={"X": "\ud800"}))
    assert line.startswith("cluster.env.X: the value holds a lone UTF-16 surrogate")


def test_a_node_s_variables_together_must_fit():
    big = {f"V{i}": "y" * 100_000 for i in range(6)}
    more = {f"W{i}": "y" * 100_000 for i in range(6)}
    assert problems(job(env=big)) == []  # 600 kB: fits
    [line] = problems(job(env=big, node_env=more))  # 1.2 MB for node a, from two places
    assert line.startswith("cluster.nodes[0].env: the variables node 'a' gets (cluster, device type and node env) "
                           "take 1,200,")
    assert f"at most {MAX_NODE_ENV_BYTES:,}" in line


@pytest.mark.parametrize("name, message", [
    ("a\0", "node name 'a\\x00' holds '\\x00'"), ("../x", "node name '../x' holds '/'"),
    ("a\nb", "node name 'a\\nb' holds '\\n'"), ("..", "node name '..' is a directory name"),
    ("n" * 256, "node name is 256 characters long; at most 255"),
])
def test_node_names_that_cannot_be_a_variable_or_a_log_directory(name, message):
    [line] = problems(job(name=name))
    assert line.startswith(f"cluster.nodes[0].name: {message}"), line


@pytest.mark.parametrize("host, message", [("10.0.0.1 ", "holds ' '"), ("h\0", "holds '\\x00'"),
                                           ("h" * 254, "is 254 characters long; at most 253")])
def test_hosts_that_no_socket_takes(host, message):
    [line] = problems(job(host=host))
    assert line.startswith("cluster.nodes[0].host: host") and message in line, line


def test_validate_reports_it_without_a_traceback(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text('cluster: {nodes: [{name: a, device: cpu, count: 2}], env: {X: "a\\0b", Y: ok}}\n'
                    "model: {preset: micro-llama}\ntrain: {global_batch_size: 4}\n")
    result = run_heteroflow("validate", str(path), timeout_s=120)
    assert result.returncode == 2
    assert "cluster.env.X: the value holds a NUL byte" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
