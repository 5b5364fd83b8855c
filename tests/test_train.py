"""dcinterp.train and dcinterp.tokenizer: the tokenizer covers the lexicon, the trainer learns, the shipped
models load by name and reproduce the accuracy recorded in their recipe.json."""

import dataclasses
import json
import random

import pytest
import torch

from dcinterp import HookedDCFormer
from dcinterp.loading import EMBEDDED_DIR
from dcinterp.synth import generate
from dcinterp.tokenizer import build_tokenizer, released_texts, split_words, unknown_words
from dcinterp.train import (
    DEFAULT_EXCLUDED_COMBOS,
    TEST_SET,
    TRAIN_SEED_BASE,
    SampleStream,
    TrainConfig,
    compact_catalog,
    compact_share_at,
    knowledge_sentences,
    lr_at,
    split_tasks,
    tasks_at,
    train,
    unbracket_spans,
    unbracket_text,
)

SHIPPED = ("dcpythia-synth", "pythia-synth")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_released_samples_tokenize_without_unknown_words(tokenizer):
    texts = released_texts()
    assert len(texts) == 888
    assert unknown_words(tokenizer, texts) == {}
    assert unknown_words(tokenizer, [unbracket_text(t) for t in texts]) == {}
    assert unknown_words(tokenizer, knowledge_sentences()) == {}


def test_generated_samples_tokenize_without_unknown_words(tokenizer):
    from dcinterp.synth import generate

    assert unknown_words(tokenizer, [r["texts"] for r in generate(seed=3, samples_per_task=3)]) == {}


def test_pretokenization_and_offsets(tokenizer):
    text = "\n< Ruth's T-shirt is in Washington, D.C at 11 o'clock. >.\n"
    enc = tokenizer(text, return_offsets_mapping=True)
    pieces = [text[a:b] for a, b in enc["offset_mapping"]]
    assert pieces == split_words(text)
    assert pieces[:8] == ["\n", "<", "Ruth", "'", "s", "T", "-", "shirt"]
    assert ["Washington", ",", "D", ".", "C"] == pieces[10:15]
    assert ["o", "'", "clock"] == pieces[17:20]
    assert tokenizer.unk_token_id not in enc["input_ids"]
    assert enc["input_ids"][0] == tokenizer.convert_tokens_to_ids("\n")  # no BOS added


def test_schedule_follows_appendix_c():
    cfg = TrainConfig(steps=1000, lr=1e-3)
    assert lr_at(0, cfg) == pytest.approx(1e-4)  # 1% warmup: 10 steps
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(999, cfg) == pytest.approx(1e-4, rel=1e-3)  # cosine to 10%
    assert lr_at(505, cfg) == pytest.approx(0.55e-3, rel=1e-2)


def test_compact_facts_rewrite_only_the_facts():
    from dcinterp.synth import generate, load_catalog

    catalog = load_catalog()
    compact = compact_catalog(catalog)
    tasks = ["task0", "task1", "task17", "task41", "task49", "task57"]
    released = generate(7, 2, tasks)
    short = generate(7, 2, tasks, catalog=compact)
    for r, s in zip(released, short, strict=True):
        for line, compact_line in zip(r["texts"].strip().split("\n"), s["texts"].strip().split("\n"), strict=True):
            if not line.startswith("<"):  # list lines have no persons: unchanged
                assert compact_line == line
                continue
            facts, query = line[2:].split(" >. ")
            compact_facts, compact_query = compact_line[2:].split(" >. ")
            assert compact_query == query
            people = [w for w in split_words(facts) if w in catalog.lexicon.people]
            assert [w for w in split_words(compact_facts) if w in catalog.lexicon.people] == people
            for fact in compact_facts.rstrip(".").split(". "):  # "Ruth cat" or "cat Ruth": a person and an item
                person_first = fact.split()[0] in catalog.lexicon.people
                person = fact.split()[0] if person_first else fact.split()[-1]
                item = fact.removeprefix(person + " ") if person_first else fact.removesuffix(" " + person)
                assert person in people and item.lower() in facts.lower() and person not in item
    assert "Ruth cat." not in "".join(r["texts"] for r in released)  # sanity: the two formats differ
    assert released != short


def test_compact_share_falls_to_zero_and_the_stream_follows_it():
    cfg = TrainConfig(steps=100, compact_until=0.5, samples_per_task=1, tasks=("task10",))
    assert compact_share_at(0, cfg) == 1.0 and compact_share_at(25, cfg) == 0.5
    assert compact_share_at(50, cfg) == 0.0 and compact_share_at(99, cfg) == 0.0
    assert compact_share_at(0, TrainConfig(compact_until=0.0)) == 0.0
    held = dataclasses.replace(cfg, compact_hold=0.25)  # 1 until step 25, then falls to 0 at step 50
    shares = [compact_share_at(step, held) for step in (0, 24, 25, 30, 45, 50, 99)]
    assert shares == pytest.approx([1.0, 1.0, 1.0, 0.8, 0.2, 0.0, 0.0], abs=1e-12)
    for share in (1.0, 0.0):
        stream = SampleStream(cfg, ["task10"], random.Random(0), lambda: share)  # noqa: B023 (read in this loop)
        first_facts = [next(stream)[0].split("< ")[1].split(".")[0] for _ in range(3)]  # "Ruth has a cat"
        assert all((" has " in fact) == (share == 0.0) for fact in first_facts), first_facts


def test_focus_tasks_alone_while_focused_then_all_tasks():
    cfg = TrainConfig(samples_per_task=1, focus_tasks=("task56",))
    for focused in (True, False):
        stream = SampleStream(cfg, ["task10", "task56"], random.Random(0), focus=lambda: focused)  # noqa: B023
        shapes = {
            "list" if text.lstrip().startswith("There are") else "context"
            for text, _ in (next(stream) for _ in range(8))
        }
        assert shapes == ({"list"} if focused else {"list", "context"})
    no_focus = SampleStream(
        dataclasses.replace(cfg, focus_tasks=()), ["task10", "task56"], random.Random(0), focus=lambda: True
    )
    assert {next(no_focus)[0].lstrip().startswith("There are") for _ in range(8)} == {True, False}


STAGED = TrainConfig(
    steps=100,
    samples_per_task=1,
    tasks=("task10", "task11", "task12", "task13", "task14", "task15", "task57"),
    focus_tasks=("task10", "task11"),
    focus_until=0.25,
    focus_stages=("task14,task15@0.3", "task12,task13@0.35"),
)


@pytest.mark.parametrize(
    "steps, tasks",
    [
        ((0, 24), ["task10", "task11"]),
        ((25, 29), ["task14", "task15"]),
        ((30, 34), ["task12", "task13"]),
        ((35, 99), list(STAGED.tasks)),
    ],
)
def test_each_focus_stage_draws_its_tasks_alone_then_all_tasks(steps, tasks):
    train_ids = list(STAGED.tasks)
    for step in steps:
        assert tasks_at(step, STAGED, train_ids) == tasks
        stream = SampleStream(STAGED, train_ids, random.Random(0), step=lambda: step)  # noqa: B023 (read here)
        drawn = [next(stream) for _ in range(len(tasks) * STAGED.samples_per_task)]  # one chunk
        expected = generate(TRAIN_SEED_BASE, STAGED.samples_per_task, tasks, lines=STAGED.lines)
        assert sorted(drawn) == sorted(unbracket_spans(record["texts"]) for record in expected)
    # no stages: the focus tasks, then all tasks at once (the one focus phase of the shipped recipe)
    assert tasks_at(25, dataclasses.replace(STAGED, focus_stages=()), train_ids) == train_ids
    # stages without focus tasks begin at step 0
    no_focus = dataclasses.replace(STAGED, focus_tasks=())
    assert tasks_at(0, no_focus, train_ids) == ["task14", "task15"] and tasks_at(35, no_focus, None) is None


def test_excluded_combos_keep_every_pattern_and_transformation():
    train_ids, held = split_tasks(",".join(DEFAULT_EXCLUDED_COMBOS))
    assert len(train_ids) + len(held) == 74 and len(held) == 8
    assert not set(train_ids) & set(held)
    with pytest.raises(ValueError):
        split_tasks("same-person:no-such-transformation")


TINY = dict(
    n_layers=2,
    d_model=32,
    n_heads=2,
    d_head=16,
    d_mlp=64,
    batch_size=4,
    lr=3e-3,
    threads=1,
    samples_per_task=1,
    log_every=5,
    window_size=32,
    window_type="LG",
    rotary_pct=0.25,
    tied_init=False,
    compact_until=0.0,
    focus_tasks=(),
)


def test_trainer_loss_falls_and_is_deterministic():
    cfg = TrainConfig(arch="dcmha", steps=30, seed=0, **TINY)
    model, recipe = train(cfg, progress=False, evaluate_after=False)
    losses = [h["loss"] for h in recipe["history"]]
    assert recipe["steps"] == 30 and len(losses) == 6
    assert losses[-1] < losses[0] - 1.0, losses
    assert recipe["final_loss"] < recipe["first_loss"] - 1.5
    again, _ = train(TrainConfig(arch="dcmha", steps=3, seed=1, **TINY), progress=False, evaluate_after=False)
    twice, _ = train(TrainConfig(arch="dcmha", steps=3, seed=1, **TINY), progress=False, evaluate_after=False)
    for (name, a), (_, b) in zip(again.state_dict().items(), twice.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_tied_init_starts_the_unembedding_at_the_embedding_transpose():
    tiny = {**TINY, "lr": 1e-12}
    tied, _ = train(TrainConfig(steps=1, **{**tiny, "tied_init": True}), progress=False, evaluate_after=False)
    untied, _ = train(TrainConfig(steps=1, **tiny), progress=False, evaluate_after=False)
    assert torch.allclose(tied.W_U, tied.W_E.T, atol=1e-6)
    assert not torch.allclose(untied.W_U, untied.W_E.T, atol=1e-2)


def test_trainer_mha_twin_has_the_same_size_but_no_dcmha():
    configs = {arch: TrainConfig(arch=arch, **TINY).model_config(d_vocab=100).to_dict() for arch in ("dcmha", "mha")}
    assert configs["dcmha"]["use_dcmha"] is True and configs["mha"]["use_dcmha"] is False

    def same(cfg):
        return {k: v for k, v in cfg.items() if k not in ("use_dcmha", "model_name")}

    assert same(configs["dcmha"]) == same(configs["mha"])
    assert configs["mha"]["use_qk_norm"] and configs["mha"]["parallel_residual"]
    model, _ = train(TrainConfig(arch="mha", steps=2, **TINY), progress=False, evaluate_after=False)
    assert model.cfg.use_dcmha is False and not hasattr(model.blocks[0].attn, "W_dyn_in")


def test_dcmha_learns_as_its_mha_twin_until_compose_from():
    """The twins start from the same shared weights; with the compose held at the identity the DCMHA model
    computes and learns exactly what the MHA model does, and from `compose_from` on its compose trains."""

    def run(arch, compose_from):
        cfg = TrainConfig(arch=arch, steps=6, seed=0, **{**TINY, "compose_from": compose_from})
        return train(cfg, progress=False, evaluate_after=False)[0]

    mha = dict(run("mha", 0.5).named_parameters())
    held = dict(run("dcmha", 1.0).named_parameters())
    trained = dict(run("dcmha", 0.5).named_parameters())
    for name, p in mha.items():
        assert torch.equal(held[name], p), name
    assert not torch.equal(trained["blocks.0.attn.W_Q"], mha["blocks.0.attn.W_Q"])
    rank = TrainConfig().model_config(d_vocab=100).dcmha_rank
    for layer in range(TINY["n_layers"]):
        w2, gate = (f"blocks.{layer}.attn.{name}" for name in ("W_dyn_out", "W_dyn_gate"))
        assert not held[w2][:, :, rank:].any() and not held[gate].any()
        assert trained[w2][:, :, rank:].abs().min() > 0 and trained[gate].abs().min() > 0  # every branch trains
    official = HookedDCFormer(TrainConfig(**TINY).model_config(d_vocab=100))
    assert official.blocks[0].attn.W_dyn_out.abs().min() > 0  # the default init is the official random one


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_loads_by_name_and_meets_recorded_accuracy(name):
    from dcinterp.synth import generate
    from dcinterp.synth.evaluate import evaluate

    assert (EMBEDDED_DIR / name / "model.safetensors").stat().st_size < 10 * 2**20
    recipe = json.loads((EMBEDDED_DIR / name / "recipe.json").read_text())
    model = HookedDCFormer.from_pretrained(name)
    assert model.tokenizer is not None and model.cfg.use_dcmha == (name == "dcpythia-synth")
    records = generate(seed=TEST_SET["seed"], samples_per_task=TEST_SET["samples_per_task"])
    torch.manual_seed(0)
    random.seed(0)
    df = evaluate(model, records, batch_size=16, progress=False)
    recorded = recipe["accuracy"]["test_set"]
    assert len(df) == recorded["answers"] == 6 * len(records)
    # the same answers right, up to a near-tie flipped by float rounding on another machine
    assert abs(int(df["correct"].sum()) - recorded["correct"]) <= 2, (int(df["correct"].sum()), recorded)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_was_trained_with_the_default_recipe(name):
    """`python -m dcinterp.train` with no settings rebuilds the shipped models."""
    recipe = json.loads((EMBEDDED_DIR / name / "recipe.json").read_text())
    default = dataclasses.asdict(TrainConfig(arch=recipe["train_config"]["arch"]))
    run_settings = {"threads", "max_minutes", "log_every", "eval_every"}  # how it ran, not what it learned
    differs = {
        k: (v, default[k])
        for k, v in recipe["train_config"].items()
        if k not in run_settings and json.loads(json.dumps(default[k])) != v
    }
    assert not differs and not recipe["stopped_early"]


def test_trainer_on_a_task_subset_logs_the_probe_accuracy():
    from dcinterp.synth import generate
    from dcinterp.synth.evaluate import evaluate
    from dcinterp.train import PROBE_SAMPLES_PER_TASK

    cfg = TrainConfig(arch="mha", steps=10, seed=0, tasks=("task10", "task57"), eval_every=5, **TINY)
    model, recipe = train(cfg, progress=False, evaluate_after=False)
    assert recipe["data"]["train_tasks"] == 2 and recipe["data"]["tasks"] == ["task10", "task57"]
    logged = [h["eval_accuracy"] for h in recipe["history"]]
    assert len(logged) == 2 and all(0 <= a <= 1 for a in logged)
    probe = generate(seed=0, samples_per_task=PROBE_SAMPLES_PER_TASK, tasks=["task10", "task57"])
    df = evaluate(model, probe, progress=False)
    assert set(df["task"]) == {"task10", "task57"}
    assert logged[-1] == round(float(df["correct"].mean()), 4)


def test_train_cli_rejects_an_unknown_task(capsys):
    from dcinterp.train.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--tasks", "task10,task99", "--steps", "1", "--out", "/nonexistent"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "task99" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("combos", ["same-person:nothing", "same-person", "odd-one-out:prev"])
def test_train_cli_rejects_bad_excluded_combos(capsys, tmp_path, combos):
    from dcinterp.train.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--exclude-combos", combos, "--steps", "1", "--out", str(tmp_path / "runs")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m dcinterp.train: error: --exclude-combos:") and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "args, named",
    [
        (["--window-type", "LXG"], "'LXG'"),
        (["--window-size", "0"], "window_size"),
        (["--focus-tasks", "2,3", "--exclude-combos", "same-person:superclass"], "task2, task3"),
        (["--focus-tasks", "10", "--tasks", "11"], "task10"),
    ],
)
def test_train_cli_rejects_bad_settings_before_writing(capsys, tmp_path, args, named):
    from dcinterp.train.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--steps", "1", "--out", str(tmp_path / "runs")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m dcinterp.train: error:") and named in err and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "args, named",
    [
        (["--focus-stages", "14,15"], "'14,15' is not 'TASKS@UNTIL'"),
        (["--focus-stages", "14,15@soon"], "'14,15@soon' is not 'TASKS@UNTIL'"),
        (["--focus-stages", "@0.3"], "'@0.3' is not 'TASKS@UNTIL'"),
        (["--focus-stages", "14,99@0.3"], "task99"),
        (["--focus-stages", "14,15@0.2"], "must end after --focus-until (0.25)"),
        (["--focus-stages", "14,15@0.3;12,13@0.3"], "must end after the stage before it (0.3)"),
        (["--focus-stages", "14,15@1.5"], "at 1 at the latest"),
        (["--focus-stages", "2,3@0.3", "--exclude-combos", "same-person:superclass"], "task2, task3"),
        (["--focus-stages", "14@0.3", "--tasks", "10,11", "--focus-tasks", "10"], "task14"),
    ],
)
def test_train_cli_rejects_bad_focus_stages_before_writing(capsys, tmp_path, args, named):
    from dcinterp.train.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--steps", "1", "--out", str(tmp_path / "runs")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m dcinterp.train: error: focus stage (--focus-stages)") and named in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "args, named",
    [
        (["--out", "{file}"], "--out {file}/pythia-synth: {file} is a file, not a directory"),
        (["--out", "{file}/runs"], "--out {file}/runs/pythia-synth: {file} is a file, not a directory"),
        (["--out", "{tmp}/runs", "--log-dir", "{file}"], "--log-dir {file}: exists and is not a directory"),
        (["--out", "{tmp}/runs", "--eval-only"], "--eval-only: {tmp}/runs/pythia-synth: not a checkpoint directory"),
    ],
)
def test_train_cli_rejects_a_folder_it_cannot_write_before_training(capsys, tmp_path, args, named):
    """Checked before the first step: a model is never trained for minutes and then lost at its save."""
    from dcinterp.train.__main__ import main

    (tmp_path / "a-file").write_text("")
    where = {"file": str(tmp_path / "a-file"), "tmp": str(tmp_path)}
    with pytest.raises(SystemExit) as exit_info:
        main(["--arch", "mha", "--steps", "1", *(a.format(**where) for a in args)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"python -m dcinterp.train: error: {named.format(**where)}") and len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_focus_stages_take_task_ids_as_tasks_does():
    from dcinterp.train.__main__ import config_from_args, parse_args

    args = parse_args(["--focus-stages", "14,task15@0.3; 12-13@.35"])
    cfg = config_from_args(args, "dcmha", [], ["task10", "task11"])
    assert cfg.focus_stages == ("task14,task15@0.3", "task12,task13@0.35")
    assert tasks_at(2_999, cfg, None) == ["task14", "task15"] and tasks_at(3_000, cfg, None) == ["task12", "task13"]


def test_train_cli_defaults_are_the_train_config_defaults(capsys, tmp_path):
    from dcinterp.train.__main__ import config_from_args, main, parse_args

    args = parse_args([])
    assert config_from_args(args, "dcmha", [], list(TrainConfig().focus_tasks)) == TrainConfig()
    assert parse_args(["--no-tied-init"]).tied_init is False
    # the recipe's task curriculum is for the whole catalog: a --tasks subset trains without it
    main(
        [
            "--tasks",
            "20",
            "--arch",
            "mha",
            "--steps",
            "1",
            "--no-eval",
            "--no-progress",
            "--n-layers",
            "1",
            "--d-model",
            "16",
            "--n-heads",
            "2",
            "--d-head",
            "8",
            "--d-mlp",
            "32",
            "--out",
            str(tmp_path),
        ]
    )
    recipe = json.loads((tmp_path / "pythia-synth" / "recipe.json").read_text())
    assert recipe["train_config"]["focus_tasks"] == [] and recipe["data"]["tasks"] == ["task20"]
