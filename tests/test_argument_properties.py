"""Every public analysis function, on argument combinations drawn by hypothesis, valid and invalid: either a
finite result of the documented shape, or a one-line ValueError/TypeError whose message names an argument that
was drawn invalid. Any other exception (from deep inside torch or TransformerLens) fails the test.

Each test runs twice, for valid and for invalid combinations (pytest's `valid` parameter): every argument draws a
valid value and an invalid one, and `combination` passes the valid ones, or the invalid ones of a drawn non-empty
set of arguments. So each function meets both kinds by construction, MAX_EXAMPLES of each, not by the luck of the
draw; and the draws are fixed (@seed(0) on every test), so that a run repeats the one before it.
"""

import collections
import re
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from dcinterp import HookedDCFormer
from dcinterp.attribution import head_ablation, head_attribution
from dcinterp.circuits import head_diversity, ov_circuit, ov_logits, ov_top_tokens, qk_circuit
from dcinterp.composition import attention_distributions, compose_breakdown, composition_maps_along_keys, donor_heads
from dcinterp.patching import (
    Component,
    Site,
    activation_patching,
    attribution_patching,
    branch_ablation,
    branch_components,
    sites,
)
from dcinterp.qk import qk_attribution, qk_contrast
from dcinterp.qk_weights import weight_attribution
from dcinterp.synth import contrast_pairs, tokenize_pairs
from dcinterp.synth.contrast import PairTokens

MAX_EXAMPLES = 20  # per function and kind (valid, invalid)
TRIED = collections.defaultdict(collections.Counter)  # function -> {"valid": n, "invalid": n}
SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

MODEL = HookedDCFormer.from_pretrained("dcpythia-synth")  # 3 layers, 4 heads, a word-level tokenizer
L, H, V = MODEL.cfg.n_layers, MODEL.cfg.n_heads, MODEL.cfg.d_vocab
POS = 6  # prompt length of the drawn token batches
WORD = "burger"  # a word of the vocabulary (one token)
torch.manual_seed(0)
TOKENS = torch.randint(4, V, (2, POS))
PAIRS = tokenize_pairs(contrast_pairs(2, n=2, seed=0, tokenizer=MODEL.tokenizer), MODEL.tokenizer)
PAIR_POS = PAIRS.clean.shape[1]


def arg(valid: list, invalid: list):
    """One argument: draws a (valid value, invalid value) pair; `combination` chooses which of the two is passed."""
    return st.tuples(st.sampled_from(valid), st.sampled_from(invalid))


def combination(data, valid: bool, core: list[str] | None = None, **arguments) -> dict:
    """Draw the arguments; return {name: (value, is_valid)}. Valid: every argument's valid value. Invalid: the
    invalid value of a drawn non-empty set of arguments that holds at least one of `core` (default: any), the
    arguments every call of the test takes, so that each call is invalid too."""
    drawn = {name: data.draw(strategy, label=name) for name, strategy in arguments.items()}
    wrong = set()
    if not valid:
        wrong = {data.draw(st.sampled_from(core or list(arguments)), label="invalid")}
        wrong |= set(data.draw(st.lists(st.sampled_from(list(arguments)), unique=True), label="also invalid"))
    return {name: (pair[1], False) if name in wrong else (pair[0], True) for name, pair in drawn.items()}


VALIDITY = pytest.mark.parametrize("valid", [True, False], ids=["valid", "invalid"])


def names_argument(message: str, names: list[str]) -> bool:
    return any(re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message) for name in names)


def outcome(call, args: dict, check, label: str = "") -> None:
    """Call with the drawn arguments; valid ones must give a result that passes `check`, invalid ones a one-line
    ValueError/TypeError naming one of them."""
    kwargs = {name: value for name, (value, _) in args.items()}
    invalid = [name for name, (_, valid) in args.items() if not valid]
    TRIED[f"line {call.__code__.co_firstlineno} {label}"]["invalid" if invalid else "valid"] += 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # IG's completeness warning at few steps
            result = call(**kwargs)
    except (ValueError, TypeError) as error:
        message = str(error)
        assert invalid, f"valid arguments {kwargs} refused: {message}"
        assert "\n" not in message, message
        assert names_argument(message, invalid), f"the message does not name {invalid}: {message}"
        return
    assert not invalid, f"invalid {invalid} accepted: {kwargs}"
    check(result, kwargs)


def finite(*tensors) -> bool:
    return all(
        torch.isfinite(t if isinstance(t, torch.Tensor) else torch.tensor(np.array(t, dtype=float))).all()
        for t in tensors
    )


def table_is_finite(frame: pd.DataFrame, column: str) -> bool:
    return isinstance(frame, pd.DataFrame) and len(frame) > 0 and finite(frame[column].to_numpy(dtype=float))


# --------------------------------------------------------------------------------------------------
# Shared argument strategies
TOKENS_ARG = arg(
    [TOKENS, TOKENS[0], TOKENS.tolist()],
    [TOKENS[:0], TOKENS[:, :0], TOKENS.float(), TOKENS[None], TOKENS + V, "a prompt", None],
)
TARGET_ARG = arg([5, WORD, torch.tensor([5, 9])], [-1, V, 2.5, "xyzzy", torch.tensor([5, 9, 11])])
POSITION_ARG = arg([-1, 0, POS - 1, torch.tensor([3, 5])], [POS, -POS - 1, 1.5, torch.tensor([1, 2, 3])])
TARGET_TYPE_ARG = arg(["logit", "logprob", "prob"], ["loss", 3])


def one_prompt_per_prompt_values(args: dict) -> dict:
    """TOKENS[0] is one prompt: a target or position tensor of two values is then invalid. In a valid combination
    it becomes its first value (valid for one prompt); in an invalid one it is one more invalid argument."""
    tokens, tokens_valid = args["tokens"]
    any_invalid = not all(valid for _, valid in args.values())
    if tokens_valid and torch.as_tensor(tokens).ndim == 1:
        for name in ("target", "position"):
            value, valid = args.get(name, (None, False))
            if valid and isinstance(value, torch.Tensor) and value.numel() == 2:
                args[name] = (value, False) if any_invalid else (int(value[0]), True)
    return args


@VALIDITY
@given(data=st.data())
@SETTINGS
@seed(0)  # fixed draws that do not depend on the test's source text (derandomize's would)
def test_head_attribution(valid, data):
    args = combination(
        data,
        valid,
        tokens=TOKENS_ARG,
        target=TARGET_ARG,
        position=POSITION_ARG,
        target_type=TARGET_TYPE_ARG,
        n_steps=arg([2, 3], [0, -1, 2.5]),
        method=arg(["gausslegendre", "riemann_trapezoid"], ["simpson"]),
        path=arg(["joint", "per-layer"], ["both"]),
    )
    args = one_prompt_per_prompt_values(args)

    def check(result, kwargs):
        batch = torch.as_tensor(kwargs["tokens"]).reshape(-1, POS).shape[0]
        assert result.scores.shape == (L, H) and result.per_prompt.shape == (batch, L, H)
        assert finite(result.per_prompt, result.delta, result.f_input, result.f_baseline)

    outcome(lambda **kw: head_attribution(MODEL, **kw), args, check)


@VALIDITY
@given(data=st.data())
@SETTINGS
@seed(0)  # fixed draws that do not depend on the test's source text (derandomize's would)
def test_head_ablation(valid, data):
    args = combination(
        data,
        valid,
        tokens=TOKENS_ARG,
        target=TARGET_ARG,
        position=POSITION_ARG,
        target_type=TARGET_TYPE_ARG,
        heads=arg([None, [(0, 1)], [(2, -1), (1, 3)]], [[], [(L, 0)], [(0, H)], [(0,)], "L0H1", [(0.5, 1)]]),
    )
    args = one_prompt_per_prompt_values(args)

    def check(result, kwargs):
        assert result.effect.shape == (L, H)
        assert finite(torch.stack([result.effect[lh] for lh in result.heads]), result.clean)

    outcome(lambda **kw: head_ablation(MODEL, **kw), args, check)


COMPONENTS_ARG = arg(
    [None, branch_components(MODEL, layers=[1])[:2]],
    [
        [],
        ["qp"],
        [Component((Site(L, "pre", "o_qp"),), L, "pre", "qp")],
        [Component((Site(0, "mid", "o_qp"),), 0, "mid", "qp")],
        [Component((Site(0, "pre", "o_qp", H),), 0, "pre", "qp")],
    ],
)


@VALIDITY
@given(data=st.data())
@SETTINGS
@seed(0)  # fixed draws that do not depend on the test's source text (derandomize's would)
def test_branch_ablation(valid, data):
    args = combination(
        data,
        valid,
        tokens=TOKENS_ARG,
        target=TARGET_ARG,
        position=POSITION_ARG,
        target_type=TARGET_TYPE_ARG,
        components=COMPONENTS_ARG,
        ablation=arg(["zero", "mean"], ["noise"]),
        mean_over=arg(["position", "token"], ["template", None]),
    )
    args = one_prompt_per_prompt_values(args)

    def check(frame, kwargs):
        assert list(frame.columns) == ["layer", "stage", "branch", "head", "clean", "ablated", "effect"]
        n = len(kwargs["components"]) if kwargs["components"] is not None else L * 2 * 4
        assert len(frame) == n and table_is_finite(frame, "effect")

    outcome(lambda **kw: branch_ablation(MODEL, **kw), args, check)


def pairs_with(**changes) -> PairTokens:
    fields = dict(
        clean=PAIRS.clean,
        corrupt=PAIRS.corrupt,
        clean_answer=PAIRS.clean_answer,
        corrupt_answer=PAIRS.corrupt_answer,
        position=PAIRS.position,
    )
    return PairTokens(**{**fields, **changes})


PAIRS_ARG = arg(
    [PAIRS],
    [
        pairs_with(clean=PAIRS.clean[:0], corrupt=PAIRS.corrupt[:0]),
        pairs_with(corrupt=PAIRS.corrupt[:, :-1]),
        pairs_with(clean_answer=PAIRS.clean_answer[:1]),
        pairs_with(position=PAIRS.position + PAIR_POS),
        pairs_with(corrupt_answer=PAIRS.clean_answer + V),
        PAIRS.clean,
        None,
    ],
)


@pytest.mark.parametrize("kind", ["activation", "attribution"])
@VALIDITY
@given(data=st.data())
@SETTINGS
@seed(0)  # fixed draws that do not depend on the test's source text (derandomize's would)
def test_patching_tables(kind, valid, data):
    arguments = dict(
        pairs=PAIRS_ARG,
        direction=arg(["noising", "denoising"], ["both"]),
        per_head=arg([False, True], ["yes"]),
        names=arg([["o_qp"], "kw1", ["qg", "o_kg"]], [[], ["o_xx"], "o_qpx", [3]]),
        layers=arg([[0], [2], [1, 2]], [[], [L], [-1], ["a"], [0.5]]),
    )
    if kind == "attribution":
        arguments["softmax"] = arg(["linear", "exact"], ["approx"])
    args = combination(data, valid, **arguments)
    function = activation_patching if kind == "activation" else attribution_patching

    def check(frame, kwargs):
        expected = sites(MODEL, kwargs["names"], kwargs["layers"], kwargs["per_head"])
        assert len(frame) == len(expected) and table_is_finite(frame, "effect")

    outcome(lambda **kw: function(MODEL, **kw), args, check, kind)


@VALIDITY
@given(data=st.data())
@SETTINGS
@seed(0)  # fixed draws that do not depend on the test's source text (derandomize's would)
def test_composition(valid, data):
    args = combination(
        data,
        valid,
        core=["tokens", "layer", "query_pos", "stage", "batch_index"],  # what all three functions take
        tokens=arg([TOKENS, TOKENS[0]], [TOKENS[:0], TOKENS.float(), TOKENS[None], "x"]),
        layer=arg([0, 2, -1], [L, -L - 1, 0.5, "0", True]),
        query_pos=arg([POS - 1, -1], [POS, 2.5]),
        key_pos=arg([0, 2], [POS + 1, -POS - 1, "xyzzy"]),
        stage=arg(["pre", "post"], ["mid", None]),
        batch_index=arg([0, 1, -1], [2, -3]),
        heads=arg([None, [0, 3]], [[H], [0.5], "all"]),
    )
    heads = args.pop("heads")
    if args["tokens"][1] and args["batch_index"][1] and torch.as_tensor(args["tokens"][0]).ndim == 1:
        args["batch_index"] = (0, True)  # a 1-d prompt is a batch of one: index 0 is its only valid index

    def check(breakdown, kwargs):
        parts = [breakdown.before, *breakdown.branches.values()]
        assert all(p.shape == (H,) for p in parts) and finite(*parts, breakdown.composed)
        donors = donor_heads(breakdown, 1, k=2)
        assert len(donors.donors) <= 2 and finite(donors.contribution)

    outcome(lambda **kw: compose_breakdown(MODEL, **kw), args, check)
    along = {k: v for k, v in args.items() if k != "key_pos"}
    outcome(
        lambda **kw: composition_maps_along_keys(MODEL, **kw),
        along,
        lambda maps, kw: maps.shape[1:] == (H, H) and finite(maps),
    )
    along["heads"] = heads
    outcome(
        lambda **kw: attention_distributions(MODEL, **kw), along, lambda result, kw: finite(result.before, result.after)
    )


@VALIDITY
@given(data=st.data())
@SETTINGS
@seed(0)  # fixed draws that do not depend on the test's source text (derandomize's would)
def test_qk(valid, data):
    # query POS - 1 sees keys 2..5 in every layer (layer 0 is local, 4 keys)
    args = combination(
        data,
        valid,
        core=["tokens", "layer", "head", "query_pos", "batch_index"],  # what all three functions take
        tokens=arg([TOKENS, TOKENS[0]], [TOKENS[:0], TOKENS.float(), TOKENS[None], "x"]),
        layer=arg([0, 2, -1], [L, -L - 1, 0.5, "0"]),
        head=arg([0, H - 1, -1], [H, 1.5, None]),
        query_pos=arg([POS - 1, -1], [POS, 2.5]),
        key_pos=arg([2, 5, None, [3, 5], torch.tensor([2, 4])], [POS + 1, -POS - 1, "xyzzy", []]),
        batch_index=arg([0, 1, -1], [2, -3]),
        max_terms=arg([100, 10_000], [0, 1.5, "10"]),
    )
    if args["tokens"][1] and args["batch_index"][1] and torch.as_tensor(args["tokens"][0]).ndim == 1:
        args["batch_index"] = (0, True)  # a 1-d prompt is a batch of one: index 0 is its only valid index

    def check(result, kwargs):
        assert finite(result.composed) and table_is_finite(result.terms, "value") and result.relative_gap < 1e-4

    outcome(lambda **kw: qk_attribution(MODEL, **kw), args, check)
    single = {name: value for name, value in args.items() if name != "key_pos"}
    single |= combination(
        data,
        valid,
        key_pos=arg([2, 5], [POS + 1, "xyzzy", None, [2, 3]]),
        other_key_pos=arg([4], [POS, -POS - 1, None]),
    )
    outcome(lambda **kw: qk_contrast(MODEL, **kw), single, lambda c, kw: abs(c.gap) < 1e-4 * c.scale)
    weights = {name: value for name, value in single.items() if name not in ("other_key_pos", "max_terms")}
    weights |= combination(
        data,
        valid,
        stage=arg(["pre", "post"], ["mid", None]),
        method=arg(["ig", "linear"], ["saliency"]),
        n_steps=arg([4, 16], [0, 2.5]),
    )
    outcome(lambda **kw: weight_attribution(MODEL, **kw), weights, lambda w, kw: table_is_finite(w.scores, "query"))


@VALIDITY
@given(data=st.data())
@SETTINGS
@seed(0)  # fixed draws that do not depend on the test's source text (derandomize's would)
def test_circuits(valid, data):
    args = combination(
        data,
        valid,
        core=["layer", "head"],  # what every function of the head takes
        layer=arg([0, 2, -1], [L, 1.5, None]),
        head=arg([0, H - 1, -H], [H, -H - 1, "1"]),
        tokens=arg([[5, 9], WORD, [WORD, 5], torch.tensor([3])], [[], [V], "xyzzy", [1.5], None]),
        k=arg([1, 5], [0, V + 1, 2.5]),
    )
    layer, head, k = args["layer"], args["head"], args.pop("k")

    def check_logits(logits, kwargs):
        assert logits.shape[1] == V and finite(logits)

    outcome(lambda **kw: ov_logits(MODEL, **kw), args, check_logits)
    args["k"] = k
    outcome(lambda **kw: ov_top_tokens(MODEL, **kw), args, lambda frame, kw: table_is_finite(frame, "logit"))
    outcome(
        lambda **kw: qk_circuit(MODEL, **kw),
        {"layer": layer, "head": head},
        lambda circuit, kw: circuit.AB.shape == (MODEL.cfg.d_model,) * 2 and finite(circuit.AB),
    )
    outcome(
        lambda **kw: ov_circuit(MODEL, **kw), {"layer": layer, "head": head}, lambda circuit, kw: finite(circuit.AB)
    )
    diversity = combination(
        data,
        valid,
        layers=arg([None, [0, 2]], [[L], [0.5]]),
        dtype=arg([torch.float32, torch.float64, "float64"], [torch.int64, "float33"]),
        qk_norm=arg(["fold", "ignore"], ["keep"]),
        normalize=arg(["none", "head"], ["frobenius"]),
    )
    outcome(
        lambda **kw: head_diversity(MODEL, **kw),
        diversity,
        lambda result, kw: finite(result.qk, result.ov) and result.qk.shape[0] == len(result.layers),
    )


@VALIDITY
@given(data=st.data())
@SETTINGS
@seed(0)  # fixed draws that do not depend on the test's source text (derandomize's would)
def test_synth_pairs(valid, data):
    args = combination(
        data,
        valid,
        task=arg([2, "task3"], ["task999", -1]),
        n=arg([1, 2], [0, "2", 1.5]),
        kind=arg([None, "person"], ["place"]),
        seed=arg([0, 7], ["0"]),
        shots=arg([1, 2], [-1]),
    )

    def check(pairs, kwargs):
        tokens = tokenize_pairs(pairs, MODEL.tokenizer)
        assert tokens.clean.shape == tokens.corrupt.shape and tokens.clean.shape[0] == kwargs["n"]

    outcome(lambda **kw: contrast_pairs(**kw, tokenizer=MODEL.tokenizer), args, check)


def test_every_function_met_valid_and_invalid_combinations():
    """The draws are not all refused (or all accepted): each function ran valid and invalid combinations."""
    if len(TRIED) < 17:
        pytest.skip("run with the whole file")
    few = {key: dict(counts) for key, counts in TRIED.items() if counts["valid"] < 3 or counts["invalid"] < 3}
    assert not few, few
    print(f"{sum(sum(c.values()) for c in TRIED.values())} combinations over {len(TRIED)} functions")
