"""Attention views in a browser: one self-contained HTML page per layer, drawn with circuitsvis.

    from dcinterp.views import write_attention_page
    write_attention_page(model, "Michelle has a burger. ... Michelle owns a kind of", layer=2, path="attention_L2.html")

The page shows every head of the layer twice, with the prompt's tokens: the pattern P before post-compose
(`hook_pattern`, a probability distribution over keys, scale 0..1) and the composed pattern P' after it
(`hook_composed_pattern`, what multiplies V: signed and not normalised, on a blue-white-red scale centred at 0,
the same scale for every head). A plain-MHA model has only the first. circuitsvis's JavaScript bundle is
inlined: the file opens offline, with no call to the network.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .model import HookedDCFormer

NEGATIVE_COLOR, POSITIVE_COLOR = "#2166ac", "#b2182b"  # ends of a diverging blue-red scale


@torch.no_grad()
def layer_patterns(
    model: HookedDCFormer, tokens: Int[Tensor, "1 pos"], layer: int
) -> dict[str, Float[Tensor, "head query key"]]:
    """The layer's pattern before post-compose and, for DCMHA, after it, for one prompt (float32, CPU).

    Args:
        model: the model.
        tokens: one prompt [1, pos].
        layer: the layer.

    Returns:
        Each pattern [head, query, key], by name.
    """
    attn = f"blocks.{layer}.attn"
    names = {"pattern": f"{attn}.hook_pattern"}
    if model.cfg.use_dcmha:
        names["composed_pattern"] = f"{attn}.hook_composed_pattern"
    _, cache = model.run_with_cache(tokens, names_filter=list(names.values()), stop_at_layer=layer + 1)
    return {key: cache[name][0].float().cpu() for key, name in names.items()}


def circuitsvis_bundle() -> str:
    """circuitsvis's browser bundle (defines the global `CircuitsVis`), safe to inline in a `<script>` element."""
    import circuitsvis

    bundle = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
    return bundle.read_text(encoding="utf-8").replace("</script>", "<\\/script>")


def _heads_view(element_id: str, pattern: Tensor, tokens: list[str], signed: bool) -> tuple[str, str]:
    """(the <div>, the JavaScript call) drawing one AttentionHeads view of `pattern` [head, query, key]."""
    limit = float(pattern.abs().max()) if signed else 1.0
    props = {
        "attention": pattern.double().round(decimals=4).tolist(),  # 4 decimals: a page a third the size
        "tokens": tokens,
        "attentionHeadNames": [f"H{h}" for h in range(pattern.shape[0])],
        "maxValue": limit,
        "minValue": -limit if signed else 0.0,
        "negativeColor": NEGATIVE_COLOR,
        "positiveColor": POSITIVE_COLOR,
        "maskUpperTri": True,
    }
    call = f"CircuitsVis.render({json.dumps(element_id)}, CircuitsVis.AttentionHeads, {json.dumps(props)});"
    return f'<div id="{element_id}"></div>', call


def attention_page(
    model: HookedDCFormer, prompt: str | Int[Tensor, " pos"], layer: int, str_tokens: list[str] | None = None
) -> str:
    """The HTML of one layer's attention page for one prompt.

    Args:
        model: the model.
        prompt: text, or token ids [pos] / [1, pos].
        layer: the layer.
        str_tokens: one axis label per token (None: the prompt's tokens).

    Returns:
        The page's HTML.

    Raises:
        ValueError: a layer out of range, or as many labels as tokens not given.
    """
    if not 0 <= layer < model.cfg.n_layers:
        raise ValueError(f"layer: {layer} is not a layer of this model (0..{model.cfg.n_layers - 1})")
    tokens = model.to_tokens(prompt) if isinstance(prompt, str) else torch.as_tensor(prompt).reshape(1, -1)
    if str_tokens is None:
        str_tokens = model.to_str_tokens(tokens[0])
    elif len(str_tokens) != tokens.shape[1]:
        raise ValueError(f"str_tokens: {len(str_tokens)} labels for {tokens.shape[1]} tokens")
    patterns = layer_patterns(model, tokens, layer)
    sections = [
        (
            "pattern",
            "Before post-compose: P = softmax(scores), <code>hook_pattern</code>. Each row sums to 1.",
            patterns["pattern"],
            False,
        )
    ]
    if "composed_pattern" in patterns:
        limit = float(patterns["composed_pattern"].abs().max())
        sections.append(
            (
                "composed_pattern",
                "After post-compose: P' = P + o_qp + o_kp + o_qg + o_kg, <code>hook_composed_pattern</code>, what "
                "multiplies V. Signed, rows need not sum to 1; blue &lt; 0 &lt; red, one scale for every head "
                f"(&plusmn;{limit:.3g}).",
                patterns["composed_pattern"],
                True,
            )
        )
    title = f"{html.escape(model.cfg.model_name)}, layer {layer}: attention of every head"
    body, calls = [], []
    for name, caption, pattern, signed in sections:
        div, call = _heads_view(f"{name}-L{layer}", pattern, str_tokens, signed)
        body.append(f"<h2>{caption}</h2>\n{div}")
        calls.append(call)
    prompt_text = html.escape(" ".join(str_tokens))
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>{title}</title>
<style>body {{ font-family: sans-serif; margin: 1.5em; }} h2 {{ font-size: 1em; font-weight: normal; }}</style>
</head>
<body>
<h1 style="font-size: 1.2em">{title}</h1>
<p>Prompt ({len(str_tokens)} tokens): <span id="prompt">{prompt_text}</span>.
Rows are queries, columns keys; keys a query cannot see are grey (future) or white (outside a local window).
Hover a head to zoom on it, click to lock it.</p>
{chr(10).join(body)}
<script>{circuitsvis_bundle()}</script>
<script>
{chr(10).join(calls)}
</script>
</body>
</html>
"""


def write_attention_page(
    model: HookedDCFormer, prompt: str | Int[Tensor, " pos"], layer: int, path, str_tokens: list[str] | None = None
) -> Path:
    """Write `attention_page` to `path`, a self-contained .html file.

    Args:
        model: as `attention_page`.
        prompt: as `attention_page`.
        layer: as `attention_page`.
        path: the file.
        str_tokens: as `attention_page`.

    Returns:
        The path.
    """
    page = attention_page(model, prompt, layer, str_tokens)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
