"""The bash subset reader: every construct Megatron launch scripts use, interpreted without running anything."""

from __future__ import annotations

import textwrap

import pytest

from heteroflow.megatron.shell import ShellSyntaxError, run_script
from heteroflow.megatron.shell.arith import ArithError, evaluate


def words(script: str, *, args=(), env=None) -> list[str]:
    """The words of the last command the script would run (`echo` is a fine probe: it is never run)."""
    run = run_script(textwrap.dedent(script), args=args, env=env)
    assert run.commands, "the script runs no command"
    return [f.text for f in run.commands[-1].fields[1:]]


def run(script: str, **kw):
    return run_script(textwrap.dedent(script), **kw)


# -- tokenizer -----------------------------------------------------------------------------------
def test_quotes_escapes_and_comments():
    assert words("""echo 'a b' "c $X d" e\\ f g#h # a comment\n""", env={"X": "x"}) == ["a b", "c x d", "e f", "g#h"]


def test_line_continuations_join_a_command():
    assert words("echo a \\\n  b \\\n  c\n") == ["a", "b", "c"]


def test_backslash_then_spaces_at_line_end_is_read_as_a_continuation_and_noted():
    result = run("echo a \\   \n  b\n")
    assert [f.text for f in result.commands[0].fields] == ["echo", "a", "b"]
    assert any("backslash followed by spaces" in n for n in result.notes)


def test_crlf_line_endings_are_read():
    assert words("X=1\r\necho $X\r\n") == ["1"]


def test_heredoc_bodies_are_skipped():
    script = """
    cat <<EOF > hostfile
    node1 slots=8
    torchrun is not a command here
    EOF
    echo after
    """
    result = run(script)
    assert [c.name for c in result.commands] == ["cat", "echo"]


def test_unterminated_quote_is_a_syntax_error_with_its_line():
    with pytest.raises(ShellSyntaxError, match="line 2: unterminated double quote"):
        run_script('X=1\necho "abc\n')


# -- parameters ----------------------------------------------------------------------------------
def test_default_and_assign_default_expansions():
    script = """
    A=${UNSET_A:-fallback}
    B=${B:=assigned}
    C=""
    echo $A $B ${C:-empty} ${C-kept}x ${A:+alt} "${NOPE:+alt}"
    """
    assert words(script) == ["fallback", "assigned", "empty", "x", "alt", ""]


def test_environment_given_by_the_user_wins_over_defaults():
    assert words("N=${NUM_NODES:-1}\necho $N\n", env={"NUM_NODES": "4"}) == ["4"]


def test_string_operations():
    script = """
    P=/data/my_text_document.bin
    echo ${P#*/} ${P##*/} ${P%.bin} ${P%%_*} ${#P} ${P/text/tok} ${P:6:2}
    T=MiXeD
    echo ${T,,} ${T^^}
    """
    run_result = run(script)
    first = [f.text for f in run_result.commands[0].fields[1:]]
    assert first == ["data/my_text_document.bin", "my_text_document.bin", "/data/my_text_document", "/data/my",
                     "26", "/data/my_tok_document.bin", "my"]
    assert [f.text for f in run_result.commands[1].fields[1:]] == ["mixed", "MIXED"]


def test_positional_parameters_with_defaults_shift_and_set():
    script = """
    echo $1 ${2:-two} ${3:-three} $#
    shift
    echo $1 "$@"
    set -- x y
    echo $2
    """
    result = run(script, args=("a", "b"))
    assert [[f.text for f in c.fields[1:]] for c in result.commands] == [["a", "b", "three", "2"], ["b", "b"], ["y"]]


def test_unset_values_stay_visible_and_are_listed():
    result = run("DATA=$5\necho --data-path $DATA --x ${UNSET}/suffix\n")
    fields = result.commands[0].fields
    assert [(f.text, f.known) for f in fields[1:]] == [("--data-path", True), ("$5", False), ("--x", True),
                                                      ("${UNSET}/suffix", False)]
    assert result.missing == {"5": 1, "UNSET": 2}


def test_unknown_parts_do_not_stop_the_rest_of_a_string_from_splitting():
    result = run('OPTS="$OPTS --num-layers 32"\necho $OPTS\n')
    assert [(f.text, f.known) for f in result.commands[0].fields[1:]] == [
        ("$OPTS", False), ("--num-layers", True), ("32", True)]


def test_command_substitution_is_never_run():
    result = run("D=$(hostname)\nE=`date`\necho $D $E\n")
    assert [(f.text, f.known) for f in result.commands[0].fields[1:]] == [("$(hostname)", False), ("`date`", False)]
    assert any("never run" in n for n in result.notes)


# -- arithmetic ----------------------------------------------------------------------------------
@pytest.mark.parametrize("expr, value", [("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("7 / 2", 3), ("-7 / 2", -3),
                                         ("-7 % 3", -1), ("2 ** 10", 1024), ("1 << 4", 16), ("5 > 3 && 2 < 1", 0),
                                         ("0 || 3", 1), ("4 == 4 ? 10 : 20", 10), ("0x10 + 010", 24),
                                         ("!0", 1), ("~0", -1)])
def test_arithmetic_follows_bash(expr, value):
    assert evaluate(expr, lambda name: None) == value


def test_arithmetic_variables_and_unknowns():
    known = {"GPUS": 8, "NODES": 2}
    assert evaluate("GPUS * NODES", known.get) == 16
    assert evaluate("GPUS * MISSING", known.get) is None
    assert evaluate("0 && MISSING", known.get) == 0


def test_arithmetic_never_evaluates_python():
    with pytest.raises(ArithError):
        evaluate("__import__('os').system('true')", lambda n: None)
    with pytest.raises(ArithError, match="division by 0"):
        evaluate("1 / 0", lambda n: None)


def test_arithmetic_expansion_in_scripts():
    script = """
    GPUS_PER_NODE=8
    NUM_NODES=2
    WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))
    HALF=$(( WORLD_SIZE / 2 ))
    i=0
    (( i += 5 ))
    echo $WORLD_SIZE $HALF $i $((UNKNOWN + 1))
    """
    assert words(script) == ["16", "8", "5", "$((UNKNOWN + 1))"]


# -- arrays --------------------------------------------------------------------------------------
def test_arrays_append_and_expand():
    script = """
    ARGS=(
        --num-layers 32   # a comment inside the array
        --split "99,1,0"
    )
    ARGS+=(--bf16)
    EMPTY=()
    echo ${ARGS[@]} "${EMPTY[@]}" ${#ARGS[@]} ${ARGS[1]} ${ARGS[-1]}
    """
    assert words(script) == ["--num-layers", "32", "--split", "99,1,0", "--bf16", "5", "32", "--bf16"]


def test_quoted_elements_holding_several_flags_split_when_expanded_unquoted():
    script = """
    FP8=("--fp8-format hybrid" "--fp8-amax-history-len 1024")
    echo ${FP8[@]}
    echo "${FP8[@]}"
    echo "${FP8[*]}"
    """
    result = run(script)
    texts = [[f.text for f in c.fields[1:]] for c in result.commands]
    assert texts == [["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"],
                     ["--fp8-format hybrid", "--fp8-amax-history-len 1024"],
                     ["--fp8-format hybrid --fp8-amax-history-len 1024"]]


def test_array_of_an_array_and_element_assignment():
    script = """
    A=(a b)
    B=("${A[@]}" c)
    B[4]=e
    echo "${B[@]}"
    """
    assert words(script) == ["a", "b", "c", "", "e"]


def test_declaration_builtins_assign():
    script = """
    export A=1 B
    declare -a ARR=(x y)
    readonly C=3
    local D=4
    echo $A ${ARR[1]} $C $D
    """
    assert words(script) == ["1", "y", "3", "4"]


# -- control flow --------------------------------------------------------------------------------
def test_if_elif_else_decided_from_the_script():
    script = """
    DTYPE=bf16
    if [[ "$DTYPE" == "fp8" ]]; then
        R=fp8
    elif [ "$DTYPE" = bf16 ] && [ 2 -gt 1 ]; then
        R=bf16
    else
        R=other
    fi
    echo $R
    """
    assert words(script) == ["bf16"]


def test_never_set_variables_read_as_empty_in_tests_and_are_reported():
    script = """
    R=none
    if [ -n "$WANDB_API_KEY" ]; then
        R=wandb
    else
        R=plain
    fi
    [ -z "$MASTER_ADDR" ] && MASTER_ADDR=localhost
    echo $R $MASTER_ADDR
    """
    result = run(script)
    assert [f.text for f in result.commands[-1].fields[1:]] == ["plain", "localhost"]
    assert any("line 3" in n and "$WANDB_API_KEY" in n and "taken as empty" in n for n in result.notes)
    assert any("$MASTER_ADDR" in n and "taken as empty" in n for n in result.notes)


def test_undecidable_condition_is_false_and_reported():
    script = """
    R=none
    if [ -f /etc/passwd ]; then R=file
    elif [ "$(hostname)" = gpu01 ]; then R=host
    else R=else; fi
    echo $R
    """
    result = run(script)
    assert [f.text for f in result.commands[-1].fields[1:]] == ["else"]
    assert sum("undecided condition" in n for n in result.notes) == 2


def test_condition_decided_by_env():
    script = 'if [ -n "$WANDB_API_KEY" ]; then R=wandb; else R=plain; fi\necho $R\n'
    assert words(script, env={"WANDB_API_KEY": "k"}) == ["wandb"]


@pytest.mark.parametrize("test, expected", [
    ('[[ $A == f* ]]', "yes"), ('[[ $A == "f*" ]]', "no"), ('[[ -z $E && -n $A ]]', "yes"),
    ('[[ ! $A =~ ^fo+$ ]]', "no"), ('[ $N -ge 8 -a $N -lt 9 ]', "yes"), ('[ "$A" != foo -o 1 -eq 2 ]', "no"),
    ('test $N -eq 8', "yes"), ('(( N > 4 ))', "yes"), ('[[ $A < g ]]', "yes"), ("! false", "yes"),
    ('false || true', "yes"), ('true && false', "no"),
])
def test_test_operators(test, expected):
    script = f'A=foo\nE=""\nN=8\nif {test}; then R=yes; else R=no; fi\necho $R\n'
    assert words(script) == [expected]


def test_and_or_lists_on_commands():
    script = """
    [ -z "$SET" ] && SET=default
    [ -n "$SET" ] || SET=never
    mkdir -p out && R=ran
    echo $SET $R
    """
    assert words(script) == ["default", "ran"]


def test_case_with_patterns_and_unknown_value():
    script = """
    SIZE=13B
    case $SIZE in
      7B|8B) L=32 ;;
      13B) L=40 ;;
      *) L=0 ;;
    esac
    case $UNSET_SIZE in
      70B) M=80 ;;
      *) M=default ;;
    esac
    case $(hostname) in
      gpu*) H=gpu ;;
      *) H=other ;;
    esac
    echo $L $M $H
    """
    result = run(script)
    assert [f.text for f in result.commands[-1].fields[1:]] == ["40", "default", "other"]
    assert any("$UNSET_SIZE" in n and "taken as empty" in n for n in result.notes)
    assert any("took the `*)` branch" in n for n in result.notes)


def test_for_and_while_loops():
    script = """
    DATA=""
    for shard in a b c; do
        DATA="$DATA 1.0 /data/$shard"
    done
    i=0
    while [ $i -lt 3 ]; do
        i=$((i + 1))
        if [ $i -eq 2 ]; then break; fi
    done
    echo $DATA $i
    """
    assert words(script) == ["1.0", "/data/a", "1.0", "/data/b", "1.0", "/data/c", "2"]


def test_functions_take_arguments():
    script = """
    add_args() {
        ARGS+=("$1" "$2")
    }
    function banner { echo "$@"; }
    ARGS=()
    add_args --lr 3e-4
    add_args --bf16 ""
    echo "${ARGS[@]}"
    """
    assert words(script) == ["--lr", "3e-4", "--bf16", ""]


def test_eval_and_bash_c_strings_are_interpreted():
    script = """
    CMD="torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 2"
    eval $CMD
    bash -c "echo from bash -c"
    """
    result = run(script)
    assert [f.text for f in result.commands[0].fields][:4] == ["torchrun", "--nproc_per_node", "8", "pretrain_gpt.py"]
    assert result.commands[0].line == 3
    assert [f.text for f in result.commands[1].fields] == ["echo", "from", "bash", "-c"]


def test_exit_stops_the_reading():
    result = run("echo one\nexit 0\necho two\n")
    assert [c.name for c in result.commands] == ["echo"]
    assert result.exited_at == 2


def test_source_is_not_followed_and_noted():
    result = run(". ./env.sh\nsource /opt/setup.sh\n")
    assert sum("is not followed" in n for n in result.notes) == 2


def test_nothing_is_ever_executed(tmp_path):
    marker = tmp_path / "marker"
    run_script(f"touch {marker}\nrm -rf {tmp_path}\npython -c 'open(\"{marker}\", \"w\")'\n$(touch {marker})\n")
    assert tmp_path.exists() and not marker.exists()


def test_redirections_and_pipes_are_dropped():
    result = run("torchrun a.py --x 1 2>&1 | tee log.txt > /dev/null\n")
    assert [f.text for f in result.commands[0].fields] == ["torchrun", "a.py", "--x", "1"]
    assert [f.text for f in result.commands[1].fields] == ["tee", "log.txt"]


def test_bash_c_inside_a_wrapper_keeps_the_wrapper_words():
    script = """
    srun --nodes 4 --ntasks-per-node 1 bash -c "torchrun --nnodes $SLURM_NNODES --nproc_per_node 8 pretrain_gpt.py --bf16"
    """
    result = run(script)
    texts = [f.text for f in result.commands[0].fields]
    assert texts[:5] == ["srun", "--nodes", "4", "--ntasks-per-node", "1"]
    assert texts[5:9] == ["torchrun", "--nnodes", "$SLURM_NNODES", "--nproc_per_node"]
    assert not result.commands[0].fields[7].known
