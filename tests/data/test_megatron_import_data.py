"""An `import-megatron`ed job reads the script's `--data-path` blend, `--split` and `--seed` as Megatron does."""

from __future__ import annotations

import textwrap

from indexed_helpers import megatron_train_split, write_dataset

from heteroflow.data import open_train_data
from heteroflow.megatron import ImportOptions, import_megatron

MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 3e-4 --tokenizer-type NullTokenizer "
         "--vocab-size 1000")


def _import(tmp_path, data_args: str):
    script = tmp_path / "train.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        DATA_ARGS=(--data-path 0.4 $DATA/a 0.6 $DATA/b --split '90,10,0')
        torchrun --nproc_per_node 2 pretrain_gpt.py {MODEL} --seed 42 {data_args}
        """))
    return import_megatron(script, ImportOptions(device_type="cpu", env={"DATA": str(tmp_path)}))


def _entry(result, key):
    return [e for e in result.report.entries if e.key == key][-1]


def test_imported_blend_split_and_seed_give_megatrons_samples(tmp_path):
    write_dataset(tmp_path / "a", num_docs=40, seed=1)
    write_dataset(tmp_path / "b", num_docs=25, seed=2, dtype="int32")
    result = _import(tmp_path, '"${DATA_ARGS[@]}" --eod-mask-loss')
    job = result.job
    data = job.train.data
    assert data.prefixes == (f"{tmp_path}/a", f"{tmp_path}/b") and data.weights == (0.4, 0.6)
    assert data.split == "90,10,0" and job.train.seed == 42
    assert _entry(result, "--data-path").disposition == "mapped"
    assert _entry(result, "--split").disposition == "mapped"
    assert _entry(result, "--eod-mask-loss").disposition == "approximated"
    opened = open_train_data(job, work_dir=tmp_path)
    reference = megatron_train_split(["0.4", f"{tmp_path}/a", "0.6", f"{tmp_path}/b"], split="90,10,0",
                                     seq_length=16, seed=42, num_samples=4 * 8)
    inputs, labels = opened.batch(range(4 * 8))
    for i in range(4 * 8):
        assert inputs[i].tolist() == reference[i]["tokens"].tolist()
        assert labels[i].tolist() == reference[i]["labels"].tolist()


def test_train_data_path_takes_every_document(tmp_path):
    result = _import(tmp_path, f"--train-data-path {tmp_path}/a --split 1,1,1")
    assert result.job.train.data.prefixes == (f"{tmp_path}/a",) and result.job.train.data.split == "100,0,0"
    assert _entry(result, "--train-data-path").disposition == "mapped"
