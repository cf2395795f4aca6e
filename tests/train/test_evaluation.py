"""The Evaluation callback (megatok.train.evaluation) on its own, in this process, over the real engine,
metrics logger and checkpointer: when it evaluates, and the evaluation a stop leaves pending, which the
checkpoint records and the resumed run does first, once. (The whole path through the trainer:
tests/train/test_reliability.py, test_an_evaluation_skipped_by_a_stop_runs_when_the_run_resumes.)"""

from megatok.data.encoding import encoding_for
from megatok.dsconfig import deepspeed_config
from megatok.metrics import MetricsLogger, read_metrics
from megatok.run.checkpoints import read_meta
from megatok.train.checkpointer import Checkpointer
from megatok.train.evaluation import Evaluation
from megatok.train.metrics import TrainMetrics
from tests.train.conftest import tiny_config, tiny_engine


class Run:
    """What the callback reads of the Trainer, from the real pieces: the Engine, the metrics logger,
    TrainMetrics, the Checkpointer and the start it chose; the step, whether the run is stopping, and
    what the trainer was told comes next (``doing``)."""

    def __init__(self, cfg, device, run_dir=None):
        self.rank, self.step, self.stopping, self.doing = 0, 0, False, []
        self.checkpointer = Checkpointer(cfg.train, 0)
        self.start = self.checkpointer.start(cfg, "auto", deepspeed_config(cfg, 1))
        self.engine, self.metrics = tiny_engine(cfg, device), TrainMetrics(cfg, device, 1)
        if self.start.tag:
            self.checkpointer.load(self.engine, self.start, restore_rng=True)
            self.step = self.start.step
        self.logger = MetricsLogger(run_dir or cfg.train.run_dir, enabled=True, total_steps=cfg.train.max_steps,
                                    wandb_mode="disabled", progress=False)

    def progress(self, doing, limit=None):
        self.doing.append(doing)

    def close(self):
        self.logger.close()
        self.checkpointer.release_lock()


def val_rows(run_dir):
    return [r for r in read_metrics(run_dir) if r["split"] == "val"]


def test_an_evaluation_a_stop_skips_is_pending_in_the_checkpoint_and_runs_first_when_resumed(single_rank, shards,
                                                                                          tmp_path):
    cfg = tiny_config(shards, tmp_path / "run", "eval.every=2", "train.max_steps=5")
    run, evaluation = Run(cfg, single_rank), Evaluation(cfg, 0, 1, encoding_for(cfg), single_rank)
    assert [step for step in range(1, 6) if evaluation.due(step)] == [2, 4, 5]  # every eval.every, and the last
    for run.step in (1, 2, 3):
        evaluation.on_step_end(run)
    assert [r["step"] for r in val_rows(run.logger.path.parent)] == [2] and run.doing == ["evaluating step 2"]
    assert run.engine.ds.module.training and run.metrics.t_paused > 0  # left training; not training time

    run.step, run.stopping = 4, True  # a stop at an evaluation step: the checkpoint records it as pending
    evaluation.on_step_end(run)
    assert evaluation.pending and evaluation.state_dict() == {"pending": True}
    tag = run.checkpointer.save(run.engine, 4, {"engine": run.engine.state_dict(),
                                                "evaluation": evaluation.state_dict()}, {})
    run.close()
    assert [r["step"] for r in val_rows(tmp_path / "run")] == [2]
    (tmp_path / "step-4").mkdir()
    stopped = Run(cfg, single_rank, tmp_path / "step-4")  # the checkpoint's weights: the row step 4 would have logged
    Evaluation(cfg, 0, 1, encoding_for(cfg), single_rank).on_step_end(stopped)
    stopped.close()

    for rerun in (1, 2):  # the resumed run evaluates step 4 first, once; a rerun of it does not again
        resumed, evaluation = Run(cfg, single_rank), Evaluation(cfg, 0, 1, encoding_for(cfg), single_rank)
        evaluation.load_state_dict(resumed.start.meta["evaluation"])
        assert evaluation.pending == (rerun == 1)
        evaluation.on_fit_start(resumed)
        resumed.close()
        assert read_meta(tmp_path / "run", tag)["evaluation"] == {"pending": False}
        assert resumed.doing == (["evaluating step 4 (left pending by the stop)"] if rerun == 1 else [])
    rows = val_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [2, 4]
    (want,) = val_rows(tmp_path / "step-4")
    assert {k: v for k, v in rows[1].items() if k != "time"} == {k: v for k, v in want.items() if k != "time"}
