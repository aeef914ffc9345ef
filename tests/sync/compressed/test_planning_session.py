"""The planned syncs' phases as types: the session's transitions and the trial's turns, without a cluster."""

from ddlscale.sync.compressed.session import Phase, PlanningSession, Trial


def _plan(label):
    return {"system": "espresso", "context": {"candidate": label}}


def _session(**steps):
    counts = {"warmup_steps": 1, "profile_steps": 2, "settle_steps": 1, "calibrate_steps": 2, "trial_steps": 2}
    return PlanningSession(**{**counts, **steps})


def test_dense_steps_warm_up_then_profile():
    session = _session()
    assert session.phase is Phase.WARMUP and session.phase.dense and session.label == "warmup"
    done = []
    for _ in range(3):
        session.recorder.steps.append({})  # what StepRecorder.step_end appends
        done.append(session.profiled())
        assert session.phase is Phase.PROFILE
    assert done == [False, False, True]


def test_calibration_settles_then_measures():
    session = _session(settle_steps=2, calibrate_steps=2)
    session.start_calibration()
    phases, settling, done = [session.phase], [], []
    for t in range(4):
        done.append(session.calibration_step(float(t)))
        settling.append(session.settling())
        phases.append(session.phase)
    assert phases == [Phase.SETTLE, Phase.SETTLE, Phase.CALIBRATE, Phase.CALIBRATE, Phase.CALIBRATE]
    assert settling == [True, True, False, False] and done == [False, False, False, True]
    # The last settling step's end starts the first measured period.
    assert session.calibration_periods() == [1.0, 1.0] and session.calibration_periods() == []


def test_calibration_spans_run_from_the_previous_steps_end_to_backward_end_in_measured_steps():
    session = _session(settle_steps=2, calibrate_steps=2)
    session.start_calibration()
    for t in range(4):  # step t ends at 10 t; its backward ended 3 s earlier (7 s after the previous end)
        session.calibration_step(10.0 * t, 10.0 * t - 3.0)
    assert session.calibration_spans == [7.0, 7.0]  # the settling steps' spans are not kept
    session.start_calibration()
    assert session.calibration_spans == []


def test_a_trial_takes_turns_of_a_settling_and_a_measured_step():
    session = _session(trial_steps=2)
    session.trial = Trial.of([_plan("a"), _plan("b")])
    session.adopted()
    labels, ended = [session.label], []
    for t in range(8):
        ended.append(session.trial_step(float(t)))
        labels.append(session.label)
    assert labels == ["trial settle: a", "trial: a", "trial settle: b", "trial: b", "trial settle: a", "trial: a",
                      "trial settle: b", "trial: b", "trial settle: b"]
    assert ended == [False, True] * 4 and session.trial.over(2)
    assert session.trial.periods == [[1.0, 1.0], [1.0, 1.0]] and session.trial.medians() == [1.0, 1.0]
    session.trial = None
    session.adopted()
    assert session.phase is Phase.PLAN and session.label == "plan"


def test_a_trial_resumed_from_its_state_settles_again_on_its_candidate():
    trial = Trial.of([_plan("a"), _plan("b")])
    for t in range(3):
        trial.step(float(t), 2)
    state = trial.state()
    assert state == {"plans": [_plan("a"), _plan("b")], "index": 1, "turn": 1, "periods": [[1.0], []], "seen": 1,
                     "last_end": None}
    again = Trial.resumed(state)
    assert (again.index, again.turn, again.seen, again.last_end, again.periods) == (1, 1, 0, None, [[1.0], []])
    older = {key: value for key, value in state.items() if key != "turn"}  # saved before turns were counted
    assert Trial.resumed(older).turn == 1
