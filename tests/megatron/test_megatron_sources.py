"""Reading what Megatron users have: sourced files, sbatch / srun / uv run launches, bash semantics the
issue names, functional-test model_config.yaml, --megatron-version rules, refusals by name."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from heteroflow.errors import UserError
from heteroflow.megatron import ImportOptions, import_megatron
from heteroflow.megatron.programs import program_family
from heteroflow.megatron.script_files import file_finder
from heteroflow.megatron.shell import run_script
from heteroflow.megatron.versions import MegatronVersion, null_tokenizer_vocab, parse_version
from megatron_helpers import BASE_ARGS, REPO, launch_script


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# -- bash ----------------------------------------------------------------------------------------
def test_source_and_dot_read_files_next_to_the_script_and_above_it(tmp_path):
    write(tmp_path / "conf" / "model.sh", "LAYERS=12\nsource $(dirname ${BASH_SOURCE[0]})/more.sh\n")
    write(tmp_path / "conf" / "more.sh", "HIDDEN=768\n")
    write(tmp_path / "examples" / "common.sh", "HEADS=12\n")
    script = write(tmp_path / "examples" / "gpt" / "run.sh", """\
        SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
        source "${SCRIPT_DIR}/../../conf/model.sh"
        . examples/common.sh
        echo $LAYERS $HIDDEN $HEADS $(pwd)
        """)
    run = run_script(script.read_text(), script_name=str(script), cwd=str(script.parent),
                     read_file=file_finder(script))
    assert [f.text for f in run.commands[-1].fields[1:]] == ["12", "768", "12", str(script.parent)]
    assert len(run.sourced) == 3


def test_unset_variable_in_arithmetic_test_is_zero_and_which_srun_is_not_found():
    run = run_script("which srun\nBATCH=$((1-$?))\nif [[ $UNSET -eq 0 && $BATCH -eq 0 ]]; then echo interactive; "
                     "else echo batch; fi\n")
    assert run.commands[-1].fields[1].text == "interactive"
    assert any("which srun" in n for n in run.notes)


def test_exit_names_the_variable_to_pass(tmp_path):
    script = write(tmp_path / "run.sh", """\
        if [[ -z $WORKSPACE ]]; then
            echo "Please set WORKSPACE"
            exit 1
        fi
        torchrun --nproc_per_node 8 pretrain_gpt.py $ARGS
        """)
    with pytest.raises(UserError, match=r"exits at line 3 because \$WORKSPACE is not set: pass --env WORKSPACE=VALUE"):
        import_megatron(script)
    result = import_megatron(script, ImportOptions(env={"WORKSPACE": "/w", "ARGS": BASE_ARGS}))
    assert result.report.launcher.startswith("torchrun pretrain_gpt.py")


def test_sbatch_follows_its_script_with_sbatch_directives(tmp_path):
    write(tmp_path / "job.sh", """\
        #!/bin/bash
        #SBATCH --nodes=2 --ntasks-per-node=8
        srun python pretrain_gpt.py $ARGS
        """)
    script = write(tmp_path / "submit.sh", f'export ARGS="{BASE_ARGS}"\nsbatch -p batch job.sh\n')
    result = import_megatron(script)
    assert (result.layout.world_size, result.report.layout.nnodes) == (16, 2)


def test_uv_run_and_module_entry_points(tmp_path):
    script = write(tmp_path / "run.sh", f"uv run --extra dev python -m torch.distributed.run --nproc-per-node 4 "
                                        f"pretrain_gpt.py {BASE_ARGS}\n")
    assert import_megatron(script).layout.world_size == 4
    inference = write(tmp_path / "gen.sh", "torchrun --nproc-per-node 1 -m examples.inference.offline_inference "
                                           "--load x\n")
    result = import_megatron(inference)
    assert result.blocked and "inference" in result.report.blockers[0]


@pytest.mark.parametrize("program, words", [
    ("pretrain_gpt.py", None), ("examples/multimodal/train.py", "multimodal"), ("pretrain_hybrid.py", "hybrid"),
    ("tools/run_text_generation_server.py", "inference"), ("tools/preprocess_data.py", "data preprocessing"),
    ("examples/mimo/train.py", "MIMO"), ("pretrain_t5.py", "T5")])
def test_program_families(program, words):
    family = program_family(program)
    assert (family is None) if words is None else (words in family)


# -- model_config.yaml ---------------------------------------------------------------------------
def test_model_config_flags_true_false_env_and_mode(tmp_path):
    path = write(tmp_path / "test_cases" / "gpt" / "case" / "model_config.yaml", """\
        MODEL_ARGS:
          --num-layers: 4
          --hidden-size: 256
          --num-attention-heads: 4
          --seq-length: 128
          --max-position-embeddings: 128
          --micro-batch-size: 1
          --global-batch-size: 8
          --train-iters: 10
          --lr: 1.0e-4
          --tokenizer-type: NullTokenizer
          --vocab-size: 1000
          --num-layers: 6
          --bf16: true
          --fp16: false
          --data-path: ${DATA_PATH}/text
        """)
    result = import_megatron(path, ImportOptions(nnodes=1, nproc_per_node=8, env={"DATA_PATH": "/d"}))
    assert result.job_dict["model"]["num_layers"] == 6  # a duplicate key keeps its last value, like PyYAML
    assert result.job_dict["train"]["precision"] == "bf16"
    assert result.job_dict["model"]["vocab_size"] == 1024  # exactly 1000, padded to 128 (current Megatron)
    text = path.read_text() + "MODE: inference\n"
    path.write_text(text)
    result = import_megatron(path, ImportOptions(nnodes=1, nproc_per_node=8))
    assert result.blocked and result.report.blockers[0].startswith("inference")


# -- rules and refusals --------------------------------------------------------------------------
def test_megatron_versions():
    assert parse_version("core_v0.17.1") == MegatronVersion(0, 17, 1) < parse_version("0.18")
    assert null_tokenizer_vocab(128256, parse_version("0.18.0"))[0] == 128256
    assert null_tokenizer_vocab(128256, parse_version("0.13"))[0] == 128257
    with pytest.raises(UserError, match="not a Megatron-Core release"):
        parse_version("latest")


@pytest.mark.parametrize("args, words", [
    ("--use-mup", "muP"), ("--attention-output-gate", "gated attention output"),
    ("--experimental-attention-variant gated_delta_net", "experimental attention variant"),
    ("--hybrid-layer-pattern M*M-", "hybrid")])
def test_model_changing_flags_are_refused_by_name(tmp_path, args, words):
    script = write(tmp_path / "run.sh", launch_script(args))
    result = import_megatron(script)
    assert result.blocked and any(words in b for b in result.report.blockers)


def test_spec_takes_a_module_and_a_name(tmp_path):
    script = write(tmp_path / "run.sh", launch_script("--spec megatron.core.models.gpt.gpt_layer_specs local_spec"))
    result = import_megatron(script)
    assert result.blocked and "custom layer spec" in result.report.blockers[0]
    spec = next(e for e in result.report.entries if e.key == "--spec")
    assert spec.value == "megatron.core.models.gpt.gpt_layer_specs local_spec"


def test_cluster_devices_are_the_world_size(tmp_path):
    script = write(tmp_path / "run.sh", launch_script("", gpus=8))
    cluster = write(tmp_path / "cluster.yaml", """\
        cluster:
          inter_node_gb_per_s: 25
          nodes:
            - {name: a, device: nvidia-h100-sxm, count: 8}
            - {name: b, device: nvidia-h100-sxm, count: 8}
        """)
    result = import_megatron(script, ImportOptions(cluster=cluster))
    assert result.layout.world_size == 16 and result.layout.parallel.dp == 16


def test_report_piped_into_head_exits_quietly():
    command = (f"{sys.executable} -m heteroflow import-megatron tests/megatron/scripts/train_llama3_8b_h100_fp8.sh "
               "--json | head -c 10")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_sbatch_here_document_with_bash_options_is_read(tmp_path):
    script = write(tmp_path / "submit.sh", f"""\
        CMD="python pretrain_gpt.py {BASE_ARGS}"
        sbatch <<EOF
        #!/bin/bash
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=4
        srun --mpi=pmix bash -x -c "$CMD"
        EOF
        """)
    result = import_megatron(script)
    assert (result.layout.world_size, result.report.layout.nnodes) == (8, 2)


def test_nemo_fractional_warmup_is_rounded_and_said(tmp_path):
    path = write(tmp_path / "gpt.yaml", """\
        trainer: {num_nodes: 1, devices: 8, max_steps: 100}
        model:
          micro_batch_size: 1
          global_batch_size: 8
          encoder_seq_length: 128
          max_position_embeddings: 128
          num_layers: 2
          hidden_size: 128
          ffn_hidden_size: 512
          num_attention_heads: 4
          tokenizer: {library: megatron, type: GPT2BPETokenizer}
          optim: {name: fused_adam, lr: 1.0e-4, sched: {name: CosineAnnealing, warmup_steps: 12.5, min_lr: 1.0e-5}}
        """)
    result = import_megatron(path, ImportOptions(vocab_size=50257))
    warmup = [e for e in result.report.entries if e.key == "model.optim.sched.warmup_steps"]
    assert any(e.disposition == "approximated" and "rounded to 12" in e.detail for e in warmup)
