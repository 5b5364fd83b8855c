import json
from pathlib import Path

import pytest
import torch

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.attribution import (
    head_ablation,
    head_attribution,
    head_attribution_sweep,
    head_baseline,
    target_value,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests/fixtures/dcpythia-tiny"


def tiny(**overrides) -> HookedDCFormer:
    torch.manual_seed(0)
    cfg = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50)
    return HookedDCFormer(DCFormerConfig(**{**cfg, **overrides}))


@pytest.fixture(scope="module")
def fixture_model() -> HookedDCFormer:
    return HookedDCFormer.from_pretrained(FIXTURE)


def assert_complete(result, rel: float = 0.02) -> None:
    """Completeness: per prompt, the head scores sum to f(input) - f(baseline) within rel."""
    gap = result.f_input - result.f_baseline
    assert gap.abs().min() > 1e-4, "degenerate test: the target does not depend on the heads"
    assert torch.all(result.delta.abs() <= rel * gap.abs()), (result.delta, gap)
    assert torch.allclose(result.per_prompt.sum((1, 2)), gap + result.delta, atol=1e-5)


@pytest.mark.parametrize("target_type", ["logit", "logprob"])
def test_completeness_random_tiny(target_type):
    model = tiny()
    tokens = torch.randint(0, 50, (3, 10))
    answers = torch.tensor([4, 7, 11])
    result = head_attribution(model, tokens, answers, target_type=target_type, n_steps=64)
    assert result.scores.shape == (2, 4) and result.per_prompt.shape == (3, 2, 4)
    assert_complete(result)
    # f(input) is the plain model's target; f(baseline) the model with every head's output zeroed.
    with torch.no_grad():
        logits = model(tokens)[:, -1]
        zeroed = model.run_with_hooks(tokens, fwd_hooks=[(lambda n: n.endswith("hook_z"), lambda z, hook: z * 0)])
    pick = lambda x: (x if target_type == "logit" else x.log_softmax(-1))[torch.arange(3), answers]  # noqa: E731
    torch.testing.assert_close(result.f_input, pick(logits), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.f_baseline, pick(zeroed[:, -1]), atol=1e-5, rtol=1e-5)


def test_completeness_mean_baseline_and_custom_target(fixture_model):
    torch.manual_seed(1)
    tokens = torch.randint(3, 97, (2, 12))
    reference = torch.randint(3, 97, (6, 9))
    target = lambda logits, tokens: logits[:, -1].logsumexp(-1) - logits[:, -1, 5]  # noqa: E731
    result = head_attribution(fixture_model, tokens, target, baseline="mean", reference_tokens=reference, n_steps=64)
    assert_complete(result)
    base = head_baseline(fixture_model, "mean", reference)
    assert base.shape == (4, 4, 8)
    with torch.no_grad():
        _, cache = fixture_model.run_with_cache(reference, names_filter=lambda n: n == "blocks.2.attn.hook_z")
    torch.testing.assert_close(base[2], cache["blocks.2.attn.hook_z"].mean((0, 1)))


def test_padded_batch_positions_tasks_and_internal_batch(fixture_model):
    torch.manual_seed(2)
    a, b = torch.randint(3, 97, (9,)), torch.randint(3, 97, (12,))
    padded = torch.stack([torch.cat([a, torch.zeros(3, dtype=a.dtype)]), b])
    answers = torch.tensor([10, 20])
    kwargs = dict(n_steps=16)
    together = head_attribution(
        fixture_model,
        padded,
        answers,
        position=torch.tensor([8, 11]),
        tasks=["x", "y"],
        internal_batch_size=8,
        **kwargs,
    )
    alone_a = head_attribution(fixture_model, a[None], 10, **kwargs)
    alone_b = head_attribution(fixture_model, b[None], 20, **kwargs)
    torch.testing.assert_close(together.per_prompt[0], alone_a.per_prompt[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(together.per_prompt[1], alone_b.per_prompt[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(together.by_task["x"], alone_a.scores, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(together.scores, together.per_prompt.mean(0))
    frame = together.to_frame()
    assert list(frame.columns) == ["layer", "head", "score", "score[x]", "score[y]"] and len(frame) == 16


@pytest.mark.parametrize("path", ["joint", "per-layer"])
def test_a_sweep_is_head_attribution_of_each_batch_bit_for_bit_and_of_all_at_once_to_rounding(fixture_model, path):
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 97, (5, 10), generator=generator)
    answers, positions = torch.tensor([10, 20, 30, 40, 50]), torch.tensor([9, 7, 9, 8, 9])
    tasks = ["a", "b", "a", "b", "a"]
    kwargs = dict(n_steps=8, path=path, baseline="mean", reference_tokens=tokens)
    sweep = head_attribution_sweep(
        fixture_model, tokens, answers, position=positions, tasks=tasks, batch_size=2, **kwargs
    )
    mean = head_baseline(fixture_model, "mean", tokens)
    for rows in (slice(0, 2), slice(2, 4), slice(4, 5)):  # each batch as head_attribution computes it
        alone = head_attribution(
            fixture_model, tokens[rows], answers[rows], position=positions[rows], n_steps=8, path=path, baseline=mean
        )
        for field in ("per_prompt", "delta", "f_input", "f_baseline") + (("f_layer_baseline",) * (path != "joint")):
            assert torch.equal(getattr(sweep, field)[rows], getattr(alone, field)), field
    together = head_attribution(fixture_model, tokens, answers, position=positions, tasks=tasks, **kwargs)
    torch.testing.assert_close(sweep.per_prompt, together.per_prompt, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sweep.scores, together.scores, atol=1e-5, rtol=1e-5)
    assert list(sweep.by_task) == ["a", "b"]
    torch.testing.assert_close(sweep.by_task["b"], together.by_task["b"], atol=1e-5, rtol=1e-5)
    if path == "joint":  # per layer, completeness holds against each layer's own baseline
        assert_complete(sweep, rel=0.05)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        head_attribution_sweep(fixture_model, tokens, answers, batch_size=0)


def test_plain_mha_and_half_precision():
    mha = tiny(use_dcmha=False)
    tokens = torch.randint(0, 50, (2, 8))
    assert_complete(head_attribution(mha, tokens, 3, n_steps=64))
    half = tiny().to(torch.bfloat16)
    result = head_attribution(half, tokens, 3, target_type="logprob", n_steps=8)
    assert result.scores.dtype == torch.float32 and torch.isfinite(result.per_prompt).all()


def test_top_head_ablation_beats_median_head_on_fixture(fixture_model):
    # The fixture's own predictions as targets; seed and batch fixed (the property is not a theorem).
    torch.manual_seed(0)
    tokens = torch.randint(3, 97, (8, 12))
    with torch.no_grad():
        answers = fixture_model(tokens)[:, -1].argmax(-1)
    for target_type in ("logit", "logprob"):
        result = head_attribution(fixture_model, tokens, answers, target_type=target_type, n_steps=32)
        order = result.scores.flatten().argsort(descending=True)
        top, median = divmod(int(order[0]), 4), divmod(int(order[len(order) // 2]), 4)
        effect = head_ablation(fixture_model, tokens, answers, heads=[top, median], target_type=target_type)
        assert effect.effect[top] < 0 and effect.effect[top] < effect.effect[median], (target_type, top, median, effect)
        assert torch.isnan(effect.effect).sum() == 14 and effect.heads == [top, median]


def synthetic_prompts(model, n: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The last line of n samples from distinct tasks, cut before the answer: tokens, positions, answer ids."""
    rows = [json.loads(line) for line in (ROOT / "synthetic_tasks/synthetic_dataset.jsonl").open()]
    prompts, answers = [], []
    for row in rows[:: len(rows) // n][:n]:
        text = row["texts"].rstrip()
        cut = text.rindex("[") + 1
        prompts.append(text[:cut])
        answers.append(text[cut:].strip(" ]"))
    tokens = model.to_tokens(prompts)
    lengths = torch.tensor([model.to_tokens(p).shape[1] for p in prompts])
    with torch.no_grad():
        predicted = model(tokens)[torch.arange(n), lengths - 1].argmax(-1)
    ids = []
    for answer, guess in zip(answers, predicted, strict=True):
        answer_ids = model.to_tokens(" " + answer)[0]
        ids.append(int(answer_ids[-1]) if len(answer_ids) == 1 else int(guess))
    return tokens, lengths - 1, torch.tensor(ids)


def test_top_head_ablation_beats_median_head_on_embedded_model():
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    tokens, positions, answers = synthetic_prompts(model)
    result = head_attribution(model, tokens, answers, position=positions, target_type="logprob", n_steps=32)
    order = result.scores.flatten().argsort(descending=True)
    n_heads = model.cfg.n_heads
    top, median = divmod(int(order[0]), n_heads), divmod(int(order[len(order) // 2]), n_heads)
    effect = head_ablation(model, tokens, answers, heads=[top, median], position=positions, target_type="logprob")
    assert effect.effect[top] < effect.effect[median], (top, median, effect)
    assert_complete(head_attribution(model, tokens[:2], answers[:2], position=positions[:2], n_steps=128), rel=0.05)


def test_target_value_only_unembeds_the_position():
    model = tiny()
    tokens = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        full = model(tokens)
        got = target_value(model, tokens, torch.tensor([1, 2]), position=torch.tensor([3, 5]))
    torch.testing.assert_close(got, torch.stack([full[0, 3, 1], full[1, 5, 2]]))


# --------------------------------------------------------------------------------------------------
# Conventions (docs/conventions.md): target type, path, word targets, argument checks
def test_prob_target_is_the_softmax_probability_and_complete():
    model = tiny()
    tokens = torch.randint(0, 50, (2, 7))
    answers = torch.tensor([3, 9])
    result = head_attribution(model, tokens, answers, target_type="prob", n_steps=64)
    with torch.no_grad():
        probs = model(tokens)[:, -1].softmax(-1)[torch.arange(2), answers]
    torch.testing.assert_close(result.f_input, probs, atol=1e-6, rtol=1e-5)
    assert_complete(result)
    assert result.target_type == "prob" and "prob" in repr(result)


def test_per_layer_path_is_complete_per_layer_not_jointly():
    model = tiny(n_layers=3)
    tokens = torch.randint(0, 50, (2, 9))
    result = head_attribution(model, tokens, 5, target_type="logprob", path="per-layer", n_steps=64)
    assert result.path == "per-layer" and result.f_layer_baseline.shape == (2, 3)
    # f with one layer's heads zeroed, the others as they are, by hand
    for layer in range(3):
        with torch.no_grad():
            off = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", lambda z, hook: 0 * z)])
        torch.testing.assert_close(
            result.f_layer_baseline[:, layer], off[:, -1].log_softmax(-1)[:, 5], atol=1e-5, rtol=1e-5
        )
        gap = result.f_input - result.f_layer_baseline[:, layer]
        torch.testing.assert_close(result.per_prompt[:, layer].sum(-1), gap, atol=0.02 * gap.abs().max(), rtol=0)
    # the joint completeness gap is what the per-layer path gives up
    joint = head_attribution(model, tokens, 5, target_type="logprob", n_steps=64)
    assert_complete(joint)
    assert result.delta.abs().max() > 10 * joint.delta.abs().max()


def test_per_layer_path_equals_joint_path_with_one_layer():
    model = tiny(n_layers=1)
    tokens = torch.randint(0, 50, (1, 6))
    joint = head_attribution(model, tokens, 2, n_steps=32)
    per_layer = head_attribution(model, tokens, 2, n_steps=32, path="per-layer")
    torch.testing.assert_close(joint.per_prompt, per_layer.per_prompt, atol=1e-5, rtol=1e-5)


def test_word_targets_and_bad_arguments_give_one_line_errors():
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    tokens = model.to_tokens("Michelle has a burger. Michelle owns a kind of")
    food = model.tokenizer.convert_tokens_to_ids("food")
    by_word = head_ablation(model, tokens, "food", heads=[(2, 0)], target_type="logprob")
    by_id = head_ablation(model, tokens, food, heads=[(2, 0)], target_type="logprob")
    assert torch.equal(by_word.clean, by_id.clean) and by_word.effect[2, 0] == by_id.effect[2, 0]
    assert list(by_word.to_frame().columns) == ["layer", "head", "effect"] and "L2H0" in repr(by_word)
    with pytest.raises(ValueError, match="target='xyzzy' is not in the tokenizer's vocabulary"):
        head_attribution(model, tokens, "xyzzy")
    with pytest.raises(ValueError, match=r"position=10 is out of range: the prompt has positions 0..9"):
        head_attribution(model, tokens, food, position=10)
    with pytest.raises(ValueError, match=r"heads: layer=3 is out of range: the model has layers 0..2"):
        head_ablation(model, tokens, food, heads=[(3, 0)])
    with pytest.raises(ValueError, match=r"heads: head=4 is out of range"):
        head_ablation(model, tokens, food, heads=[(0, 4)])
    with pytest.raises(ValueError, match="target=.* is not a token id"):
        head_attribution(model, tokens, model.cfg.d_vocab)
    with pytest.raises(ValueError, match="target_type must be one of"):
        head_attribution(model, tokens, food, target_type="probability")
    with pytest.raises(ValueError, match="path must be"):
        head_attribution(model, tokens, food, path="layerwise")
    with pytest.raises(ValueError, match="has no tokenizer"):
        head_attribution(tiny(), torch.randint(0, 50, (1, 5)), "food")
