"""Empty and ragged batches, and the issue's examples of bad arguments: one clear line or the right number."""

import pytest
import torch

from dcinterp import HookedDCFormer
from dcinterp.attribution import head_ablation, head_attribution, head_baseline
from dcinterp.patching import (
    Component,
    Site,
    activation_patching,
    attribution_patching,
    branch_ablation,
    branch_components,
    mean_activations,
    sites,
)
from dcinterp.synth import contrast_pairs, tokenize_pairs
from dcinterp.synth.contrast import PairTokens


@pytest.fixture(scope="module")
def model():
    return HookedDCFormer.from_pretrained("dcpythia-synth")


@pytest.fixture(scope="module")
def ragged(model):
    """Pairs of two same-person tasks whose prompts differ in length (right-padded with the tokenizer's pad)."""
    pairs = [p for task in (2, 3) for p in contrast_pairs(task, n=2, seed=0, tokenizer=model.tokenizer)]
    tokens = tokenize_pairs(pairs, model.tokenizer)
    assert len(set((tokens.position + 1).tolist())) > 1  # ragged
    return tokens, [p.task_id for p in pairs]


def empty_pairs(pairs: PairTokens) -> PairTokens:
    return PairTokens(
        pairs.clean[:0], pairs.corrupt[:0], pairs.clean_answer[:0], pairs.corrupt_answer[:0], pairs.position[:0]
    )


def test_empty_batches_give_one_line(model, ragged):
    pairs, _ = ragged
    for table in (activation_patching, attribution_patching):
        with pytest.raises(ValueError, match=r"^pairs.clean is empty \(0 prompts"):
            table(model, empty_pairs(pairs))
    with pytest.raises(ValueError, match=r"^tokens is empty \(0 prompts"):
        branch_ablation(model, pairs.clean[:0], pairs.clean_answer[:0])
    with pytest.raises(ValueError, match=r"^tokens is empty"):
        head_attribution(model, pairs.clean[:0], pairs.clean_answer[:0])
    with pytest.raises(ValueError, match=r"^tokens is empty"):
        head_ablation(model, pairs.clean[:, :0], 5)
    with pytest.raises(ValueError, match=r"^pairs is empty"):
        tokenize_pairs([], model.tokenizer)


def test_mean_ablation_never_counts_pads(model, ragged):
    pairs, _ = ragged
    lengths = pairs.position + 1
    names = [site.hook_name for site in sites(model, ["o_qp", "kw1", "qg"], layers=[1])]
    means = mean_activations(model, pairs.clean, names)
    # The same prompts with other tokens in place of the pads, and the lengths given: the same means.
    noisy = pairs.clean.clone()
    pad = torch.arange(noisy.shape[1])[None] >= lengths[:, None]
    noisy[pad] = torch.randint(3, model.cfg.d_vocab, (int(pad.sum()),))
    for name, value in mean_activations(model, noisy, names, lengths=lengths).items():
        torch.testing.assert_close(value, means[name])
    # By hand, at a position only the longest prompts reach: the mean over those prompts alone.
    _, cache = model.run_with_cache(pairs.clean)
    p = int(lengths.min())  # the shortest prompts are pads from here on
    longer = lengths > p
    name = "blocks.1.pre_compose.hook_kw1".replace("pre_compose", "attn.pre_compose")
    torch.testing.assert_close(means[name][0, p], cache[name][longer, p].mean(0))
    o_qp = "blocks.1.attn.pre_compose.hook_o_qp"
    torch.testing.assert_close(means[o_qp][0, :, p, : p + 1], cache[o_qp][longer, :, p, : p + 1].mean(0))
    # ... and the padded batch's plain mean differs there: the test can fail.
    assert (cache[name][:, p].mean(0) - means[name][0, p]).abs().max() > 1e-3


def test_mean_rules_token_and_per_template(model, ragged):
    pairs, templates = ragged
    lengths = pairs.position + 1
    name = "blocks.2.attn.post_compose.hook_kg"
    (token_mean,) = mean_activations(model, pairs.clean, [name], over="token").values()
    _, cache = model.run_with_cache(pairs.clean)
    real = torch.arange(pairs.clean.shape[1])[None] < lengths[:, None]
    torch.testing.assert_close(token_mean[0, 0], cache[name][real].mean(0))
    assert torch.equal(token_mean[0], token_mean[0, :1].expand_as(token_mean[0]))  # the same at every position
    o_kg = "blocks.2.attn.post_compose.hook_o_kg"
    (o_mean,) = mean_activations(model, pairs.clean, [o_kg], over="token").values()
    assert (o_mean[0, :, 0, 1:] == 0).all()  # a query's hidden keys stay 0 (post-compose would see the future)
    per_template = mean_activations(model, pairs.clean, [name], templates=templates)[name]
    assert per_template.shape[0] == len(templates)
    for task in dict.fromkeys(templates):
        rows = [i for i, t in enumerate(templates) if t == task]
        alone = mean_activations(model, pairs.clean[rows], [name], lengths=lengths[rows])[name]
        width = alone.shape[1]
        torch.testing.assert_close(per_template[rows[0], :width], alone[0])


def test_branch_ablation_mean_rules_and_words(model, ragged):
    pairs, templates = ragged
    components = [c for c in branch_components(model) if (c.layer, c.stage) == (1, "pre")]
    args = dict(position=pairs.position, components=components, ablation="mean")
    by_rule = {
        rule: branch_ablation(model, pairs.clean, pairs.clean_answer, mean_over=rule, **args).effect
        for rule in ("position", "token")
    }
    by_template = branch_ablation(model, pairs.clean, pairs.clean_answer, templates=templates, **args).effect
    assert all(torch.isfinite(torch.tensor(e.values)).all() for e in (*by_rule.values(), by_template))
    assert (by_rule["position"] - by_rule["token"]).abs().max() > 1e-3
    word = model.tokenizer.convert_ids_to_tokens(int(pairs.clean_answer[0]))
    by_word = branch_ablation(model, pairs.clean[:1], word, components=components[:1], position=pairs.position[:1])
    by_id = branch_ablation(
        model, pairs.clean[:1], pairs.clean_answer[:1], components=components[:1], position=pairs.position[:1]
    )
    assert by_word.effect.tolist() == by_id.effect.tolist()
    with pytest.raises(ValueError, match="mean_over must be 'position' or 'token'"):
        branch_ablation(model, pairs.clean, pairs.clean_answer, mean_over="template", **args)
    with pytest.raises(ValueError, match="templates has 3 labels for 4 prompts"):
        branch_ablation(model, pairs.clean, pairs.clean_answer, templates=templates[:3], **args)


def test_the_issues_examples_give_one_line(model, ragged):
    pairs, _ = ragged
    with pytest.raises(ValueError, match="^names is empty"):
        attribution_patching(model, pairs, names=[])
    assert set(attribution_patching(model, pairs, names="o_qp").site) == {"o_qp"}  # one name, as a string
    with pytest.raises(ValueError, match="^target='xyzzy' is not in the tokenizer's vocabulary"):
        branch_ablation(model, pairs.clean, "xyzzy", position=pairs.position)
    for site, message in [
        (Site(9, "pre", "o_qp"), "components: layer 9 is not a layer"),
        (Site(1, "mid", "o_qp"), "components: stage 'mid' is not a compose stage"),
        (Site(1, "pre", "o_xx"), "components: site 'o_xx' is not one of"),
        (Site(1, "pre", "o_qp", 7), "components: head 7 is out of range"),
    ]:
        with pytest.raises(ValueError, match=message):
            branch_ablation(model, pairs.clean, pairs.clean_answer, [Component((site,), 0, "pre", "qp")])
    with pytest.raises(ValueError, match=r"^position=.* is out of range: the prompt has positions 0\.\."):
        branch_ablation(model, pairs.clean, pairs.clean_answer, position=200)
    with pytest.raises(ValueError, match=r"^pairs.position=.* is out of range"):
        activation_patching(
            model,
            PairTokens(pairs.clean, pairs.corrupt, pairs.clean_answer, pairs.corrupt_answer, pairs.position + 100),
        )
    with pytest.raises(ValueError, match=r"^pairs.clean_answer must hold one value per pair \(4\)"):
        attribution_patching(
            model, PairTokens(pairs.clean, pairs.corrupt, pairs.clean_answer[:2], pairs.corrupt_answer, pairs.position)
        )


def test_ig_mean_baseline_never_counts_pads(model, ragged):
    pairs, _ = ragged
    lengths = pairs.position + 1
    base = head_baseline(model, "mean", pairs.clean)
    _, cache = model.run_with_cache(pairs.clean)
    real = torch.arange(pairs.clean.shape[1])[None] < lengths[:, None]
    torch.testing.assert_close(base[1], cache["blocks.1.attn.hook_z"][real].mean(0))
