"""benchmarks/train_sweep.py: one row per configuration, through the real trainer, with MFU and HFU apart
exactly when something is recomputed."""

import importlib.util
import pathlib

import pytest

SWEEP = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "train_sweep.py"


def load_sweep():
    spec = importlib.util.spec_from_file_location("train_sweep", SWEEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sweep_of_the_tiny_model_on_the_cpu(tmp_path):
    sweep = load_sweep()
    results = sweep.main(["--preset", "tiny", "--seq-len", "32", "--micro-batch-sizes", "2",
                          "--recompute", "none,full", "--steps", "3", "--json", str(tmp_path / "out.json")])
    rows = results["rows"]
    assert [(row["micro_batch_size"], row["recompute"]) for row in rows] == [(2, "none"), (2, "full")]
    for row in rows:
        assert row["status"] == "ok" and row["tokens_per_s"] > 0 and 0 < row["mfu"]
        # the same tokens/s over the same peak: HFU exceeds MFU by the recomputed FLOPs, and only then
        assert (row["hfu"] > row["mfu"]) == (row["recompute"] != "none")
        assert row["tokens_per_s"] == pytest.approx(2 * 32 / row["step_s"])
    assert results["best"] in rows
    assert (tmp_path / "out.json").exists()


def test_sweep_refuses_steps_that_leave_nothing_to_time():
    with pytest.raises(SystemExit):
        load_sweep().main(["--steps", "2", "--warmup", "2"])
