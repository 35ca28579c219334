"""Errors a newcomer can read: every bad input ends on one line naming the problem and the fix, no traceback.

`python -m picotron.train` prints "python -m picotron.train: error: ..." for each: bad input before any
rank starts with exit status 2, an error while training (in this process or on a rank) with status 1
and a second line saying to rerun with --traceback, which shows the whole traceback instead. Then the
course's command line, `picotron.launch.run`'s arguments and the Hugging Face loader.
"""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import picotron.launch as launch
import picotron.train as train_module
from picotron import checkpoint
from picotron.config import Config, ParallelConfig, TrainConfig
from picotron.data import load_text
from picotron.hf import load_hf_llama
from picotron.launch import run
from picotron.train import Trainer, main
from picotron_course.__main__ import main as course_main
from picotron_course.grade import GradeError, grade, grade_folder

ROOT = Path(__file__).resolve().parents[1]
ERROR = "python -m picotron.train: error: "
HINT = "python -m picotron.train: rerun with --traceback to see where it was raised"
TINY_RUN = ["--dp", "1", "--steps", "1"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A folder of bad (and one good) inputs: short and malformed corpora, an empty folder, a checkpoint."""
    folder = tmp_path_factory.mktemp("inputs")
    (folder / "short.txt").write_text("hello\n")                          # 6 bytes: no window of 64 + 1
    (folder / "small.txt").write_text("abcdefghij" * 30)                  # 300 bytes: 4 windows of 64
    (folder / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (folder / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 40)
    (folder / "empty").mkdir()
    trainer = Trainer(Config(parallel=ParallelConfig(dp=1), train=TrainConfig(steps=0)))   # the default model
    checkpoint.save(trainer, folder / "ckpt" / "step_000000", 0)
    return folder


def _one_line(capsys, argv: list[str], status: int) -> str:
    """Run main(argv), expect exit `status`, and return its one error line (without the prefix): a
    second line, the hint, only for an error while training (status 1); never a traceback."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == status, err
    lines = err.splitlines()
    assert "Traceback" not in err and lines and lines[0].startswith(ERROR), err
    assert lines[1:] == ([HINT] if status == 1 else []), err
    if status == 2:
        assert out == ""                 # bad input: nothing was built, no rank started
    return lines[0][len(ERROR):]


# (name, the flags after TINY_RUN (INPUTS stands for the folder), exit status, what the line must say)
TRAIN_CASES = [
    ("missing-dataset", ["--dataset", "INPUTS/nope.txt"], 2,
     ["dataset path INPUTS/nope.txt does not exist", "give a .txt or .jsonl file", "--dataset arithmetic"]),
    ("dataset-folder-without-text", ["--dataset", "INPUTS/empty"], 2,
     ["folder INPUTS/empty holds no .txt or .jsonl files", "put the corpus there"]),
    ("dataset-too-short", ["--dataset", "INPUTS/short.txt"], 1,
     ["dataset INPUTS/short.txt holds 6 tokens", "too short for one window of seq_len + 1 = 65 tokens",
      "use more text (--dataset) or seq_len at most 5 (--seq-len)"]),
    ("malformed-jsonl", ["--dataset", "INPUTS/bad.jsonl"], 1,
     ["INPUTS/bad.jsonl line 2 is not valid JSON", "column 10", "each line must be one JSON object such as"]),
    ("not-utf8", ["--dataset", "INPUTS/latin1.txt"], 1, ["INPUTS/latin1.txt is not UTF-8 text", "convert it to UTF-8"]),
    ("batch-larger-than-data", ["--dataset", "INPUTS/small.txt", "--micro-batch-size", "8"], 1,
     ["dp_size * micro_batch_size = 1 * 8 windows, but the dataset has only 4",
      "or micro_batch_size at most 4 (--micro-batch-size)"]),
    ("missing-tokenizer", ["--tokenizer", "INPUTS/nope.json"], 2,
     ["tokenizer INPUTS/nope.json does not exist", "give the path of a Hugging Face tokenizer.json"]),
    ("not-a-tokenizer", ["--tokenizer", "INPUTS/short.txt"], 2,
     ["INPUTS/short.txt is not a tokenizer.json the tokenizers library can read"]),
    ("resume-missing", ["--resume", "INPUTS/nockpt"], 2,
     ["no checkpoint at 'INPUTS/nockpt': the directory does not exist",
      "pass a directory checkpoint.save wrote (the trainer's --save-dir writes SAVE_DIR/step_NNNNNN)"]),
    ("resume-empty-folder", ["--resume", "INPUTS/empty"], 2,
     ["'INPUTS/empty' holds no checkpoint: DCP's .metadata file is missing", "pass a directory checkpoint.save wrote"]),
    ("resume-the-save-dir", ["--resume", "INPUTS/ckpt"], 2,
     ["'INPUTS/ckpt' holds no checkpoint", "INPUTS/ckpt holds the checkpoints step_000000: pass one of them, "
                                          "e.g. INPUTS/ckpt/step_000000"]),
    ("resume-a-step-never-saved", ["--resume", "INPUTS/ckpt/step_000100"], 2,
     ["does not exist", "INPUTS/ckpt holds the checkpoints step_000000"]),
    ("resume-another-model", ["--preset", "tiny-moe", "--resume", "INPUTS/ckpt/step_000000"], 2,
     ["the checkpoint at 'INPUTS/ckpt/step_000000' is of a different model",
      "intermediate_size=512 there, 256 here; num_experts=0 there, 8 here",
      "Build the model with the config it was saved with", "the same --config, --preset and model flags"]),
    ("lr-nan", ["--lr", "nan"], 2, ["train.lr=nan is not a finite number; give a finite number such as the default, "
                                    "lr=0.003"]),
    ("lr-inf", ["--lr", "inf"], 2, ["train.lr=inf is not a finite number"]),
    ("lr-negative", ["--lr", "-1"], 2, ["train.lr=-1.0 must be at least 0"]),
    ("weight-decay-nan", ["--weight-decay", "nan"], 2, ["train.weight_decay=nan is not a finite number"]),
]


@pytest.mark.parametrize("flags, status, says", [case[1:] for case in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES])
def test_each_bad_input_to_the_trainer_is_one_line_with_the_fix(inputs, capsys, flags, status, says):
    line = _one_line(capsys, TINY_RUN + [flag.replace("INPUTS", str(inputs)) for flag in flags], status)
    for part in says:
        assert part.replace("INPUTS", str(inputs)) in line, line


@pytest.mark.parametrize("dp", [1, 2])
def test_backend_nccl_without_the_gpus_is_refused_before_any_rank_starts(capsys, dp):
    if torch.cuda.is_available() and torch.cuda.device_count() >= dp:
        pytest.skip(f"this machine has {dp} GPU(s): --backend nccl works")
    line = _one_line(capsys, ["--dp", str(dp), "--steps", "1", "--backend", "nccl"], 2)
    assert line.startswith(f"backend='nccl' (--backend nccl) needs one GPU per rank, {dp} here, but ")
    assert line.endswith(f"use --backend gloo (or auto) to run the ranks as CPU processes, or run on a machine "
                         f"with {dp} GPU{'s' if dp > 1 else ''}")


def test_an_error_on_a_rank_is_one_line_from_the_real_command_line(inputs):
    """Two ranks, both refusing a micro-batch larger than the data: the rank's own message, not its traceback."""
    result = subprocess.run([sys.executable, "-m", "picotron.train", "--dp", "2", "--steps", "1", "--dataset",
                             str(inputs / "small.txt"), "--micro-batch-size", "4"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[1] == HINT, result.stderr
    said = re.fullmatch(f"{re.escape(ERROR)}rank [01]: (.*)", lines[0])
    assert said and "Traceback" not in result.stderr, result.stderr
    assert said.group(1) == ("a global micro-batch of dp_size * micro_batch_size = 2 * 4 windows, but "
                                          "the dataset has only 4 windows of seq_len = 64 tokens; use more text, a "
                                          "smaller seq_len (--seq-len) or micro_batch_size at most 2 "
                                          "(--micro-batch-size)")


def test_traceback_flag_shows_the_ranks_traceback(inputs, capsys):
    """--traceback lets the error through: launch.run's message (with the rank's traceback), and the same
    pieces as attributes."""
    with pytest.raises(ValueError) as info:
        main(["--dp", "2", "--steps", "1", "--dataset", str(inputs / "small.txt"), "--micro-batch-size", "4",
              "--traceback"])
    error = info.value
    assert error.rank in (0, 1) and error.rank_message.startswith("a global micro-batch of dp_size")
    assert "Traceback (most recent call last)" in error.rank_traceback and "data.py" in error.rank_traceback
    assert str(error) == (f"rank {error.rank} raised ValueError: {error.rank_message}\n\n"
                          f"--- traceback of rank {error.rank} ---\n{error.rank_traceback}")
    assert "error:" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="train.lr=nan is not a finite number"):   # bad input too
        main(TINY_RUN + ["--lr", "nan", "--traceback"])


def _raising(error: BaseException):
    def fake_train(config, progress=True):
        raise error
    return fake_train


@pytest.mark.parametrize("error, line", [
    (KeyError("layers.9.weight"), "KeyError: 'layers.9.weight'"),        # a bug names its type
    (RuntimeError("NCCL error: unhandled system error\nframe #0: ...\nframe #1: ..."),
     "RuntimeError: NCCL error: unhandled system error"),                # a C++ error's first line only
    (AssertionError(), "AssertionError"),
    (ValueError("seq_len=7 does not divide ...; pick another"), "seq_len=7 does not divide ...; pick another"),
])
def test_any_error_while_training_is_one_line(monkeypatch, capsys, error, line):
    monkeypatch.setattr(train_module, "train", _raising(error))
    assert _one_line(capsys, TINY_RUN, 1) == line


def test_ctrl_c_stops_quietly(monkeypatch, capsys):
    monkeypatch.setattr(train_module, "train", _raising(KeyboardInterrupt()))
    try:
        main(TINY_RUN)
    except KeyboardInterrupt:   # (not let through: pytest would take it for its own Ctrl-C and stop)
        pytest.fail("Ctrl-C came out of main() as a KeyboardInterrupt, which Python prints with its traceback")
    except SystemExit as stop:
        assert stop.code == 130 and capsys.readouterr().err == ""
    else:
        pytest.fail("main() returned after Ctrl-C")
    with pytest.raises(KeyboardInterrupt):
        main(TINY_RUN + ["--traceback"])


# ---- the course's command line -----------------------------------------------------------------------
@pytest.mark.parametrize("flag, example", [("--timeout-per-notebook", "--timeout-per-notebook 600"),
                                           ("--cell-timeout", "--cell-timeout 300")])
@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "abc"])
def test_grade_timeouts_must_be_positive(capsys, flag, example, value):
    """A typo must not score every check of a class "timeout": argparse refuses it, naming the flag."""
    with pytest.raises(SystemExit) as stop:
        course_main(["grade", "exercises/00_collectives.ipynb", flag, value])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == (f"python -m picotron_course grade: error: argument {flag}: {value!r} is not a "
                                    f"positive number of seconds; give one, e.g. {example}"
                                    + (", or leave the flag out for no limit" if flag == "--timeout-per-notebook"
                                       else ""))


def test_grade_functions_refuse_bad_timeouts_before_any_kernel(tmp_path):
    for call in (lambda: grade(tmp_path / "x.ipynb", cell_timeout=0),
                 lambda: grade(tmp_path / "x.ipynb", notebook_timeout=-5),
                 lambda: grade_folder(tmp_path, tmp_path / "grades.csv", notebook_timeout=math.nan)):
        with pytest.raises(GradeError, match="must be a positive number of seconds"):
            call()
    assert not (tmp_path / "grades.csv").exists()


def test_course_command_line_errors_are_one_line(tmp_path, capsys):
    """generate, check, strip and grade: a missing file or folder, a file that is not a notebook."""
    (tmp_path / "junk.ipynb").write_text("not json")
    (tmp_path / "empty").mkdir()
    cases = [(["generate", "--root", str(tmp_path / "nowhere")], "no solutions/ folder under"),
             (["generate", "98_nope", "--root", str(tmp_path / "empty")], "no solutions/ folder under"),
             (["check", "--root", str(tmp_path / "nowhere")], "no solutions/ folder under"),
             (["strip", str(tmp_path / "nope.ipynb")], "no such notebook: "),
             (["strip", str(tmp_path / "junk.ipynb")], "cannot read " + str(tmp_path / "junk.ipynb") + " as a "
                                                       "notebook (NotJSONError: "),
             (["grade", str(tmp_path / "nope.ipynb")], "no such notebook or folder"),
             (["grade", str(tmp_path / "empty")], "no notebooks in"),
             (["grade", str(tmp_path / "junk.ipynb"), "--assignment", "98_nope"], "unknown assignment '98_nope'")]
    for argv, says in cases:
        assert course_main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert says in out and len(out.strip().splitlines()) == 1 and err == "", (argv, out, err)
    assert not (tmp_path / "empty" / "exercises").exists()    # generate stopped before writing anything


# ---- picotron.launch.run's arguments ----------------------------------------------------------------
def _noop():
    return 0


# (name, a call of run, the error it must raise, what the message must say)
RUN_CASES = [
    ("fn-not-callable", lambda: run(42, 2), TypeError,
     r"fn=42 \(int\) is not callable; pass the function every rank calls, by its name without parentheses"),
    ("fn-called-not-passed", lambda: run(_noop(), 2), TypeError, r"fn=0 \(int\) is not callable"),
    ("world-size-0", lambda: run(_noop, 0), ValueError, r"world_size=0 must be a whole number of ranks, at least 1"),
    ("world-size-float", lambda: run(_noop, 2.0), ValueError, r"world_size=2.0 must be a whole number of ranks"),
    ("world-size-bool", lambda: run(_noop, True), ValueError, r"world_size=True must be a whole number of ranks"),
    ("timeout-0", lambda: run(_noop, 2, timeout=0), ValueError, r"timeout=0 must be a positive number of seconds"),
    ("timeout-negative", lambda: run(_noop, 2, timeout=-1), ValueError, r"timeout=-1 must be a positive number"),
    ("timeout-nan", lambda: run(_noop, 2, timeout=math.nan), ValueError, r"timeout=nan must be a positive number"),
    ("timeout-text", lambda: run(_noop, 2, timeout="60"), ValueError, r"timeout='60' must be a positive number"),
    ("args-not-a-tuple", lambda: run(_noop, 2, args=5), TypeError, r"args=5 must be a tuple of fn's positional"),
    ("kwargs-not-a-dict", lambda: run(_noop, 2, kwargs=[1]), TypeError, r"kwargs=\[1\] must be a dict of fn's"),
    ("seed-not-whole", lambda: run(_noop, 2, seed=0.5), ValueError, r"seed=0.5 must be a whole number"),
    ("backend-unknown", lambda: run(_noop, 2, backend="mpi"), ValueError, r"backend='mpi'; choose 'auto', 'gloo'"),
]


@pytest.mark.parametrize("call, error, message", [case[1:] for case in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_run_refuses_arguments_that_cannot_work_before_any_rank_starts(monkeypatch, call, error, message):
    def no_server():
        raise AssertionError("run() asked for its rank server: a rank would have started")
    monkeypatch.setattr(launch, "_server", no_server)
    with pytest.raises(error, match=message):
        call()


# ---- the Hugging Face loader, the config, the data ------------------------------------------------------
def test_hugging_face_folder_errors_name_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.safetensors").write_bytes(b"")
    for path, says in [(tmp_path / "nope", "does not exist"), (tmp_path / "empty", "has no config.json"),
                       (tmp_path / "file.safetensors", "is a file")]:
        with pytest.raises(FileNotFoundError) as info:
            load_hf_llama(path)
        assert str(info.value) == (f"{path} {says}: point to a Hugging Face checkpoint folder, the one holding "
                                   f"config.json and model.safetensors (e.g. what "
                                   f"huggingface_hub.snapshot_download returns)")
    (tmp_path / "empty" / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON \(.* at line 1, column 24\); download it"):
        load_hf_llama(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(ValueError, match=r"config\.json lacks vocab_size, intermediate_size, num_hidden_layers, "
                                         r"num_attention_heads: it is not a complete Llama config"):
        load_hf_llama(tmp_path / "empty")


def test_non_finite_numbers_in_a_config_file_are_refused(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"train": {"lr": NaN}}')          # Python's json reads NaN and Infinity
    with pytest.raises(ValueError, match=re.escape(f"{path}: train.lr=nan is not a finite number")):
        Config.from_json(path)
    path.write_text('{"train": {"betas": [0.9, Infinity]}}')
    with pytest.raises(ValueError, match=re.escape(f"{path}: train.betas=[0.9, inf] holds a number that is not "
                                                   f"finite; give a finite number such as the default, "
                                                   f"betas=(0.9, 0.95)")):
        Config.from_json(path)


def test_text_that_is_not_utf8_names_the_file(inputs):
    with pytest.raises(ValueError, match=re.escape(f"{inputs / 'latin1.txt'} is not UTF-8 text (byte 3 is 0xe9)")):
        load_text(inputs / "latin1.txt")


def test_run_without_fork_says_to_use_wsl(monkeypatch):
    """Native Windows has no os.fork, which the rank server needs: one clear error, before anything starts."""
    monkeypatch.delattr(launch.os, "fork")
    with pytest.raises(RuntimeError, match=r"this Python has no os\.fork \(Windows\): run the course in WSL"):
        run(lambda: 0, 2)
