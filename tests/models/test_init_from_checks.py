"""`train.init_from` checked before any worker starts: index file names stay inside the directory, a
malformed index or config.json is a clear `UserError` naming the file (never a TypeError or KeyError)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from heteroflow.config import parse_job
from heteroflow.errors import ConfigError, UserError
from heteroflow.models.hf_checkpoint import HFCheckpoint, check_init_from, hf_config_from_spec

JOB = {"cluster": {"nodes": [{"name": "a", "device": "cpu", "count": 1}]},
       "model": {"preset": "micro-llama"},
       "train": {"global_batch_size": 2, "steps": 1},
       "plan": {"micro_batch_size": 1, "stages": [{"devices": ["a"], "layers": 4}]}}


def _job(ckpt_dir) -> object:
    return parse_job({**JOB, "train": {**JOB["train"], "init_from": str(ckpt_dir)}})


@pytest.fixture
def ckpt(tmp_path):
    """A sharded checkpoint directory for the job's model (the checks never read the weights: empty files)."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config_from_spec(_job(directory).model)))
    for k in (1, 2):
        (directory / f"model-{k:05d}-of-00002.safetensors").write_bytes(b"")
    write_index(directory, {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"})
    return directory


def write_index(directory, weight_map) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def check_message(directory) -> str:
    """The message `check_init_from` refuses the directory with (also refused by the worker's loader)."""
    with pytest.raises(UserError) as info:
        check_init_from(_job(directory))
    return str(info.value)


def test_a_well_formed_directory_passes(ckpt):
    check_init_from(_job(ckpt))


@pytest.mark.parametrize("name,fragment", [
    ("../outside.safetensors", "leads out of"),
    ("sub/../../outside.safetensors", "leads out of"),
    ("/etc/passwd", "is an absolute path"),
    ("", "not a plain file name"),
])
def test_index_file_names_must_stay_inside(ckpt, name, fragment):
    (ckpt.parent / "outside.safetensors").write_bytes(b"")
    write_index(ckpt, {"model.embed_tokens.weight": name})
    message = check_message(ckpt)
    assert f"{ckpt / 'model.safetensors.index.json'}: file name {name!r}" in message and fragment in message
    with pytest.raises(UserError, match="the files must be inside|not a plain file name"):
        HFCheckpoint(ckpt)  # the worker's loader applies the same rule


def test_symlink_leading_out_is_refused(ckpt, tmp_path):
    (tmp_path / "secret").write_bytes(b"")
    os.symlink(tmp_path / "secret", ckpt / "model-00003.safetensors")
    write_index(ckpt, {"model.embed_tokens.weight": "model-00003.safetensors"})
    message = check_message(ckpt)
    assert f"file 'model-00003.safetensors' is a symlink to {tmp_path / 'secret'}, outside {ckpt}" in message
    # ... also without an index: every *.safetensors of the directory must be inside it
    (ckpt / "model.safetensors.index.json").unlink()
    assert "is a symlink to" in check_message(ckpt)


def test_hub_cache_snapshot_links_into_blobs_are_allowed(tmp_path):
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "1111").write_text(json.dumps(hf_config_from_spec(_job(snapshot).model)))
    (blobs / "2222").write_bytes(b"")
    os.symlink("../../blobs/1111", snapshot / "config.json")
    os.symlink("../../blobs/2222", snapshot / "model.safetensors")
    check_init_from(_job(snapshot))


@pytest.mark.parametrize("index,fragment", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object with a 'weight_map', found a list"),
    ('{"metadata": {}}', "no 'weight_map'"),
    ('{"weight_map": ["a.safetensors"]}', "'weight_map' must map tensor names to file names, found a list"),
    ('{"weight_map": {}}', "'weight_map' is empty"),
    ('{"weight_map": {"model.norm.weight": 3}}', "'weight_map' values must be file names (strings): "
                                                  "'model.norm.weight': 3"),
    ('{"weight_map": {"model.norm.weight": "model-00009.safetensors"}}',
     "lists 1 file not in"),
])
def test_malformed_index_is_a_clear_error(ckpt, index, fragment):
    (ckpt / "model.safetensors.index.json").write_text(index)
    message = check_message(ckpt)
    assert message.startswith(f"train.init_from: {ckpt / 'model.safetensors.index.json'}: ") and fragment in message


@pytest.mark.parametrize("edit,fragment", [
    (lambda c: "[]", "expected a JSON object (a mapping of settings), found a list"),
    (lambda c: "{", "invalid JSON"),
    (lambda c: json.dumps({k: v for k, v in c.items() if k != "hidden_size"}), "missing 'hidden_size'"),
    (lambda c: json.dumps({**c, "num_hidden_layers": "four"}), "'num_hidden_layers' must be a positive integer"),
    (lambda c: json.dumps({**c, "num_attention_heads": 0}), "'num_attention_heads' must be a positive integer"),
    (lambda c: json.dumps({**c, "rms_norm_eps": "tiny"}), "'rms_norm_eps' must be a finite positive number"),
    (lambda c: json.dumps({**c, "rope_parameters": "default"}), "'rope_parameters' must be an object or null"),
    (lambda c: json.dumps({**c, "tie_word_embeddings": "no"}), "'tie_word_embeddings' must be true or false"),
    (lambda c: json.dumps({**c, "model_type": ["llama"]}), "'model_type' must be a string"),
])
def test_malformed_config_is_a_clear_error(ckpt, edit, fragment):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(edit(config))
    message = check_message(ckpt)
    assert message.startswith(f"train.init_from: {ckpt / 'config.json'}: ") and fragment in message


def test_config_of_another_model_names_each_difference(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6, "vocab_size": 512}))
    with pytest.raises(ConfigError) as info:
        check_init_from(_job(ckpt))
    lines = str(info.value).splitlines()
    assert any("model.num_layers is 4 but config.json says num_hidden_layers = 6" in line for line in lines)
    assert any("model.vocab_size" in line and "vocab_size = 512" in line for line in lines)


def test_missing_directory_and_missing_files(tmp_path, ckpt):
    assert "is not a directory" in check_message(tmp_path / "nowhere")
    (ckpt / "model.safetensors.index.json").unlink()
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    assert "no *.safetensors in" in check_message(ckpt)
    (ckpt / "config.json").unlink()
    assert f"{ckpt / 'config.json'} not found" in check_message(ckpt)


def test_train_refuses_a_bad_index_before_launch(tmp_path, ckpt):
    write_index(ckpt, {"model.embed_tokens.weight": "/etc/passwd"})
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({**JOB, "train": {**JOB["train"], "init_from": str(ckpt)}}))
    result = subprocess.run([sys.executable, "-m", "heteroflow", "train", str(job), "--emulate"], capture_output=True,
                            text=True, timeout=300, cwd=REPO,
                            env={**os.environ, "HETEROFLOW_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "file name '/etc/passwd' is an absolute path" in result.stderr
    assert "stages on" not in result.stdout  # stopped before the launch line
