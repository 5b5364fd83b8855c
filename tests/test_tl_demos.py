"""TransformerLens' own demos, run on HookedDCFormer: the code of Main_Demo, Exploratory_Analysis_Demo,
Activation_Patching_in_TL_Demo and Attribution_Patching_Demo (TransformerLens' repository, demos/), with only the
model load and the prompts changed (IOI prompts -> the synthetic tasks' "X has a burger . Y has a cat . X owns a
kind of" pairs), plots left out. Every number they print that has a ground truth is checked against it.

The load: `enable_compatibility_mode()` is TransformerLens' weight processing, here
`from_pretrained(name, fold_ln=True, center_writing_weights=True, center_unembed=True)`
(`refactor_factored_attn_matrices`, which Exploratory_Analysis_Demo also asks for, is impossible with rotary
embeddings, in TransformerLens too). The embedded models are parallel-residual (Pythia's layout): a block has no
`resid_mid`, so `accumulated_resid(incl_mid=INCL_MID)` becomes `incl_mid=INCL_MID` (TransformerLens' Pythia: the same).
"""

from functools import partial

import einops
import pytest
import torch
import transformer_lens.patching as patching
import transformer_lens.utilities as utils
from transformer_lens import ActivationCache

from dcinterp import HookedDCFormer
from tests.numerics import assert_as_exact_as, float64_copy

MODELS = ["dcpythia-synth", "pythia-synth"]
# (prompt with the correct subject, (correct answer, incorrect answer)); each pair in both orders, as the demos' IOI
PAIRS = [
    ("Michelle has a burger . Helen has a cat . {} owns a kind of", ("Michelle", "Helen"), ("food", "animal")),
    ("Ruth has a papaya . Carol has a cannon . {} owns a kind of", ("Ruth", "Carol"), ("fruit", "weapon")),
    ("John has a dog . Mary has a apple . {} owns a kind of", ("John", "Mary"), ("animal", "fruit")),
    ("James has a cannon . Helen has a burger . {} owns a kind of", ("James", "Helen"), ("weapon", "food")),
]
prompts = [template.format(name) for template, names, _ in PAIRS for name in names]
answers = [pair for _, _, (a, b) in PAIRS for pair in ((a, b), (b, a))]
close = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-4)
INCL_MID = False  # both embedded models are parallel-residual


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> HookedDCFormer:
    model = HookedDCFormer.from_pretrained(
        request.param, fold_ln=True, center_writing_weights=True, center_unembed=True
    )
    model.set_use_attn_result(True)
    yield model
    model.set_use_attn_result(False)


@pytest.fixture(scope="module")
def ioi(model):
    """The IOI set-up shared by Exploratory_Analysis, Activation_Patching and Attribution_Patching."""
    clean_tokens = model.to_tokens(prompts)
    corrupted_tokens = clean_tokens[[(i + 1 if i % 2 == 0 else i - 1) for i in range(len(clean_tokens))]]
    answer_token_indices = torch.tensor(
        [[model.to_single_token(answers[i][j]) for j in range(2)] for i in range(len(answers))], device=model.cfg.device
    )

    def get_logit_diff(logits, answer_token_indices=answer_token_indices):
        if len(logits.shape) == 3:
            logits = logits[:, -1, :]
        correct_logits = logits.gather(1, answer_token_indices[:, 0].unsqueeze(1))
        incorrect_logits = logits.gather(1, answer_token_indices[:, 1].unsqueeze(1))
        return (correct_logits - incorrect_logits).mean()

    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(clean_tokens)
        corrupted_logits, corrupted_cache = model.run_with_cache(corrupted_tokens)
    CLEAN_BASELINE = get_logit_diff(clean_logits, answer_token_indices).item()
    CORRUPTED_BASELINE = get_logit_diff(corrupted_logits, answer_token_indices).item()

    def ioi_metric(logits, answer_token_indices=answer_token_indices):
        return (get_logit_diff(logits, answer_token_indices) - CORRUPTED_BASELINE) / (
            CLEAN_BASELINE - CORRUPTED_BASELINE
        )

    assert abs(CLEAN_BASELINE - CORRUPTED_BASELINE) > 0.1  # a metric that can be normalised
    return dict(
        clean_tokens=clean_tokens,
        corrupted_tokens=corrupted_tokens,
        answer_token_indices=answer_token_indices,
        get_logit_diff=get_logit_diff,
        ioi_metric=ioi_metric,
        clean_logits=clean_logits,
        clean_cache=clean_cache,
        corrupted_cache=corrupted_cache,
        CLEAN=CLEAN_BASELINE,
        CORRUPTED=CORRUPTED_BASELINE,
    )


def differing_position(ioi) -> int:
    (position,) = (ioi["clean_tokens"][0] != ioi["corrupted_tokens"][0]).nonzero()[:, 0].tolist()
    return position


# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_exploratory_analysis_demo(model, ioi):
    tokens, cache, answer_tokens = ioi["clean_tokens"], ioi["clean_cache"], ioi["answer_token_indices"]
    original_logits = ioi["clean_logits"]
    # the no-hook forward against the cached (materialised) run, judged by float64 (tests/numerics.py)
    assert_as_exact_as(model(tokens), original_logits, float64_copy(model).run_with_cache(tokens)[0], "logits")

    def logits_to_ave_logit_diff(logits, answer_tokens, per_prompt=False):
        final_logits = logits[:, -1, :]
        answer_logits = final_logits.gather(dim=-1, index=answer_tokens)
        answer_logit_diff = answer_logits[:, 0] - answer_logits[:, 1]
        return answer_logit_diff if per_prompt else answer_logit_diff.mean()

    original_average_logit_diff = logits_to_ave_logit_diff(original_logits, answer_tokens)
    # "Calculated average logit diff" against "Original logit difference"
    W_U = model.unembed.W_U
    answer_residual_directions = einops.rearrange(
        W_U[:, answer_tokens], "d_model batch correct_incorrect -> batch correct_incorrect d_model"
    )
    logit_diff_directions = answer_residual_directions[:, 0] - answer_residual_directions[:, 1]
    final_token_residual_stream = cache["resid_post", -1][:, -1, :]
    scaled_final_token_residual_stream = cache.apply_ln_to_stack(final_token_residual_stream, layer=-1, pos_slice=-1)
    average_logit_diff = einops.einsum(
        scaled_final_token_residual_stream, logit_diff_directions, "batch d_model, batch d_model -> "
    ) / len(prompts)
    close(average_logit_diff, original_average_logit_diff)

    def residual_stack_to_logit_diff(residual_stack, cache):
        scaled_residual_stack = cache.apply_ln_to_stack(residual_stack, layer=-1, pos_slice=-1)
        return einops.einsum(
            scaled_residual_stack, logit_diff_directions, "... batch d_model, batch d_model -> ..."
        ) / len(prompts)

    accumulated_residual, labels = cache.accumulated_resid(
        layer=-1, incl_mid=INCL_MID, pos_slice=-1, return_labels=True
    )
    logit_lens_logit_diffs = residual_stack_to_logit_diff(accumulated_residual, cache)
    assert labels[-1] == "final_post"
    close(logit_lens_logit_diffs[-1], original_average_logit_diff)  # the last accumulated stream is the model's
    per_layer_residual, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
    per_layer_logit_diffs = residual_stack_to_logit_diff(per_layer_residual, cache)
    close(per_layer_logit_diffs.sum(), original_average_logit_diff)  # direct logit attribution adds up
    per_head_residual, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    per_head_logit_diffs = einops.rearrange(
        residual_stack_to_logit_diff(per_head_residual, cache),
        "(layer head_index) -> layer head_index",
        layer=model.cfg.n_layers,
        head_index=model.cfg.n_heads,
    )
    b_O = model.b_O[:, None, :].expand(-1, len(prompts), -1)  # what no head writes: the output bias
    attn_labels = [i for i, label in enumerate(labels_of(cache)) if label.endswith("attn_out")]
    close(per_head_logit_diffs.sum(1) + residual_stack_to_logit_diff(b_O, cache), per_layer_logit_diffs[attn_labels])

    # Activation patching by hand, against TransformerLens' patching module (and 1 / 0 where it is known)
    corrupted_tokens, corrupted_average_logit_diff = ioi["corrupted_tokens"], ioi["CORRUPTED"]
    close(torch.tensor(corrupted_average_logit_diff), logits_to_ave_logit_diff(model(corrupted_tokens), answer_tokens))

    def patch_residual_component(corrupted_residual_component, hook, pos, clean_cache):
        clean_value = clean_cache[hook.name][:, pos, :].clone()
        corrupted_residual_component = corrupted_residual_component.clone()
        corrupted_residual_component[:, pos : pos + 1, :] = clean_value.unsqueeze(1)
        return corrupted_residual_component

    def normalize_patched_logit_diff(patched_logit_diff):
        return (patched_logit_diff - corrupted_average_logit_diff) / (
            original_average_logit_diff - corrupted_average_logit_diff
        )

    def by_hand(act_name, hook_fn, n):
        result = torch.zeros(model.cfg.n_layers, n)
        for layer in range(model.cfg.n_layers):
            for i in range(n):
                patched_logits = model.run_with_hooks(
                    corrupted_tokens,
                    return_type="logits",
                    fwd_hooks=[
                        (utils.get_act_name(act_name, layer), partial(hook_fn, **{key: i, "clean_cache": cache}))
                        for key in [("head_index" if act_name in ("z", "v", "attn") else "pos")]
                    ],
                )
                result[layer, i] = normalize_patched_logit_diff(logits_to_ave_logit_diff(patched_logits, answer_tokens))
        return result

    metric = ioi["ioi_metric"]
    resid = by_hand("resid_pre", patch_residual_component, tokens.shape[1])
    position = differing_position(ioi)
    close(resid[0, position], torch.tensor(1.0))  # the only token that differs, patched at the start: the clean run
    close(resid[0, [p for p in range(tokens.shape[1]) if p != position]], torch.zeros(tokens.shape[1] - 1))
    close(resid, patching.get_act_patch_resid_pre(model, corrupted_tokens, cache, metric))
    every_block = patching.get_act_patch_block_every(model, corrupted_tokens, cache, metric)
    close(by_hand("attn_out", patch_residual_component, tokens.shape[1]), every_block[1])
    close(by_hand("mlp_out", patch_residual_component, tokens.shape[1]), every_block[2])

    def patch_head_vector(corrupted_head_vector, hook, head_index, clean_cache):
        clean_value = clean_cache[hook.name][:, :, head_index, :].clone()
        corrupted_head_vector = corrupted_head_vector.clone()
        corrupted_head_vector[:, :, head_index : head_index + 1, :] = clean_value.unsqueeze(2)
        return corrupted_head_vector

    def patch_head_pattern(corrupted_head_pattern, hook, head_index, clean_cache):
        clean_value = clean_cache[hook.name][:, head_index, :, :].clone()
        corrupted_head_pattern = corrupted_head_pattern.clone()
        corrupted_head_pattern[:, head_index : head_index + 1, :, :] = clean_value.unsqueeze(1)
        return corrupted_head_pattern

    every_head = patching.get_act_patch_attn_head_all_pos_every(model, corrupted_tokens, cache, metric)
    close(by_hand("z", patch_head_vector, model.cfg.n_heads), every_head[0])
    close(by_hand("v", patch_head_vector, model.cfg.n_heads), every_head[3])
    close(by_hand("attn", patch_head_pattern, model.cfg.n_heads), every_head[4])

    # circuitsvis on the top heads' patterns, and test_prompt, as the demo calls them
    from circuitsvis.attention import attention_heads

    top_heads = torch.topk(per_head_logit_diffs.flatten(), k=3).indices
    patterns = torch.stack(
        [cache["attn", int(h) // model.cfg.n_heads][0, int(h) % model.cfg.n_heads] for h in top_heads]
    )
    html = attention_heads(
        attention=patterns,
        tokens=model.to_str_tokens(tokens[0]),
        attention_head_names=[f"L{int(h) // model.cfg.n_heads}H{int(h) % model.cfg.n_heads}" for h in top_heads],
    ).show_code()
    assert "Michelle" in html
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        utils.test_prompt(prompts[0], answers[0][0], model, prepend_bos=True, prepend_space_to_answer=False)
    logits = model(model.to_tokens(prompts[0], prepend_bos=True))[0, -1]
    rank = int((logits > logits[model.to_single_token(answers[0][0])]).sum())
    assert f"Rank: {rank} " in printed.getvalue()

    # Ablating the top head with a permanent hook that run_with_cache removes afterwards
    top = per_head_logit_diffs.flatten().argmax().item()
    top_layer, top_head = divmod(top, model.cfg.n_heads)

    def ablate_top_head_hook(z, hook):
        z = z.clone()
        z[:, -1, top_head, :] = 0
        return z

    model.blocks[top_layer].attn.hook_z.add_hook(ablate_top_head_hook)
    ablated_logits, _ablated_cache = model.run_with_cache(tokens)
    close(
        ablated_logits,
        model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{top_layer}.attn.hook_z", ablate_top_head_hook)]),
    )
    # TransformerLens 4 (HookedRootModule and TransformerBridge alike) removes only the hooks run_with_cache added
    # itself, despite the demo's comment: the ablation stays until reset_hooks, here as there
    close(model(tokens), ablated_logits)
    model.reset_hooks()
    close(model(tokens), original_logits)
    # "Average LN scaling ratio": the cached scale is the final stream's (centred) root mean square
    final = cache["resid_post", -1][:, -1]
    final = final - final.mean(-1, keepdim=True)
    close(cache["ln_final.hook_scale"][:, -1, 0], (final.pow(2).mean(-1) + model.cfg.norm_eps).sqrt())

    # Induction, previous- and duplicate-token scores from hooks on hook_pattern, against the cache
    seq_len, scores = 20, {}

    def score_hook(pattern, hook, offset, name):
        scores[name, hook.layer()] = pattern.diagonal(offset=offset, dim1=-1, dim2=-2).mean((0, -1))

    torch.manual_seed(0)
    repeated_tokens = einops.repeat(torch.randint(10, model.cfg.d_vocab, (2, seq_len)), "b s -> b (2 s)")

    def pattern_filter(act_name):
        return act_name.endswith("hook_pattern")

    loss = model.run_with_hooks(
        repeated_tokens,
        return_type="loss",
        fwd_hooks=[
            (pattern_filter, partial(score_hook, offset=1, name="prev")),
            (pattern_filter, partial(score_hook, offset=seq_len, name="dup")),
            (pattern_filter, partial(score_hook, offset=seq_len - 1, name="induction")),
        ],
    )
    close(loss, model.loss_fn(model(repeated_tokens), repeated_tokens))
    _, rep_cache = model.run_with_cache(repeated_tokens)
    pattern = rep_cache["pattern", 1]
    close(
        scores["induction", 1],
        torch.stack([pattern[:, h].diagonal(1 - seq_len, -2, -1).mean() for h in range(model.cfg.n_heads)]),
    )


def labels_of(cache) -> list[str]:
    return cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)[1]


@torch.no_grad()
def test_activation_patching_demo(model, ioi):
    clean_tokens, corrupted_tokens, clean_cache = ioi["clean_tokens"], ioi["corrupted_tokens"], ioi["clean_cache"]
    ioi_metric = ioi["ioi_metric"]
    close(ioi_metric(ioi["clean_logits"]), torch.tensor(1.0))  # "Clean Baseline is 1"
    close(ioi_metric(model(corrupted_tokens)), torch.tensor(0.0))  # "Corrupted Baseline is 0"
    resid_pre = patching.get_act_patch_resid_pre(model, corrupted_tokens, clean_cache, ioi_metric)
    position = differing_position(ioi)
    close(resid_pre[0, position], torch.tensor(1.0))
    # the last layer's stream at the last position decides the logits there: patching it gives the clean logits
    close(
        resid_pre[-1, -1],
        ioi_metric(
            model.run_with_hooks(
                corrupted_tokens,
                fwd_hooks=[
                    (
                        f"blocks.{model.cfg.n_layers - 1}.hook_resid_pre",
                        lambda x, hook: patch_last(x, clean_cache[hook.name]),
                    )
                ],
            )
        ),
    )
    all_pos = patching.get_act_patch_attn_head_out_all_pos(model, corrupted_tokens, clean_cache, ioi_metric)
    by_pos = patching.get_act_patch_attn_head_out_by_pos(model, corrupted_tokens, clean_cache, ioi_metric)
    every_block = patching.get_act_patch_block_every(model, corrupted_tokens, clean_cache, ioi_metric)
    every_head = patching.get_act_patch_attn_head_all_pos_every(model, corrupted_tokens, clean_cache, ioi_metric)
    close(every_block[0], resid_pre)
    close(every_head[0], all_pos)
    assert by_pos.shape == (model.cfg.n_layers, clean_tokens.shape[1], model.cfg.n_heads)
    # head output patched at every position at once = z of that head from the clean run, by hand
    layer, head = 1, 2

    def patch_z(z, hook):
        z[:, :, head] = clean_cache[hook.name][:, :, head]
        return z

    close(
        all_pos[layer, head],
        ioi_metric(model.run_with_hooks(corrupted_tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", patch_z)])),
    )


def patch_last(x, clean):
    x = x.clone()
    x[:, -1] = clean[:, -1]
    return x


def test_attribution_patching_demo(model, ioi):
    clean_tokens, corrupted_tokens, ioi_metric = ioi["clean_tokens"], ioi["corrupted_tokens"], ioi["ioi_metric"]

    def filter_not_qkv_input(name):
        return "_input" not in name

    def get_cache_fwd_and_bwd(model, tokens, metric):
        model.reset_hooks()
        grad_cache = {}

        def backward_cache_hook(act, hook):
            grad_cache[hook.name] = act.detach()

        model.add_hook(filter_not_qkv_input, backward_cache_hook, "bwd")
        output, fwd_cache = model.run_with_cache(tokens, names_filter=filter_not_qkv_input)
        value = metric(output)
        value.backward()
        model.reset_hooks()
        return value.item(), fwd_cache, ActivationCache(grad_cache, model)

    clean_value, clean_cache, clean_grad_cache = get_cache_fwd_and_bwd(model, clean_tokens, ioi_metric)
    assert abs(clean_value - 1.0) < 1e-5  # the demo's own asserts
    corrupted_value, corrupted_cache, corrupted_grad_cache = get_cache_fwd_and_bwd(model, corrupted_tokens, ioi_metric)
    assert abs(corrupted_value) < 1e-5
    # as in TransformerLens, hook_attn_in and hook_mlp_in fire only after set_use_attn_in / set_use_hook_mlp_in
    fired = [n for n in model.hook_dict if filter_not_qkv_input(n) and not n.endswith(("hook_attn_in", "hook_mlp_in"))]
    assert len(clean_grad_cache) == len(clean_cache) == len(fired)
    assert not any(p.grad is not None for p in model.parameters())  # the weights stay frozen

    # The gradients are the true ones: the same as an unfrozen copy's
    unfrozen = HookedDCFormer.from_pretrained(
        model_name(model), fold_ln=True, center_writing_weights=True, center_unembed=True
    ).requires_grad_(True)
    unfrozen.set_use_attn_result(True)
    _, _, reference = get_cache_fwd_and_bwd(unfrozen, corrupted_tokens, ioi_metric)
    for name in [
        "blocks.0.hook_resid_pre",
        "blocks.1.attn.hook_pattern",
        "blocks.2.attn.hook_result",
        "blocks.1.mlp.hook_post",
    ]:
        torch.testing.assert_close(corrupted_grad_cache[name], reference[name], rtol=1e-4, atol=1e-6, msg=name)

    # attention attribution and residual attribution patching, as written in the demo
    attention_attr = einops.rearrange(
        torch.stack([clean_grad_cache["pattern", l] for l in range(model.cfg.n_layers)])
        * torch.stack([clean_cache["pattern", l] for l in range(model.cfg.n_layers)]),
        "layer batch head_index dest src -> batch layer head_index dest src",
    )
    assert attention_attr.shape[:3] == (len(prompts), model.cfg.n_layers, model.cfg.n_heads)
    clean_residual, residual_labels = clean_cache.accumulated_resid(-1, incl_mid=INCL_MID, return_labels=True)
    corrupted_residual = corrupted_cache.accumulated_resid(-1, incl_mid=INCL_MID, return_labels=False)
    corrupted_grad_residual = corrupted_grad_cache.accumulated_resid(-1, incl_mid=INCL_MID, return_labels=False)
    residual_attr = einops.reduce(
        corrupted_grad_residual * (clean_residual - corrupted_residual),
        "component batch pos d_model -> component pos",
        "sum",
    )
    assert residual_attr.shape == (len(residual_labels), clean_tokens.shape[1]) and torch.isfinite(residual_attr).all()
    # layer outputs, head outputs, head vectors, patterns, head paths: the demo's functions as written
    clean_layer_out, labels = clean_cache.decompose_resid(-1, return_labels=True)
    layer_out_attr = einops.reduce(
        corrupted_grad_cache.decompose_resid(-1, return_labels=False)
        * (clean_layer_out - corrupted_cache.decompose_resid(-1, return_labels=False)),
        "component batch pos d_model -> component pos",
        "sum",
    )
    head_out_attr = einops.reduce(
        corrupted_grad_cache.stack_head_results(-1, return_labels=False)
        * (
            clean_cache.stack_head_results(-1, return_labels=False)
            - corrupted_cache.stack_head_results(-1, return_labels=False)
        ),
        "component batch pos d_model -> component pos",
        "sum",
    )
    # a layer's attention output is its heads' results plus b_O (the same in both runs): the attributions add up
    attn_rows = [i for i, label in enumerate(labels) if label.endswith("attn_out")]
    close(head_out_attr.reshape(model.cfg.n_layers, model.cfg.n_heads, -1).sum(1), layer_out_attr[attn_rows])

    def stack_head_vector_from_cache(cache, activation_name):
        stacked = torch.stack([cache[activation_name, l] for l in range(model.cfg.n_layers)], dim=0)
        return einops.rearrange(stacked, "layer batch pos head_index d_head -> (layer head_index) batch pos d_head")

    head_vector_attr = {}
    for activation_name in ["k", "q", "v", "z"]:
        head_vector_attr[activation_name] = einops.reduce(
            stack_head_vector_from_cache(corrupted_grad_cache, activation_name)
            * (
                stack_head_vector_from_cache(clean_cache, activation_name)
                - stack_head_vector_from_cache(corrupted_cache, activation_name)
            ),
            "component batch pos d_head -> component pos",
            "sum",
        )
    close(head_vector_attr["z"], head_out_attr)  # result = z W_O is linear in z: the same first-order effect

    def stacked_pattern(cache):
        return einops.rearrange(
            torch.stack([cache["pattern", l] for l in range(model.cfg.n_layers)], dim=0),
            "layer batch head_index dest_pos src_pos -> (layer head_index) batch dest_pos src_pos",
        )

    head_pattern_attr = einops.reduce(
        stacked_pattern(corrupted_grad_cache) * (stacked_pattern(clean_cache) - stacked_pattern(corrupted_cache)),
        "component batch dest_pos src_pos -> component dest_pos src_pos",
        "sum",
    )
    assert torch.isfinite(head_pattern_attr).all()

    def head_vector_grad_input(grad_cache, activation_name, layer):
        W = {"q": model.blocks[layer].attn.W_Q, "k": model.blocks[layer].attn.W_K, "v": model.blocks[layer].attn.W_V}[
            activation_name
        ]
        return einops.einsum(
            grad_cache[activation_name, layer],
            grad_cache["scale", layer, "ln1"].squeeze(-1),
            W,
            "batch pos head_index d_head, batch pos, head_index d_model d_head -> batch pos head_index d_model",
        )

    full_vector_grad_input = torch.stack(
        [
            torch.stack([head_vector_grad_input(corrupted_grad_cache, name, l) for l in range(model.cfg.n_layers)])
            for name in "qkv"
        ]
    )
    diff_head_result = einops.rearrange(
        clean_cache.stack_head_results(-1) - corrupted_cache.stack_head_results(-1),
        "(layer head_index) batch pos d_model -> layer batch pos head_index d_model",
        layer=model.cfg.n_layers,
        head_index=model.cfg.n_heads,
    )
    path_attr = einops.einsum(
        full_vector_grad_input,
        diff_head_result,
        "qkv layer_end batch pos head_end d_model, layer_start batch pos head_start d_model -> "
        "qkv layer_end head_end layer_start head_start pos",
    )
    assert (
        path_attr.shape
        == (3, model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_layers, model.cfg.n_heads, clean_tokens.shape[1])
        and torch.isfinite(path_attr).all()
    )

    # the gradient is the derivative: a small step along (clean - corrupted) at the final stream changes the
    # metric by the attribution times the step
    step = 1e-3
    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    delta = clean_cache[last] - corrupted_cache[last]

    def nudge(x, hook):
        return x + step * delta

    with torch.no_grad():
        nudged = ioi_metric(model.run_with_hooks(corrupted_tokens, fwd_hooks=[(last, nudge)])).item()
    predicted = (corrupted_grad_cache[last] * delta).sum().item() * step
    assert abs((nudged - corrupted_value) - predicted) < 1e-3 * abs(predicted) + 1e-6


def model_name(model) -> str:
    return "dcpythia-synth" if model.cfg.use_dcmha else "pythia-synth"


@torch.no_grad()
def test_main_demo(model):
    text = "Michelle has a burger . Helen has a cat . Michelle owns a kind of food . Helen owns a kind of animal ."
    loss = model(text, return_type="loss")
    tokens = model.to_tokens(text)
    logits, cache = model.run_with_cache(tokens, remove_batch_dim=True)
    close(loss, model.loss_fn(logits, tokens))
    by_hand = -logits[0, :-1].log_softmax(-1).gather(-1, tokens[0, 1:, None]).mean()
    close(loss, by_hand)
    attention_pattern = cache["pattern", 0, "attn"]
    assert attention_pattern.shape == (model.cfg.n_heads, tokens.shape[1], tokens.shape[1])
    _, attn_cache = model.run_with_cache(
        tokens, remove_batch_dim=True, stop_at_layer=1, names_filter=["blocks.0.attn.hook_pattern"]
    )
    assert torch.allclose(attn_cache["blocks.0.attn.hook_pattern"], attention_pattern)

    # Ablating head 1's values of layer 0: the same model as one whose W_V and b_V of that head are zero
    layer_to_ablate, head_index_to_ablate = 0, 1

    def head_ablation_hook(value, hook):
        value[:, :, head_index_to_ablate, :] = 0.0
        return value

    ablated_loss = model.run_with_hooks(
        tokens, return_type="loss", fwd_hooks=[(utils.get_act_name("v", layer_to_ablate), head_ablation_hook)]
    )
    weights = {name: p.clone() for name, p in model.named_parameters()}
    try:
        model.blocks[layer_to_ablate].attn.W_V[head_index_to_ablate] = 0
        model.blocks[layer_to_ablate].attn.b_V[head_index_to_ablate] = 0
        close(ablated_loss, model(tokens, return_type="loss"))
    finally:
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    assert (ablated_loss - loss).abs() > 1e-4

    # Residual-stream patching on a clean / corrupted pair: 1 where the only differing token is patched in
    clean_tokens, corrupted_tokens = model.to_tokens(prompts[0]), model.to_tokens(prompts[1])
    correct, incorrect = model.to_single_token(answers[0][0]), model.to_single_token(answers[0][1])

    def logits_to_logit_diff(logits):
        return logits[0, -1, correct] - logits[0, -1, incorrect]

    clean_logits, clean_cache = model.run_with_cache(clean_tokens)
    clean_logit_diff = logits_to_logit_diff(clean_logits)
    corrupted_logit_diff = logits_to_logit_diff(model(corrupted_tokens))

    def residual_stream_patching_hook(resid_pre, hook, position):
        resid_pre[:, position, :] = clean_cache[hook.name][:, position, :]
        return resid_pre

    position = (clean_tokens[0] != corrupted_tokens[0]).nonzero().item()
    patched = model.run_with_hooks(
        corrupted_tokens,
        fwd_hooks=[(utils.get_act_name("in", 0), partial(residual_stream_patching_hook, position=position))],
    )
    close(
        (logits_to_logit_diff(patched) - corrupted_logit_diff) / (clean_logit_diff - corrupted_logit_diff),
        torch.tensor(1.0),
    )

    # Loss by position on repeated random tokens, per token, and induction scores from hooks
    torch.manual_seed(0)
    seq_len = 20
    repeated_tokens = einops.repeat(torch.randint(10, model.cfg.d_vocab, (4, seq_len)), "b s -> b (2 s)")
    repeated_logits = model(repeated_tokens)
    correct_log_probs = model.loss_fn(repeated_logits, repeated_tokens, per_token=True)
    close(correct_log_probs, model(repeated_tokens, return_type="loss", loss_per_token=True))
    induction_score_store = torch.zeros(model.cfg.n_layers, model.cfg.n_heads)

    def induction_score_hook(pattern, hook):
        induction_stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - seq_len)
        induction_score_store[hook.layer(), :] = einops.reduce(
            induction_stripe, "batch head_index position -> head_index", "mean"
        )

    model.run_with_hooks(
        repeated_tokens, return_type=None, fwd_hooks=[(lambda name: name.endswith("pattern"), induction_score_hook)]
    )
    _, rep_cache = model.run_with_cache(repeated_tokens)
    # the filter `endswith("pattern")` also matches DCMHA's hook_composed_pattern, which runs after hook_pattern: the
    # scores stored last are the composed pattern's (what multiplies V); hook_pattern alone needs "hook_pattern"
    last = "blocks.2.attn.hook_composed_pattern" if model.cfg.use_dcmha else "blocks.2.attn.hook_pattern"
    close(induction_score_store[2], rep_cache[last].diagonal(1 - seq_len, -2, -1).mean((0, -1)))

    # Parameters and hook names, b_U, tokens, positions, BOS
    names = [name for name, _ in model.tl_named_parameters()]
    assert "blocks.0.attn.W_Q" in names and "unembed.W_U" in names and "unembed.b_U" in names
    seen = []
    model.run_with_hooks(
        "Ruth owns a cat",
        return_type=None,
        fwd_hooks=[
            (
                lambda name: name.startswith("blocks.0.") or not name.startswith("blocks"),
                lambda activation, hook: seen.append(hook.name),
            )
        ],
    )
    assert seen[0] == "hook_embed" and seen[-1] == "ln_final.hook_normalized" and "blocks.0.attn.hook_z" in seen
    # b_U after fold_ln + center_unembed: the final LayerNorm's bias through W_U, centred over the vocabulary
    raw = HookedDCFormer.from_pretrained(model_name(model))
    b_U = raw.ln_final.b @ raw.W_U
    close(model.unembed.b_U, b_U - b_U.mean())
    _bias_values, bias_indices = model.unembed.b_U.sort(descending=True)
    assert isinstance(model.to_string(bias_indices[0]), str)
    assert model.to_str_tokens("Ruth owns a cat .") == ["Ruth", "owns", "a", "cat", "."]
    multi = model.to_tokens(["Ruth owns a cat .", "Ruth owns a cat . Ruth owns a dog ."])
    assert multi.shape == (2, 10) and (multi[0, 5:] == model.tokenizer.pad_token_id).all()
    cat_probs = model("Ruth owns a cat").softmax(dim=-1)
    assert cat_probs.shape == (1, 4, model.cfg.d_vocab)
    assert model.get_token_position("cat", "Ruth owns a cat") == 3
    assert model.get_token_position("cat", "Ruth owns a cat", prepend_bos=True) == 4
    assert model.get_token_position("cat", "a cat . a cat", mode="last") == 4
    assert model("Ruth owns a cat", prepend_bos=True).shape[1] == 5 and model("Ruth owns a cat").shape[1] == 4

    # FactoredMatrix circuits: model.OV and the full OV circuit W_E OV W_U, against their dense products
    OV = model.OV
    dense = model.W_V[1, 0] @ model.W_O[1, 0]
    close(OV.AB[1, 0], dense)
    full_OV_circuit = model.embed.W_E @ OV @ model.unembed.W_U
    close(full_OV_circuit[1, 0].AB[:5, :5], (model.W_E[:5] @ dense @ model.W_U[:, :5]))
    eigenvalues = OV.eigenvalues
    assert eigenvalues.shape == (model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_head)
    generated = model.generate("Ruth owns a", max_new_tokens=5, temperature=0.7, stop_at_eos=False)
    assert generated.startswith("Ruth owns a")
