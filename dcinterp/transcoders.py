"""Per-layer transcoders for a HookedDCFormer: each layer's MLP input -> MLP output, through sparse features.

A transcoder of layer l reads what the layer's MLP reads, `blocks.{l}.ln2.hook_normalized` (the normed stream:
ln2 of the block's input with DCFormer's and Pythia's parallel residual, ln2 of the stream after attention with a
serial one), and predicts what it writes, `blocks.{l}.hook_mlp_out`:

    pre = x W_enc + b_enc,   a = act(pre),   out = a W_dec + b_dec

with act ReLU, JumpReLU (a = pre where pre > threshold, else 0) or TopK (the k largest pre-activations of each
token, where positive). `dcinterp.attribution_graph` replaces the MLPs by them.

Saved layout (`save_transcoders`): a folder with `layer_{l}.safetensors` for each layer (keys `W_enc`
[d_transcoder, d_model], `W_dec` [d_transcoder, d_model], `b_enc`, `b_dec`, and `activation_function.threshold`
for JumpReLU) and a `config.yaml` (written as JSON, which YAML reads) with circuit-tracer's keys (`model_kind:
transcoder_set`, `feature_input_hook`, `feature_output_hook`, `transcoders`: the layer files) and dcinterp's
(`activation`, `k`, `d_model`, `d_transcoder`, per-layer metrics). That is the layout circuit-tracer 0.5's
`load_transcoder_set` reads (`load_relu_transcoder` for each layer; it knows ReLU and JumpReLU, not TopK). In memory
`W_enc` is [d_model, d_transcoder], as in SAELens.

Why a trainer of its own (`train_transcoders`): SAELens pins TransformerLens < 4 (dcinterp runs on 4), and
EleutherAI's `eai-sparsify` trains on a Hugging Face `PreTrainedModel`'s submodules (`model.base_model`) from a
Hugging Face dataset, and trains TopK coders only; neither reads dcinterp's hook points. The trainer here streams
a model's MLP inputs and outputs over a corpus in batches (nothing cached on disk) and fits ReLU transcoders with
a decoder-norm-weighted L1 penalty (Anthropic's recipe), or TopK ones.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .loading import EMBEDDED_DIR

FEATURE_INPUT_HOOK = "ln2.hook_normalized"  # under blocks.{l}: what the MLP reads
FEATURE_OUTPUT_HOOK = "hook_mlp_out"  # under blocks.{l}: what the MLP writes
ACTIVATIONS = ("relu", "jumprelu", "topk")


class Transcoder(nn.Module):
    """One layer's transcoder: MLP input [..., d_model] -> sparse features [..., d_transcoder] -> MLP output.

    Args:
        d_model: the model's residual width.
        d_transcoder: the number of features.
        layer: the layer whose MLP it replaces.
        activation: "relu", "jumprelu" (with `threshold`) or "topk" (with `k`).
        k: features kept per token for "topk".

    Raises:
        ValueError: an unknown activation, or "topk" without a positive k.
    """

    def __init__(self, d_model: int, d_transcoder: int, layer: int, activation: str = "relu", k: int | None = None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"Transcoder: activation {activation!r}, expected one of {ACTIVATIONS}")
        if activation == "topk" and not (k and k > 0):
            raise ValueError("Transcoder: activation 'topk' needs k > 0")
        self.d_model, self.d_transcoder, self.layer = d_model, d_transcoder, layer
        self.activation, self.k = activation, k
        self.W_enc = nn.Parameter(torch.zeros(d_model, d_transcoder))
        self.b_enc = nn.Parameter(torch.zeros(d_transcoder))
        self.W_dec = nn.Parameter(torch.zeros(d_transcoder, d_model))
        self.b_dec = nn.Parameter(torch.zeros(d_model))
        self.threshold = nn.Parameter(torch.zeros(d_transcoder)) if activation == "jumprelu" else None

    def pre_activation(self, x: Tensor) -> Tensor:
        """x W_enc + b_enc: [..., d_model] -> [..., d_transcoder], what a feature node's incoming edges sum to."""
        return x @ self.W_enc + self.b_enc

    def activate(self, pre: Tensor) -> Tensor:
        """The activation function on pre-activations [..., d_transcoder]."""
        if self.activation == "relu":
            return pre.relu()
        if self.activation == "jumprelu":
            return pre * (pre > self.threshold)
        top = pre.topk(min(self.k, pre.shape[-1]), dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())

    def encode(self, x: Tensor) -> Tensor:
        """Feature activations [..., d_transcoder] of MLP inputs [..., d_model]."""
        return self.activate(self.pre_activation(x))

    def decode(self, acts: Tensor) -> Tensor:
        """The predicted MLP output [..., d_model] of feature activations [..., d_transcoder]."""
        return acts @ self.W_dec + self.b_dec

    def forward(self, x: Tensor) -> Tensor:
        """The predicted MLP output of MLP inputs x [..., d_model]."""
        return self.decode(self.encode(x))


def random_transcoders(
    model, d_transcoder: int, activation: str = "relu", k: int | None = None, seed: int = 0, scale: float = 1.0
) -> list[Transcoder]:
    """Transcoders with random weights for every layer of `model` (tests, and timing at a model's shape).

    Encoder columns and decoder rows are random unit vectors times `scale`; encoder biases are set so that about
    one feature in eight is active on an input of unit variance per coordinate (a normed stream).

    Args:
        model: a HookedDCFormer (its cfg gives d_model, n_layers, and the dtype and device of its weights).
        d_transcoder: features per layer.
        activation: as `Transcoder`.
        k: as `Transcoder`.
        seed: the random seed.
        scale: the norm of each encoder and decoder vector.

    Returns:
        One `Transcoder` per layer, in the model's dtype and on its device.
    """
    generator = torch.Generator().manual_seed(seed)
    d_model, weight = model.cfg.d_model, model.unembed.W_U
    transcoders = []
    for layer in range(model.cfg.n_layers):
        tc = Transcoder(d_model, d_transcoder, layer, activation, k)
        with torch.no_grad():
            enc = torch.randn(d_model, d_transcoder, generator=generator, dtype=torch.float64)
            dec = torch.randn(d_transcoder, d_model, generator=generator, dtype=torch.float64)
            tc.W_enc.copy_(scale * enc / enc.norm(dim=0))
            tc.W_dec.copy_(scale * dec / dec.norm(dim=1, keepdim=True))
            tc.b_enc.fill_(-1.15 * scale)  # P(N(0, scale²) > 1.15 scale) is about 1/8
            tc.b_dec.copy_(0.01 * torch.randn(d_model, generator=generator, dtype=torch.float64))
            if tc.threshold is not None:
                tc.threshold.fill_(0.1 * scale)
        transcoders.append(tc.to(device=weight.device, dtype=weight.dtype).requires_grad_(False))
    return transcoders


def save_transcoders(
    transcoders: list[Transcoder], directory: str | Path, metrics: list[dict] | None = None, info: dict | None = None
) -> Path:
    """Write transcoders in circuit-tracer's `transcoder_set` layout (see the module docstring).

    Args:
        transcoders: one per layer, layer 0 first.
        directory: the folder to write (created; files in it of the same names are replaced).
        metrics: per layer, what `transcoder_metrics` gives, stored in the config.
        info: how they were made (corpus, settings), stored in the config as it is.

    Returns:
        The path of the config file.

    Raises:
        ValueError: transcoders that are not one per layer from 0, or of different activations or widths.
    """
    if [tc.layer for tc in transcoders] != list(range(len(transcoders))) or not transcoders:
        raise ValueError("save_transcoders: need one transcoder per layer, layers 0, 1, ... in order")
    first = transcoders[0]
    if any(
        (tc.activation, tc.k, tc.d_transcoder) != (first.activation, first.k, first.d_transcoder) for tc in transcoders
    ):
        raise ValueError("save_transcoders: every layer's transcoder needs the same activation, k and width")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for tc in transcoders:
        tensors = {
            "W_enc": tc.W_enc.detach().T.contiguous().cpu(),
            "W_dec": tc.W_dec.detach().contiguous().cpu(),
            "b_enc": tc.b_enc.detach().cpu(),
            "b_dec": tc.b_dec.detach().cpu(),
        }
        if tc.threshold is not None:
            tensors["activation_function.threshold"] = tc.threshold.detach().cpu()
        save_file(tensors, directory / f"layer_{tc.layer}.safetensors")
        files.append(f"layer_{tc.layer}.safetensors")
    config = {
        "model_kind": "transcoder_set",
        "feature_input_hook": FEATURE_INPUT_HOOK,
        "feature_output_hook": FEATURE_OUTPUT_HOOK,
        "transcoders": files,
        "activation": first.activation,
        "k": first.k,
        "d_model": first.d_model,
        "d_transcoder": first.d_transcoder,
        "metrics": metrics,
        "info": info,
    }
    path = directory / "config.yaml"
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


def load_transcoders(directory: str | Path, device=None, dtype: torch.dtype | None = None) -> list[Transcoder]:
    """Read transcoders that `save_transcoders` wrote.

    Args:
        directory: the folder with `config.yaml` and the layer files, or an embedded model's name
            (`dcpythia-synth`, `pythia-synth`: the transcoders shipped beside it).
        device: where to put them (default: the CPU).
        dtype: their dtype (default: as stored).

    Returns:
        One `Transcoder` per layer, gradients off.

    Raises:
        ValueError: a missing or unreadable config or layer file, or a key missing from one (the file named).
    """
    directory = Path(directory)
    if not directory.is_dir() and (EMBEDDED_DIR / str(directory) / "transcoders").is_dir():
        directory = EMBEDDED_DIR / str(directory) / "transcoders"
    config_path = directory / "config.yaml"
    try:
        config = json.loads(config_path.read_text())
        files, activation, k = config["transcoders"], config.get("activation", "relu"), config.get("k")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"load_transcoders: {config_path}: not a transcoder config ({error})") from None
    transcoders = []
    for layer, name in enumerate(files):
        path = directory / name
        try:
            tensors = load_file(path)
            d_transcoder, d_model = tensors["W_enc"].shape
            tc = Transcoder(d_model, d_transcoder, layer, activation, k)
            state = {
                "W_enc": tensors["W_enc"].T,
                "W_dec": tensors["W_dec"],
                "b_enc": tensors["b_enc"],
                "b_dec": tensors["b_dec"],
            }
            if activation == "jumprelu":
                state["threshold"] = tensors["activation_function.threshold"]
            tc.load_state_dict(state)
        except (OSError, KeyError, RuntimeError, ValueError, SafetensorError) as error:
            raise ValueError(f"load_transcoders: {path}: {error}") from None
        transcoders.append(tc.to(device=device, dtype=dtype or tensors["W_enc"].dtype).requires_grad_(False))
    return transcoders


# ----------------------------------------------------------------------------------------------
# Activations, streamed over a corpus


def read_corpus(path: str | Path, key: str = "text") -> list[str]:
    """The texts of a corpus file: JSON lines (`.jsonl`, each line an object whose `key` is a text, or a string) or
    plain text (one text a non-empty line).

    Args:
        path: the file.
        key: the field that holds the text in JSON lines.

    Returns:
        The texts, in file order.

    Raises:
        ValueError: an unreadable file, a line that is not JSON or lacks the key (the line named), or no text.
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ValueError(f"read_corpus: {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"read_corpus: {path}: not UTF-8 text") from None
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            texts.append(line)
            continue
        try:
            value = json.loads(line)
            texts.append(value if isinstance(value, str) else value[key])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"read_corpus: {path}, line {number}: not a JSON string or object with {key!r}") from None
    if not texts:
        raise ValueError(f"read_corpus: {path}: no text")
    return texts


def token_batches(model, texts: Iterable[str], batch_size: int, seq_len: int) -> Iterator[Tensor]:
    """The texts tokenized, concatenated and cut into [batch_size, seq_len] batches (the last partial one dropped).

    Args:
        model: a HookedDCFormer with a tokenizer.
        texts: the corpus.
        batch_size: rows a batch.
        seq_len: tokens a row.

    Yields:
        Token batches on the model's input device.
    """
    buffer: list[int] = []
    size = batch_size * seq_len
    for text in texts:
        buffer.extend(model.to_tokens(text, prepend_bos=False)[0].tolist())
        while len(buffer) >= size:
            yield torch.tensor(buffer[:size], device=model.input_device).view(batch_size, seq_len)
            buffer = buffer[size:]


def mlp_activations(model, tokens: Tensor, layers: Iterable[int]) -> dict[int, tuple[Tensor, Tensor]]:
    """Each layer's MLP input and output on a token batch, flattened over batch and positions.

    Args:
        model: a HookedDCFormer.
        tokens: [batch, pos].
        layers: the layers to read.

    Returns:
        {layer: (input [batch * pos, d_model], output [batch * pos, d_model])}.
    """
    layers = list(layers)
    names = {f"blocks.{layer}.{hook}" for layer in layers for hook in (FEATURE_INPUT_HOOK, FEATURE_OUTPUT_HOOK)}
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in names)
    d = model.cfg.d_model
    return {
        layer: (
            cache[f"blocks.{layer}.{FEATURE_INPUT_HOOK}"].reshape(-1, d),
            cache[f"blocks.{layer}.{FEATURE_OUTPUT_HOOK}"].reshape(-1, d),
        )
        for layer in layers
    }


# ----------------------------------------------------------------------------------------------
# Training


@dataclass
class TrainConfig:
    """How `train_transcoders` trains.

    Attributes:
        d_transcoder: features a layer.
        activation: "relu" (with the L1 penalty) or "topk".
        k: features a token for "topk".
        l1_coefficient: weight of the sparsity penalty (relu; see `transcoder_loss`).
        lr: Adam's learning rate.
        batch_size: rows of tokens a step.
        seq_len: tokens a row.
        steps: optimiser steps (the corpus is cycled, shuffled each pass, if it runs out).
        seed: seeds the initialisation and the shuffling.
    """

    d_transcoder: int = 512
    activation: str = "relu"
    k: int | None = None
    l1_coefficient: float = 3e-3
    lr: float = 1e-3
    batch_size: int = 16
    seq_len: int = 64
    steps: int = 2000
    seed: int = 0


def init_transcoder(layer: int, inputs: Tensor, outputs: Tensor, config: TrainConfig) -> Transcoder:
    """A transcoder initialised from a first batch: random unit decoder rows, the encoder their transpose scaled to
    the inputs' norm, b_dec the outputs' mean."""
    generator = torch.Generator().manual_seed(config.seed + layer)
    d_model = inputs.shape[1]
    tc = Transcoder(d_model, config.d_transcoder, layer, config.activation, config.k)
    with torch.no_grad():
        dec = torch.randn(config.d_transcoder, d_model, generator=generator)
        dec = dec / dec.norm(dim=1, keepdim=True) * 0.1
        tc.W_dec.copy_(dec)
        tc.W_enc.copy_(dec.T / inputs.float().norm(dim=1).mean().clamp_min(1e-6) * math.sqrt(d_model) * 10)
        tc.b_dec.copy_(outputs.float().mean(0))
    return tc.to(inputs.device)


def transcoder_loss(tc: Transcoder, inputs: Tensor, outputs: Tensor, l1_coefficient: float) -> tuple[Tensor, Tensor]:
    """(loss, acts) on a batch of tokens: the squared error over the outputs' variance (the batch's fraction of
    variance unexplained), plus, for ReLU, `l1_coefficient` times the mean over tokens of sum_i a_i ||W_dec[i]||
    over the outputs' standard deviation. Both terms are unchanged when the outputs are scaled, so one coefficient
    fits every layer.

    Args:
        tc: the transcoder.
        inputs: MLP inputs [tokens, d_model].
        outputs: MLP outputs [tokens, d_model].
        l1_coefficient: the sparsity penalty's weight.

    Returns:
        (the loss, the feature activations [tokens, d_transcoder]).
    """
    acts = tc.encode(inputs)
    variance = (outputs - outputs.mean(0)).pow(2).sum(-1).mean().clamp_min(1e-12)
    loss = (tc.decode(acts) - outputs).pow(2).sum(-1).mean() / variance
    if tc.activation == "relu" and l1_coefficient:
        loss = loss + l1_coefficient * (acts * tc.W_dec.norm(dim=1)).sum(-1).mean() / variance.sqrt()
    return loss, acts


def train_transcoders(
    model, texts: list[str], config: TrainConfig, layers: Iterable[int] | None = None, log=None
) -> list[Transcoder]:
    """Train one transcoder per layer on the model's own MLP activations, streamed over `texts` in batches.

    Args:
        model: a HookedDCFormer with a tokenizer.
        texts: the corpus.
        config: the training settings.
        layers: the layers (default: all).
        log: called as log(step, {layer: loss}) every 100 steps, if given.

    Returns:
        The trained transcoders, gradients off, in float32 on the model's device.

    Raises:
        ValueError: a corpus too short for one batch.
    """
    layers = list(range(model.cfg.n_layers) if layers is None else layers)
    rng = random.Random(config.seed)
    transcoders: dict[int, Transcoder] = {}
    optimisers: dict[int, torch.optim.Optimizer] = {}
    step = 0
    while step < config.steps:
        order = list(texts)
        rng.shuffle(order)
        batches = token_batches(model, order, config.batch_size, config.seq_len)
        progressed = False
        for tokens in batches:
            progressed = True
            activations = mlp_activations(model, tokens, layers)
            losses = {}
            for layer, (inputs, outputs) in activations.items():
                inputs, outputs = inputs.float(), outputs.float()
                if layer not in transcoders:
                    transcoders[layer] = init_transcoder(layer, inputs, outputs, config)
                    optimisers[layer] = torch.optim.Adam(transcoders[layer].parameters(), lr=config.lr)
                tc, optimiser = transcoders[layer], optimisers[layer]
                loss, _ = transcoder_loss(tc, inputs, outputs, config.l1_coefficient)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                losses[layer] = loss.item()
            step += 1
            if log is not None and step % 100 == 0:
                log(step, losses)
            if step >= config.steps:
                break
        if not progressed:
            raise ValueError(
                f"train_transcoders: the corpus has fewer than batch_size * seq_len = "
                f"{config.batch_size * config.seq_len} tokens"
            )
    return [transcoders[layer].requires_grad_(False) for layer in layers]


def transcoder_metrics(model, transcoders: list[Transcoder], batches: Iterable[Tensor]) -> list[dict[str, float]]:
    """Per transcoder, over token batches: the fraction of the MLP output's variance it leaves unexplained (`fvu`:
    squared error over the output's squared distance from its mean, summed over the batches), its mean L0 (active
    features a token) and the fraction of features never active (`dead`).

    Args:
        model: a HookedDCFormer.
        transcoders: one per layer to measure (each its `layer`).
        batches: token batches [batch, pos].

    Returns:
        One dict (layer, fvu, l0, dead) per transcoder, in the order given.

    Raises:
        ValueError: no batch.
    """
    sums = {tc.layer: dict(error=0.0, outputs=[], l0=0.0, tokens=0, fired=None) for tc in transcoders}
    for tokens in batches:
        activations = mlp_activations(model, tokens, sums)
        for tc in transcoders:
            inputs, outputs = (t.to(tc.W_enc.dtype) for t in activations[tc.layer])
            with torch.no_grad():
                acts = tc.encode(inputs)
                error = (tc.decode(acts) - outputs).pow(2).sum().item()
            s = sums[tc.layer]
            s["error"] += error
            s["outputs"].append(outputs.double().cpu())
            s["l0"] += (acts != 0).sum().item()
            s["tokens"] += acts.shape[0]
            fired = (acts != 0).any(0)
            s["fired"] = fired if s["fired"] is None else s["fired"] | fired
    metrics = []
    for tc in transcoders:
        s = sums[tc.layer]
        if not s["tokens"]:
            raise ValueError("transcoder_metrics: no token batch")
        outputs = torch.cat(s["outputs"])
        variance = (outputs - outputs.mean(0)).pow(2).sum().item()
        metrics.append(
            dict(
                layer=tc.layer,
                fvu=s["error"] / variance if variance > 0 else float("inf"),
                l0=s["l0"] / s["tokens"],
                dead=1 - s["fired"].float().mean().item(),
            )
        )
    return metrics


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    """`python -m dcinterp.transcoders --checkpoint C --corpus FILE --out DIR [...]`: train one transcoder a layer
    on a checkpoint's MLP activations over a corpus (text or JSON lines), measure them on `--eval-corpus` (default:
    the corpus), and write them to DIR (written beside it first, so that a failed run leaves nothing half-written).

    Args:
        argv: the arguments (default: sys.argv[1:]).

    Returns:
        The exit status: 0, or 1 after one line on stderr.
    """
    import shutil
    import sys
    import tempfile

    from .cli import Parser, check_writable_dir

    parser = Parser(prog="python -m dcinterp.transcoders", description=main.__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint folder or an embedded model's name")
    parser.add_argument("--corpus", required=True, type=Path, help="text (a text a line) or JSON lines ('text')")
    parser.add_argument("--eval-corpus", type=Path, help="what the metrics are measured on (default: --corpus)")
    parser.add_argument("--out", required=True, type=Path, help="the folder to write")
    parser.add_argument("--eval-batches", type=int, default=20, help="token batches the metrics read")
    parser.add_argument("--device", default="cpu")
    defaults = TrainConfig()
    for name, value in defaults.__dict__.items():
        kind = float if isinstance(value, float) else int if isinstance(value, int) or name == "k" else str
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value)
    args = parser.parse_args(argv)
    prog = parser.prog
    try:
        from . import HookedDCFormer

        check_writable_dir(args.out, "--out")
        config = TrainConfig(**{name: getattr(args, name) for name in defaults.__dict__})
        Transcoder(1, 1, 0, config.activation, config.k)  # the activation's settings, checked before any work
        texts = read_corpus(args.corpus)
        eval_texts = read_corpus(args.eval_corpus) if args.eval_corpus else texts
        model = HookedDCFormer.from_pretrained(args.checkpoint, device=args.device).eval().requires_grad_(False)
        log = lambda step, losses: print(f"step {step}: loss " + ", ".join(f"{v:.4g}" for v in losses.values()))  # noqa: E731
        transcoders = train_transcoders(model, texts, config, log=log)
        batches = itertools.islice(
            token_batches(model, eval_texts, config.batch_size, config.seq_len), args.eval_batches
        )
        metrics = transcoder_metrics(model, transcoders, batches)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.", dir=args.out.parent))
        save_transcoders(transcoders, staging, metrics)
        if args.out.exists():
            shutil.rmtree(args.out)
        staging.rename(args.out)
    except (ValueError, OSError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 1
    for m in metrics:
        print(f"layer {m['layer']}: fvu {m['fvu']:.4f}, l0 {m['l0']:.2f}, dead {m['dead']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
