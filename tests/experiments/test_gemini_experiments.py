"""The Gemini experiments' arithmetic: what a failure costs, read off a progress log, and the report."""

import pytest

from experiments import claims as c
from experiments import gemini_recovery, harness

# kill at t=10.0 during step 12 (steps every 0.5 s); the new worker launched at 13, set up at 17,
# resumed at step 10 at 18.0 after 0.25 s of retrieval; steps 11.. follow, step 12 again at 19.0
ROWS = [("launched", 0, 0.0, 0.0), ("setup", 0, 1.0, 0.0), ("start", 0, 2.0, 0.0),
        *[("step", s, 2.0 + 0.5 * s, 0.0) for s in range(1, 17)],  # step 16 at 10.0: killed just after
        ("launched", 0, 13.0, 0.0), ("setup", 0, 17.0, 0.0), ("resumed", 10, 18.0, 0.25),
        *[("step", s, 18.0 + 0.5 * (s - 10), 0.0) for s in range(11, 21)]]


@pytest.mark.multiprocess
def test_a_failure_splits_into_torchrun_startup_restore_retrieval_and_lost_progress():
    failure = gemini_recovery.split_failure(ROWS, t_kill=10.1)
    assert failure["step_at_kill"] == 16 and failure["resumed_step"] == 10 and failure["lost_steps"] == 6
    assert failure["torchrun_s"] == pytest.approx(2.9) and failure["startup_s"] == pytest.approx(4.0)
    assert failure["restore_s"] == pytest.approx(0.75) and failure["retrieve_s"] == 0.25
    assert failure["restart_s"] == pytest.approx(2.9 + 4.0 + 0.75)
    assert failure["lost_progress_s"] == pytest.approx(3.0)  # step 16 again at 21.0
    assert failure["wasted_s"] == pytest.approx(21.0 - 10.1)


def test_iteration_time_counts_new_progress_only_stalls_included():
    times = gemini_recovery.iteration_times(ROWS)
    # steps 2..16 before the kill (step 1 is the first after the start), then 17..20: replays excluded
    assert len(times) == 15 + 4 and all(t == pytest.approx(0.5) for t in times)
    stalled = [("start", 0, 0.0, 0.0), ("step", 1, 1.0, 0.0), ("step", 2, 1.5, 0.0), ("step", 3, 5.0, 0.0),
               ("step", 4, 5.5, 0.0)]
    assert gemini_recovery.iteration_times(stalled) == [0.5, 3.5, 0.5]  # a checkpoint stall counts


def test_the_next_failure_waits_until_the_previous_ones_lost_progress_is_made_up():
    assert not gemini_recovery.ready_for_failure(ROWS[:5], failure=0, warmup_steps=3)  # 2 steps since the start
    assert gemini_recovery.ready_for_failure(ROWS[:6], failure=0, warmup_steps=3)
    restarted = ROWS[:-10] + ROWS[-10:-4]  # resumed at 10 after step 16, now at step 16 again
    assert not gemini_recovery.ready_for_failure(restarted, failure=1, warmup_steps=3)  # still replaying
    assert gemini_recovery.ready_for_failure(ROWS, failure=1, warmup_steps=3)  # step 17 on: new progress
    assert not gemini_recovery.ready_for_failure(ROWS, failure=2, warmup_steps=3)  # no third start yet


@pytest.mark.multiprocess
def test_the_report_adds_overhead_between_failures_and_judges_the_targets(tmp_path, monkeypatch):
    """Gemini 1% slower than none, HighFreq 40%: at 1.5% failures per machine-day the overhead paid
    between failures dominates both totals."""
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    monkeypatch.setattr(gemini_recovery, "import_seconds", lambda n: [1.0, 1.0, 1.0])
    iteration = {"none": 0.300, "gemini": 0.303, "highfreq": 0.420, "strawman": 0.310}
    waste = {"gemini": 10.0, "highfreq": 12.0, "strawman": 20.0}

    def run(strategy, args, rng, keep):
        assert args.k == 2
        failures = [] if strategy == "none" else [
            {"step_at_kill": 20, "resumed_step": 19, "lost_steps": 1, "restart_s": 9.0, "torchrun_s": 2.0,
             "startup_s": 6.5, "restore_s": 0.5, "retrieve_s": 0.1, "lost_progress_s": waste[strategy] - 9.1,
             "wasted_s": waste[strategy]}] * 2
        return failures, [iteration[strategy]] * 50, [0.060] * 25

    monkeypatch.setattr(gemini_recovery, "run_strategy", run)
    gemini_recovery.main(["--reps", "2", "--dilation", "2"])
    report = (tmp_path / "gemini_recovery" / "results.md").read_text()
    mtbf16 = 86400 / (16 * 0.015)
    gemini16 = 10.0 + mtbf16 * (1 - 0.300 / 0.303)
    highfreq16 = 12.0 + mtbf16 * (1 - 0.300 / 0.420)
    assert f"{gemini16:.4g}" in report and f"{highfreq16:.4g}" in report
    assert "Gemini overhead <= 2%: 1.00%;" in report
    assert "--dilation 2`" in report and "**Dilation:** 2 " in report  # the command and the header say k
    assert "took 0.5 s (median of 0.5, 0.5, 0.5) here (host seconds / k, k = 2)" in report
    assert f"16 machines {highfreq16 / gemini16:.1f}x" in report
    assert c.folder_problems(tmp_path / "gemini_recovery") == []  # its run kept, no verdict outside the Runs
    assert (tmp_path / "gemini_recovery" / "iterations.csv").exists()
    # none's 300 ms step: 200 ms device time (the default), 60 ms communication wait, so 40 ms of CPU work.
    assert "the network, measured: its step of 300 ms waited 60 ms for communication against 40 ms" in report


def test_sync_seconds_reads_rank0s_second_half(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,sync_time_s,loss\n1,0.9,\n2,,1.0\n3,0.05,\n4,0.07,\n")
    assert gemini_recovery.sync_seconds(tmp_path, steps=4) == [0.05, 0.07]
    assert gemini_recovery.sync_seconds(tmp_path / "absent", steps=4) == []
