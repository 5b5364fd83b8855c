"""dcinterp.train's runs for a study: a run stopped and resumed is bit for bit the run that never stopped, checkpoints
are written whole, `--resume` refuses in one line what it cannot continue, and `--seeds` puts each seed's twins in
their own folder."""

import dataclasses
import json
import os
import random
import signal

import numpy as np
import pytest
import torch

import dcinterp.train as train_module
from dcinterp.train import (
    CHECKPOINT_FILE,
    CheckpointEvery,
    ResumeError,
    RunInterrupted,
    TrainConfig,
    save_checkpoint,
    stop_requests,
    train,
)
from dcinterp.train.__main__ import main, parse_seeds

# Small enough for seconds, and every piece of state in play: chunks of 3 samples (one per task) drawn across
# batches of 4, length buckets of 2 batches (a stop can fall with a bucket half used), the compact-facts share
# drawn from the data's generator, a focus phase, and the DCMHA compose held still for the first half.
STATEFUL = TrainConfig(
    arch="dcmha",
    steps=8,
    seed=3,
    n_layers=2,
    d_model=32,
    n_heads=2,
    d_head=16,
    d_mlp=64,
    window_size=8,
    window_type="LG",
    batch_size=4,
    samples_per_task=1,
    tasks=("task10", "task11", "task57"),
    focus_tasks=("task10",),
    focus_until=0.25,
    compact_until=0.5,
    compose_from=0.5,
    bucket_batches=2,
    log_every=1,
)


def without_times(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in entry.items() if k != "elapsed_s"} for entry in history]


def scramble_global_random_states() -> None:
    """As a fresh process would have them: the resumed run must not rely on what the stopped one left behind."""
    torch.manual_seed(12345)
    random.seed(678)
    np.random.seed(9)


def assert_same_run(model, recipe, reference_model, reference_recipe) -> None:
    for (name, a), (_, b) in zip(model.state_dict().items(), reference_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert without_times(recipe["history"]) == without_times(reference_recipe["history"])  # loss, lr, tokens per step
    for key in ("steps", "tokens_seen", "final_loss", "final_answer_loss", "first_loss", "data"):
        assert recipe[key] == reference_recipe[key], key


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    out = tmp_path_factory.mktemp("never_stopped")
    model, recipe = train(STATEFUL, out_dir=out, progress=False, evaluate_after=False, log_file=out / "log.jsonl")
    assert not (out / CHECKPOINT_FILE).exists()  # a finished run removes its checkpoint
    recipe["log"] = (out / "log.jsonl").read_text()
    return model, recipe


def logged(text: str) -> list[dict]:
    return without_times([json.loads(line) for line in text.splitlines()])


def test_a_run_stopped_twice_and_resumed_is_the_run_that_never_stopped(tmp_path, never_stopped):
    log = tmp_path / "log.jsonl"
    _, stopped = train(STATEFUL, out_dir=tmp_path, progress=False, evaluate_after=False, stop_after=3, log_file=log)
    assert stopped["stopped_early"] and stopped["steps"] == 3 and (tmp_path / CHECKPOINT_FILE).exists()
    assert "accuracy" not in stopped and json.loads((tmp_path / "recipe.json").read_text())["steps"] == 3
    scramble_global_random_states()
    _, again = train(
        STATEFUL, out_dir=tmp_path, progress=False, evaluate_after=False, resume=True, stop_after=5, log_file=log
    )
    assert again["steps"] == 5 and again["resumed_at"] == [3]
    scramble_global_random_states()
    model, recipe = train(STATEFUL, out_dir=tmp_path, progress=False, evaluate_after=False, resume=True, log_file=log)
    assert recipe["resumed_at"] == [3, 5] and not recipe["stopped_early"]
    assert logged(log.read_text()) == logged(never_stopped[1]["log"])
    assert not (tmp_path / CHECKPOINT_FILE).exists()
    assert_same_run(model, recipe, *never_stopped)
    assert recipe["steps"] == 8 and len(recipe["history"]) == 8


def test_a_run_killed_between_checkpoints_resumes_from_the_last_one(tmp_path, monkeypatch, never_stopped):
    """max_minutes stops a run (with a checkpoint); continued with a checkpoint every 2 steps, it dies in step 6:
    the checkpoint of step 4 is on disk, and the run resumed from it is the run that never stopped."""
    cfg = dataclasses.replace(STATEFUL, max_minutes=1e-9)  # a run setting: it may change when the run continues
    _, recipe = train(cfg, out_dir=tmp_path, progress=False, evaluate_after=False)
    assert recipe["stopped_by"].endswith("(max_minutes)") and recipe["steps"] == 1
    draw, calls = train_module.Batcher.__next__, []

    def dies_at_the_fifth_draw(self):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("killed")
        return draw(self)

    monkeypatch.setattr(train_module.Batcher, "__next__", dies_at_the_fifth_draw)
    log = tmp_path / "log.jsonl"
    with pytest.raises(RuntimeError, match="killed"):
        train(
            STATEFUL,
            out_dir=tmp_path,
            progress=False,
            evaluate_after=False,
            checkpoint_every="2",
            resume=True,
            log_file=log,
        )
    monkeypatch.setattr(train_module.Batcher, "__next__", draw)
    assert torch.load(tmp_path / CHECKPOINT_FILE, weights_only=True)["progress"]["step"] == 4
    assert len(log.read_text().splitlines()) == 5  # step 5 was logged, and is lost with the process
    model, recipe = train(STATEFUL, out_dir=tmp_path, progress=False, evaluate_after=False, resume=True, log_file=log)
    assert logged(log.read_text()) == logged(never_stopped[1]["log"])  # the log without step 5 twice
    assert recipe["resumed_at"] == [1, 4]
    assert_same_run(model, recipe, *never_stopped)


def test_a_signal_stops_after_the_step_under_way_with_a_checkpoint(tmp_path, monkeypatch, never_stopped):
    draw = train_module.Batcher.__next__
    calls = []

    def draw_then_signal(self):
        calls.append(1)
        if len(calls) == 4:  # SIGTERM arrives during step 4
            os.kill(os.getpid(), signal.SIGTERM)
        return draw(self)

    monkeypatch.setattr(train_module.Batcher, "__next__", draw_then_signal)
    with pytest.raises(RunInterrupted, match=r"stopped by SIGTERM at step 4 of 8; checkpoint .*--resume"):
        train(STATEFUL, out_dir=tmp_path, progress=False, evaluate_after=False)
    monkeypatch.setattr(train_module.Batcher, "__next__", draw)
    assert torch.load(tmp_path / CHECKPOINT_FILE, weights_only=True)["progress"]["step"] == 4
    model, recipe = train(STATEFUL, out_dir=tmp_path, progress=False, evaluate_after=False, resume=True)
    assert_same_run(model, recipe, *never_stopped)


def test_stop_requests_restores_the_signal_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with stop_requests() as requested:
        os.kill(os.getpid(), signal.SIGTERM)
        assert requested == ["SIGTERM"]
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_checkpoint_is_never_half_written(tmp_path, monkeypatch):
    path = tmp_path / CHECKPOINT_FILE
    save_checkpoint(path, {"step": 1})

    def dies_midway(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(OSError):
        save_checkpoint(path, {"step": 2})
    assert torch.load(path, weights_only=True) == {"step": 1}  # the last whole checkpoint is still there


def test_checkpoint_every_takes_steps_or_a_time():
    assert CheckpointEvery.parse("500") == CheckpointEvery(steps=500)
    assert CheckpointEvery.parse("300s") == CheckpointEvery(seconds=300)
    assert CheckpointEvery.parse("5m") == CheckpointEvery(seconds=300)
    assert CheckpointEvery.parse("1.5h") == CheckpointEvery(seconds=5400)
    assert CheckpointEvery(steps=2).due(4, 0.0) and not CheckpointEvery(steps=2).due(5, 1e6)
    assert CheckpointEvery(seconds=60).due(1, 60.0) and not CheckpointEvery(seconds=60).due(1000, 59.0)
    for bad in ("0", "-5", "5x", "m", "", "1e3"):
        with pytest.raises(ValueError, match="--checkpoint-every"):
            CheckpointEvery.parse(bad)


def test_seeds_are_ranges_and_lists():
    assert parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert parse_seeds("0,2,5") == [0, 2, 5]
    assert parse_seeds("0-2,7") == [0, 1, 2, 7]
    for bad in ("4-1", "a", "0,0", "1-", "-1", ""):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


TINY_CLI = ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--d-head", "8", "--d-mlp", "32", "--tasks", "20"]
TINY_CLI += ["--steps", "4", "--no-eval", "--quiet"]


def one_line_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m dcinterp.train: error:") and len(err.splitlines()) == 1, err
    return err


def test_resume_without_a_checkpoint_names_the_file(capsys, tmp_path):
    err = one_line_error(capsys, [*TINY_CLI, "--arch", "mha", "--out", str(tmp_path), "--resume"])
    assert f"no checkpoint at {tmp_path / 'pythia-synth' / CHECKPOINT_FILE}" in err
    err = one_line_error(capsys, [*TINY_CLI, "--seeds", "0-2", "--out", str(tmp_path), "--resume"])
    assert "none of the 6 runs has a checkpoint" in err and str(tmp_path / "seed0" / "dcpythia-synth") in err
    with pytest.raises(ResumeError, match="no output directory"):
        train(STATEFUL, resume=True)


def test_resume_of_another_recipe_names_the_file_and_the_setting(capsys, tmp_path):
    main([*TINY_CLI, "--arch", "mha", "--out", str(tmp_path), "--stop-after", "2"])
    checkpoint = tmp_path / "pythia-synth" / CHECKPOINT_FILE
    assert checkpoint.exists()
    err = one_line_error(capsys, [*TINY_CLI, "--arch", "mha", "--out", str(tmp_path), "--resume", "--lr", "1e-3"])
    assert str(checkpoint) in err and "lr=0.003" in err and "lr=0.001" in err
    err = one_line_error(capsys, [*TINY_CLI, "--arch", "mha", "--out", str(tmp_path)])  # would start over it
    assert str(checkpoint) in err and "--resume continues it" in err
    checkpoint.write_bytes(b"not a checkpoint")
    err = one_line_error(capsys, [*TINY_CLI, "--arch", "mha", "--out", str(tmp_path), "--resume"])
    assert f"{checkpoint} is not a readable checkpoint" in err
    torch.save({"step": 2}, checkpoint)
    err = one_line_error(capsys, [*TINY_CLI, "--arch", "mha", "--out", str(tmp_path), "--resume"])
    assert f"{checkpoint} is not a dcinterp.train checkpoint" in err
    checkpoint.unlink()  # left: the recipe.json of the stopped run; --resume does not start over another run's
    err = one_line_error(capsys, [*TINY_CLI, "--arch", "mha", "--out", str(tmp_path), "--resume", "--lr", "1e-3"])
    assert f"{tmp_path / 'pythia-synth' / 'recipe.json'} is another run's: it was written with lr=0.003" in err


def test_seeds_put_each_pair_of_twins_in_its_own_folder_and_resume_continues_the_sweep(capsys, tmp_path):
    main([*TINY_CLI, "--seeds", "0,2", "--out", str(tmp_path), "--stop-after", "2", "--compose-from", "1.0"])
    capsys.readouterr()
    for seed in (0, 2):
        for name in ("dcpythia-synth", "pythia-synth"):
            recipe = json.loads((tmp_path / f"seed{seed}" / name / "recipe.json").read_text())
            assert recipe["seed"] == seed and recipe["steps"] == 2 and recipe["stopped_early"]
    (tmp_path / "seed2" / "dcpythia-synth" / CHECKPOINT_FILE).unlink()  # as if seed 2's DCMHA run never began
    (tmp_path / "seed2" / "dcpythia-synth" / "recipe.json").unlink()
    main([*TINY_CLI, "--seeds", "0,2", "--out", str(tmp_path), "--compose-from", "1.0", "--resume"])
    recipes = {
        (seed, name): json.loads((tmp_path / f"seed{seed}" / name / "recipe.json").read_text())
        for seed in (0, 2)
        for name in ("dcpythia-synth", "pythia-synth")
    }
    assert {key: (r["steps"], r["resumed_at"]) for key, r in recipes.items()} == {
        (0, "dcpythia-synth"): (4, [2]),
        (0, "pythia-synth"): (4, [2]),
        (2, "dcpythia-synth"): (4, []),
        (2, "pythia-synth"): (4, [2]),
    }
    # paired twins: the compose held at the identity throughout, so a seed's twins learn the same losses
    for seed in (0, 2):
        losses = [[h["loss"] for h in recipes[seed, name]["history"]] for name in ("dcpythia-synth", "pythia-synth")]
        assert losses[0] == losses[1]
    assert recipes[0, "pythia-synth"]["history"] != recipes[2, "pythia-synth"]["history"]
    main([*TINY_CLI, "--seeds", "0,2", "--out", str(tmp_path), "--compose-from", "1.0", "--resume"])
    assert capsys.readouterr().err.count("finished already, skipped") == 4


# --------------------------------------------------------------------------------------------------
# Shared starts (--start-from): a seed's twins are one model until the compose trains, and the held-out variants
# are that model until the focus phase ends
def quiet_train(cfg, out_dir, **options):
    """One run of the tests below: no progress bar, no evaluation, written to `out_dir`."""
    return train(cfg, out_dir=out_dir, progress=False, evaluate_after=False, **options)


def test_a_dcmha_run_begun_from_its_mha_twins_start_is_the_run_begun_at_step_0(tmp_path, never_stopped):
    start = tmp_path / "start"
    mha = dataclasses.replace(STATEFUL, arch="mha")
    _, stopped = quiet_train(mha, start, stop_after=4)  # compose_from: 4
    scramble_global_random_states()
    model, recipe = quiet_train(STATEFUL, tmp_path / "dcmha", start_from=start / CHECKPOINT_FILE)
    assert_same_run(model, recipe, *never_stopped)
    assert recipe["started_from"] == {
        "path": str(start / CHECKPOINT_FILE),
        "step": 4,
        "answer_loss": pytest.approx(sum(h["answer_loss"] for h in stopped["history"]) / 4, abs=1e-4),
    }
    # one step later the compose has trained in the DCMHA run: its twin's checkpoint is no longer its beginning
    quiet_train(mha, tmp_path / "late", stop_after=5)
    with pytest.raises(ResumeError, match=r"late/checkpoint.pt is at step 5, after the compose began to train"):
        quiet_train(STATEFUL, tmp_path / "x", start_from=tmp_path / "late" / CHECKPOINT_FILE)


def test_a_held_out_variant_begun_from_the_full_runs_start_is_the_run_begun_at_step_0(tmp_path):
    full = dataclasses.replace(STATEFUL, arch="mha", tasks=("task2", "task10", "task11", "task57"))
    held = dataclasses.replace(full, exclude_combos=("same-person:superclass",))  # task2: not trained after focus
    reference_model, reference = quiet_train(held, tmp_path / "ref")
    quiet_train(full, tmp_path / "start", stop_after=2)  # focus_until: 2
    model, recipe = quiet_train(held, tmp_path / "held", start_from=tmp_path / "start" / CHECKPOINT_FILE)
    assert_same_run(model, recipe, reference_model, reference)
    other, _ = train(full, progress=False, evaluate_after=False)
    assert not torch.equal(other.W_E, model.W_E)  # the data after the focus phase differ: a test that can fail
    quiet_train(full, tmp_path / "late", stop_after=3)
    with pytest.raises(ResumeError, match=r"at step 3, after the focus phase \(step 2\)"):
        quiet_train(held, tmp_path / "x", start_from=tmp_path / "late" / CHECKPOINT_FILE)
    with pytest.raises(
        ResumeError, match=r"another recipe's checkpoint: it was written with lr=0.003, this run has lr=0.01"
    ):
        quiet_train(dataclasses.replace(held, lr=0.01), tmp_path / "y", start_from=tmp_path / "start" / CHECKPOINT_FILE)


def test_start_from_screens_out_the_seeds_whose_start_formed_no_lookup(capsys, tmp_path):
    starts, study = tmp_path / "starts", tmp_path / "study"
    common = [*TINY_CLI, "--compose-from", "0.5", "--seeds", "0,1"]
    main([*common, "--arch", "mha", "--out", str(starts), "--stop-after", "2"])
    capsys.readouterr()
    losses = {
        seed: train_module.start_answer_loss(torch.load(starts / f"seed{seed}" / "pythia-synth" / CHECKPOINT_FILE))
        for seed in (0, 1)
    }
    threshold = sum(losses.values()) / 2  # between the two seeds' answer losses: one is kept, one screened out
    kept, dropped = sorted(losses, key=losses.get)
    main([*common, "--out", str(study), "--start-from", str(starts), "--lookup-threshold", str(threshold)])
    err = capsys.readouterr().err
    assert f"seed{dropped}" in err and "screened out" in err
    screened = json.loads((study / f"seed{dropped}" / "screened_out.json").read_text())
    assert screened["answer_loss"] == losses[dropped] and screened["threshold"] == threshold
    assert not (study / f"seed{dropped}" / "pythia-synth").exists()
    for name in ("dcpythia-synth", "pythia-synth"):
        recipe = json.loads((study / f"seed{kept}" / name / "recipe.json").read_text())
        assert recipe["steps"] == 4 and recipe["started_from"]["step"] == 2
        assert recipe["started_from"]["answer_loss"] == losses[kept]
    err = one_line_error(capsys, [*common, "--out", str(tmp_path / "z"), "--start-from", str(tmp_path / "nowhere")])
    assert "no checkpoint in" in err and "seed0" in err
    err = one_line_error(capsys, [*common, "--out", str(tmp_path / "z"), "--lookup-threshold", "0.5"])
    assert "--start-from" in err


# --------------------------------------------------------------------------------------------------
# Focus stages: task57 alone after the focus phase (steps 2 and 3), then all tasks
STAGED = dataclasses.replace(STATEFUL, focus_stages=("task57@0.5",))


@pytest.fixture(scope="module")
def staged_never_stopped(tmp_path_factory):
    out = tmp_path_factory.mktemp("staged_never_stopped")
    return quiet_train(STAGED, out)


def test_a_run_with_focus_stages_stopped_in_a_stage_and_resumed_is_the_run_that_never_stopped(
    tmp_path, never_stopped, staged_never_stopped
):
    assert not torch.equal(staged_never_stopped[0].W_E, never_stopped[0].W_E)  # the stage draws other data
    quiet_train(STAGED, tmp_path, stop_after=3)  # within the stage
    with pytest.raises(ResumeError, match=r"it was written with focus_stages=\['task57@0.5'\], this run has "):
        quiet_train(STATEFUL, tmp_path, resume=True)
    scramble_global_random_states()
    model, recipe = quiet_train(STAGED, tmp_path, resume=True)
    assert recipe["resumed_at"] == [3] and recipe["train_config"]["focus_stages"] == ["task57@0.5"]
    assert_same_run(model, recipe, *staged_never_stopped)


def test_a_run_with_focus_stages_begins_from_a_start_of_other_stages_only_before_they_draw_other_tasks(
    tmp_path, staged_never_stopped
):
    quiet_train(STATEFUL, tmp_path / "start", stop_after=2)  # focus_until: 2
    start = tmp_path / "start" / CHECKPOINT_FILE
    checkpoint = torch.load(start, weights_only=True)
    del checkpoint["train_config"]["focus_stages"]  # as a checkpoint written before focus stages were
    save_checkpoint(start, checkpoint)
    model, recipe = quiet_train(STAGED, tmp_path / "staged", start_from=start)
    assert_same_run(model, recipe, *staged_never_stopped)
    quiet_train(STATEFUL, tmp_path / "late", stop_after=3)
    with pytest.raises(
        ResumeError, match=r"at step 3, after its focus stages \[\] and this run's \['task57@0.5'\] draw other tasks"
    ):
        quiet_train(STAGED, tmp_path / "x", start_from=tmp_path / "late" / CHECKPOINT_FILE)


def test_a_wider_mlp_begun_from_a_start_begins_as_the_start(tmp_path):
    """A parameter-matched twin (an MLP wider than its start's, `--d-mlp`) takes the start's hidden units and weights
    the new ones by 0, so that it computes what its start did; then it trains them. A narrower MLP is refused."""
    from dcinterp import HookedDCFormer

    mha = dataclasses.replace(STATEFUL, arch="mha")
    start_model, _ = quiet_train(mha, tmp_path / "start", stop_after=4)
    start = tmp_path / "start" / CHECKPOINT_FILE

    def begin(cfg):  # as train() begins a run from a start, before its first step
        model = HookedDCFormer(cfg.model_config(start_model.cfg.d_vocab), init=False)
        model.init_weights(identity_compose=True)
        optimizer = train_module.make_optimizer(model, cfg)
        train_module.take_start(train_module.load_start(start, cfg), model, optimizer)
        return model, optimizer

    wide = dataclasses.replace(mha, d_mlp=80)
    (begun, optimizer), (same, same_optimizer) = begin(wide), begin(mha)
    for layer in range(wide.n_layers):
        mlp, start_mlp = begun.blocks[layer].mlp, start_model.blocks[layer].mlp
        assert torch.equal(mlp.W_in[:, :64], start_mlp.W_in) and mlp.W_in[:, 64:].abs().sum() > 0
        assert torch.equal(mlp.W_out[64:], torch.zeros(16, wide.d_model))
        moments, start_moments = optimizer.state[mlp.W_out], same_optimizer.state[same.blocks[layer].mlp.W_out]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[key][:64], start_moments[key]) and not moments[key][64:].any()
    tokens = torch.randint(0, start_model.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # in float64, where the two MLPs' sums differ only in their rounding
        expected = same.to(torch.float64)(tokens)  # the start, begun the same way at its own width
        torch.testing.assert_close(begun.to(torch.float64)(tokens), expected, rtol=1e-12, atol=1e-12)
    trained, recipe = quiet_train(wide, tmp_path / "trained", start_from=start)
    assert recipe["steps"] == wide.steps and all(block.mlp.W_out[64:].abs().sum() > 0 for block in trained.blocks)
    quiet_train(wide, tmp_path / "wide-start", stop_after=2)
    with pytest.raises(ResumeError, match=r"has an MLP of 80 units, this run 64: a start can be widened"):
        train_module.load_start(tmp_path / "wide-start" / CHECKPOINT_FILE, mha)
