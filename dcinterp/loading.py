"""Load checkpoints into HookedDCFormer, from local directories only; save in dcinterp's own format.

Formats, told apart by `config.json`'s `model_type`:
- `dcpythia`, `dcformer`: the authors' releases (Caiyun-AI/DCFormer), `.bin` or `.safetensors`, single or sharded;
- `gpt_neox`: Hugging Face Pythia checkpoints, loaded as the plain-MHA baseline;
- `dcinterp`: what `HookedDCFormer.save_pretrained` writes.
Nothing is downloaded and no code from the directory is run: `.bin` files are read with `weights_only=True`.
"""

from __future__ import annotations

import json
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file as save_safetensors
from torch import Tensor, nn

from .config import DCFormerConfig
from .conversion import (  # CheckpointError is imported from here by the rest of the package
    LEGACY_KEYS,
    CheckpointError,
    Taker,
    config_from_gpt_neox,
    config_from_official,
    convert_gpt_neox,
    convert_official,
    convert_own,
)
from .devices import check_device

if TYPE_CHECKING:
    from .model import HookedDCFormer

EMBEDDED_DIR = Path(__file__).parent / "checkpoints"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


# --------------------------------------------------------------------------------------------------
# Entry points: `HookedDCFormer.from_pretrained` opens a checkpoint, builds itself on the meta device from its
# configuration, streams the weights in, then takes the tokenizer and dispatches.
@dataclass
class Checkpoint:
    """A checkpoint directory opened for loading: what the model needs to build itself, before any weight is read.

    Attributes:
        directory: The checkpoint directory (a local path or an embedded model's).
        cfg: The model configuration read from `config.json`, its `dtype` set to the one to load in.
        model_type: `config.json`'s `model_type` (`dcinterp`, `dcpythia`, `dcformer` or `gpt_neox`).
        weight_processing: The processing a saved dcinterp model went through (`dcinterp.processing`), else `{}`.
        convert: The function that turns the checkpoint's tensors into the model's, one at a time.
    """

    directory: Path
    cfg: DCFormerConfig
    model_type: str | None
    weight_processing: dict
    convert: Callable


def open_checkpoint(path_or_name, dtype=None) -> Checkpoint:
    """Read a checkpoint's `config.json` (no weights yet) and choose the converter of its format.

    Args:
        path_or_name: A local checkpoint directory or the name of an embedded model.
        dtype: The dtype to load the weights in (a torch.dtype or a name such as "bfloat16"); float32 if None.

    Returns:
        The opened `Checkpoint`.

    Raises:
        CheckpointError: The directory, its `config.json` or its `model_type` cannot be read.
    """
    directory = resolve_checkpoint(path_or_name)
    raw = read_json(directory / "config.json")
    model_type = raw.get("model_type")
    dtype = resolve_dtype(dtype)
    cfg, convert = _config_and_converter(raw, directory / "config.json")
    cfg.dtype = dtype
    processing = dict(raw.get("weight_processing", {})) if model_type == "dcinterp" else {}
    return Checkpoint(directory, cfg, model_type, processing, convert)


def stream_weights(
    model: HookedDCFormer, checkpoint: Checkpoint, device=None, device_map=None, max_memory=None, offload_folder=None
) -> dict:
    """Stream a checkpoint's weights into a model built on the meta device, one tensor at a time.

    Each tensor is read from the memory-mapped checkpoint, converted once into the checkpoint's dtype and copied
    straight to the device it will live on (`device`, or the one `device_map` gives its module): peak memory is the
    weights in their target dtype plus one tensor, and nothing stays mapped.

    Args:
        model: The model to fill, built on the meta device from `checkpoint.cfg`.
        checkpoint: What `open_checkpoint` returned.
        device: The one device for every weight (the CPU if neither it nor `device_map` is given).
        device_map: A strategy name ("auto", "balanced", "balanced_low_0", "sequential") or {module name: device}.
        max_memory: Per-device memory limits for a strategy name, as Hugging Face takes them.
        offload_folder: Where weights placed on "disk" go.

    Returns:
        The device map every weight was placed by ({module name: device}), for `dispatch`.

    Raises:
        ValueError: Both `device` and `device_map`, or a device map that does not place every weight.
        CheckpointError: A weight that is missing, unexpected or of the wrong shape, named with its file.
    """
    dtype = checkpoint.cfg.dtype
    if device_map is not None and device is not None:
        raise ValueError("pass either device or device_map, not both")
    if device_map is None:
        device_map = {"": resolve_device(device or "cpu")}
    else:
        device_map = plan_device_map(model, device_map, max_memory, dtype)
    warn_if_half_on_cpu(dtype, device_map)

    with CheckpointFiles(checkpoint.directory) as files:
        take = Taker(files)
        if checkpoint.model_type == "dcinterp":
            add_folded_biases(model, files)
        placer = _Placer(model, dtype, device_map, offload_folder, checkpoint.directory)
        for key, value in _reshape_errors_named(checkpoint.convert(take, checkpoint.cfg), take, files):
            placer.put(key, value, files.origin(take.last))
        take.finish()
        placer.finish()
    return device_map


def load_config(path_or_name) -> DCFormerConfig:
    """The configuration of a checkpoint directory or embedded model, read from its config.json alone (no weights).

    Args:
        path_or_name: a checkpoint directory or the name of an embedded model.

    Returns:
        The config.

    Raises:
        CheckpointError: no such checkpoint, or a config that cannot be read.
    """
    config_file = resolve_checkpoint(path_or_name) / "config.json"
    return _config_and_converter(read_json(config_file), config_file)[0]


def _config_and_converter(raw: dict, config_file: Path):
    """The config.json's model configuration, and the function that converts its checkpoint's tensors."""
    model_type = raw.get("model_type")
    if model_type == "dcinterp":
        try:
            values = {k: v for k, v in raw.items() if k not in ("model_type", "weight_processing")}
            return DCFormerConfig.from_dict(values, source=str(config_file)), convert_own
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{config_file}: {e}") from None
    if model_type in ("dcpythia", "dcformer"):
        return config_from_official(raw, config_file), convert_official
    if model_type == "gpt_neox":
        return config_from_gpt_neox(raw, config_file), convert_gpt_neox
    known = ["dcinterp", "dcpythia", "dcformer", "gpt_neox"]
    raise CheckpointError(f"{config_file}: unknown model_type {model_type!r} (known: {', '.join(known)})")


def add_folded_biases(model: HookedDCFormer, files: "CheckpointFiles") -> None:
    """Make room for the biases a saved processed model has and a released one lacks (`unembed.b_U`, ...).

    Args:
        model: the model being loaded, on the meta device.
        files: the checkpoint's weight files.
    """
    expected = dict(model.named_parameters())
    for key in files.keys():
        module_name, _, name = key.rpartition(".")
        if key in expected or LEGACY_KEYS.get(key) or not name.startswith("b_"):
            continue
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            continue  # the placer names it as unexpected
        if getattr(module, name, None) is None or name in module._parameters and module._parameters[name] is None:
            module.__dict__.pop(name, None)
            shape = files.get(key).shape
            module.register_parameter(name, nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False))


def _reshape_errors_named(converted, take: "Taker", files: "CheckpointFiles"):
    """The converter's weights; a reshape that does not fit (the file disagrees with config.json) named."""
    try:
        yield from converted
    except RuntimeError as e:
        raise CheckpointError(
            f"{files.origin(take.last)}: weight {take.last!r} does not fit config.json ({e})"
        ) from None


def save_pretrained(model: HookedDCFormer, directory) -> None:
    """Save the model in dcinterp's own format: config.json, model.safetensors and the tokenizer, if any.

    A processed model's config records its weight processing, so that loading it again says so.

    Args:
        model: the model.
        directory: where to write (created if missing).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.cfg.save(directory / "config.json")
    if model.weight_processing:  # a processed model says so when it is loaded again (dcinterp.processing)
        config = read_json(directory / "config.json")
        (directory / "config.json").write_text(
            json.dumps({**config, "weight_processing": model.weight_processing}, indent=2) + "\n"
        )
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_safetensors(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(directory))


def embedded_models() -> list[str]:
    """Names of the models shipped inside the package (load them with `from_pretrained(name)`)."""
    if not EMBEDDED_DIR.is_dir():
        return []
    return sorted(p.name for p in EMBEDDED_DIR.iterdir() if (p / "config.json").is_file())


def resolve_checkpoint(path_or_name) -> Path:
    """The directory of a checkpoint directory or embedded model.

    Args:
        path_or_name: a directory, or an embedded model's name.

    Returns:
        The directory.

    Raises:
        CheckpointError: neither, naming the embedded models.
    """
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return path
    if (EMBEDDED_DIR / str(path_or_name) / "config.json").is_file():
        return EMBEDDED_DIR / str(path_or_name)
    embedded = ", ".join(embedded_models()) or "none"
    raise CheckpointError(f"{path_or_name}: not a checkpoint directory nor an embedded model (embedded: {embedded})")


def resolve_dtype(dtype) -> torch.dtype:
    """A torch dtype from a dtype or its name.

    Args:
        dtype: a torch.dtype, a name ("float32", "fp16", "bf16", ...), or None (float32).

    Returns:
        The dtype.

    Raises:
        ValueError: an unknown name.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if str(dtype).removeprefix("torch.") not in names:
        raise ValueError(f"unknown dtype {dtype!r} (use float32, float16 or bfloat16)")
    return names[str(dtype).removeprefix("torch.")]


def resolve_device(device) -> torch.device:
    """A torch.device that exists here.

    Args:
        device: a device or its name.

    Returns:
        The device; for "cuda", the current card's index.

    Raises:
        ValueError: one line naming the device and what is available.
    """
    resolved = torch.device(check_device(device))
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def warn_if_half_on_cpu(dtype: torch.dtype, device_map: dict) -> None:
    """Warn where half-precision weights would compute on the CPU, where their matmuls are slow.

    Args:
        dtype: the weights' dtype.
        device_map: {module name: device}.
    """
    if dtype in (torch.float16, torch.bfloat16) and any(str(d) in ("cpu", "disk") for d in device_map.values()):
        warnings.warn(
            f"{str(dtype).removeprefix('torch.')} on the CPU: most CPUs run half-precision matmuls "
            f"hundreds of times slower than float32; load with dtype=torch.float32 to compute on the CPU",
            stacklevel=4,
        )


# --------------------------------------------------------------------------------------------------
# Placement: one device, or a device_map across GPUs, the CPU and the disk (accelerate)
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def plan_device_map(model: HookedDCFormer, device_map, max_memory, dtype: torch.dtype) -> dict[str, object]:
    """A dict {module name: device} covering every parameter, from a strategy name or the user's dict.

    Args:
        model: the model, on the meta device.
        device_map: a strategy name as Hugging Face takes it ("auto", "balanced", "balanced_low_0", "sequential";
            blocks are never split) or a dict.
        max_memory: per-device limits for a strategy.
        dtype: the weights' dtype, to size them.

    Returns:
        {module name: device}.

    Raises:
        ValueError: an unknown strategy, a map that leaves a parameter out, or one that is not a dict.
    """
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise ValueError(
                f"device_map {device_map!r}: use one of {', '.join(DEVICE_MAP_STRATEGIES)}, or a dict "
                f"from module names to devices"
            )
        no_split = ["TransformerBlock"]
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model,
                max_memory=max_memory,
                no_split_module_classes=no_split,
                dtype=dtype,
                low_zero=device_map == "balanced_low_0",
            )
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)
    if not isinstance(device_map, dict):
        raise ValueError(f"device_map must be a strategy name or a dict, not {type(device_map).__name__}")
    modules = dict(model.named_modules())
    placed = {}
    for name, device in device_map.items():
        if name not in modules:
            raise ValueError(
                f"device_map: {name!r} is not a module of the model (e.g. 'embed', 'blocks.0', 'ln_final', 'unembed')"
            )
        placed[name] = device if device == "disk" else _accelerate_device(resolve_device(device))
    for key, _ in model.named_parameters():
        if module_device(placed, key) is None:
            raise ValueError(f"device_map does not place weight {key!r}")
    return placed


def _accelerate_device(device: torch.device):
    return device.index if device.type == "cuda" else str(device)  # accelerate's own spelling: 0, 1, "cpu"


def module_device(device_map: dict, key: str):
    """The device of the longest module name in a device map that contains a weight or hook.

    Args:
        device_map: {module name: device}, as `plan_device_map` returns it ("" names the whole model).
        key: A weight's or hook's dotted name, e.g. "blocks.0.attn.W_Q".

    Returns:
        That module's device as the map spells it (a GPU index, "cpu", "disk", ...), or None if none contains it.
    """
    parts = key.split(".")
    for i in range(len(parts), -1, -1):
        name = ".".join(parts[:i])
        if name in device_map:
            return device_map[name]
    return None


def dispatch(model: HookedDCFormer, device_map: dict, offload_folder) -> None:
    """Attach accelerate's hooks where the model spans several devices (or the disk); set cfg.device.

    Args:
        model: the loaded model.
        device_map: {module name: device}.
        offload_folder: where disk-offloaded weights go.
    """
    devices = set(device_map.values())
    if len(devices) > 1 or "disk" in devices:
        from accelerate import dispatch_model

        dispatch_model(model, device_map, offload_dir=offload_folder)
        model._hf_hook.io_same_device = False  # logits stay where the model computes them, as with one device
        model.hf_device_map = device_map
        gpus = sorted(d for d in devices if isinstance(d, int))
        first = device_map.get("embed", module_device(device_map, "embed.W_E"))
        main = torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")
        model.cfg.device = str(main if first in ("cpu", "disk") else _as_torch_device(first))
    else:
        model.cfg.device = str(_as_torch_device(next(iter(devices))))
    model.cfg.n_devices = len({d for d in devices if d != "disk"})


def _as_torch_device(device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


class _Placer:
    """Receives converted weights one at a time and puts each, in the target dtype, where it will live."""

    def __init__(self, model: HookedDCFormer, dtype: torch.dtype, device_map: dict, offload_folder, directory: Path):
        self.model, self.dtype, self.device_map, self.directory = model, dtype, device_map, directory
        self.expected = dict(model.named_parameters())
        self.placed: set[str] = set()
        self.offload_folder, self.offload_index = offload_folder, {}
        if "disk" in device_map.values() and offload_folder is None:
            raise ValueError("device_map offloads to 'disk': pass offload_folder=DIR for the offloaded weights")

    def put(self, key: str, value: Tensor, where) -> None:
        expected = self.expected.get(key)
        if expected is None:
            raise CheckpointError(f"{where}: unexpected weight {key!r}")
        if tuple(value.shape) != tuple(expected.shape):
            raise CheckpointError(
                f"{where}: weight {key!r} has shape {tuple(value.shape)}, expected {tuple(expected.shape)}"
            )
        dtype = self.dtype if value.is_floating_point() else value.dtype
        device = module_device(self.device_map, key)
        if device == "disk":
            from accelerate.utils import offload_weight

            offload_weight(value.to(dtype), key, self.offload_folder, index=self.offload_index)
        else:
            # One fresh tensor in the target dtype and layout: nothing keeps the mapped file alive.
            tensor = torch.empty(value.shape, dtype=dtype, device=_as_torch_device(device)).copy_(value)
            module_name, _, name = key.rpartition(".")
            self.model.get_submodule(module_name)._parameters[name] = nn.Parameter(tensor, requires_grad=False)
        self.placed.add(key)

    def finish(self) -> None:
        missing = [k for k in self.expected if k not in self.placed]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{self.directory}: missing weight {missing[0]!r}{more}")
        if self.offload_index:
            from accelerate.utils import save_offload_index

            save_offload_index(self.offload_index, self.offload_folder)


# --------------------------------------------------------------------------------------------------
# Reading files
def read_json(path: Path) -> dict:
    """A JSON file of a checkpoint.

    Args:
        path: the file.

    Returns:
        Its content.

    Raises:
        CheckpointError: the file is missing or not valid JSON.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint: a single file, or the shards an index json names.

    Args:
        directory: the checkpoint directory.

    Returns:
        The files.

    Raises:
        CheckpointError: no weight file, or an index naming a missing one.
    """
    for name in WEIGHT_FILES:
        index = directory / f"{name}.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map'")
            shards = [directory / shard for shard in dict.fromkeys(weight_map.values())]
            for shard in shards:
                if not shard.is_file():
                    raise CheckpointError(f"{shard}: shard named in {index.name} is missing")
            return shards
        if (directory / name).is_file():
            return [directory / name]
    raise CheckpointError(f"{directory}: no weights (looked for {', '.join(WEIGHT_FILES)} and their .index.json)")


class CheckpointFiles:
    """Every weight file of a checkpoint, opened lazily: keys are known up front, a tensor is read when asked.

    safetensors files are read through `safe_open` (one tensor at a time); `.bin` files are memory-mapped
    (`torch.load(mmap=True, weights_only=True)`), so their pages are file-backed and freed on close. A context manager.

    Args:
        directory: the checkpoint directory.

    Raises:
        CheckpointError: a key in two files.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.files: dict[str, Path] = {}
        self.readers: dict[Path, object] = {}
        for path in weight_files(directory):
            reader = open_weight_file(path)
            self.readers[path] = reader
            for key in reader.keys():
                if key in self.files:
                    raise CheckpointError(f"{path}: key {key!r} is also in {self.files[key].name}")
                self.files[key] = path

    def keys(self) -> list[str]:
        """Every weight's key, over all the files."""
        return list(self.files)

    def origin(self, key: str):
        """The file that holds a key.

        Args:
            key: the weight's key.

        Returns:
            Its file's path, or "" for an unknown key.
        """
        return self.files.get(key, "")

    def get(self, key: str) -> Tensor:
        """One weight, read from its file.

        Args:
            key: the weight's key.

        Returns:
            The tensor.

        Raises:
            CheckpointError: the weight is not readable, naming the file and key.
        """
        path = self.files[key]
        reader = self.readers[path]
        if isinstance(reader, dict):
            return reader[key]
        try:
            return reader.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: weight {key!r} is not readable ({e})") from None

    def __enter__(self) -> "CheckpointFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.readers.clear()


def open_weight_file(path: Path):
    """A safetensors reader, or the dict of memory-mapped tensors of a `.bin` file.

    Args:
        path: the file.

    Returns:
        The reader or dict.

    Raises:
        CheckpointError: the file cannot be read.
    """
    if path.suffix == ".safetensors":
        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # the old pickle format: no mmap
    except pickle.UnpicklingError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: refused to unpickle anything but plain tensors ({first_line})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a readable PyTorch file ({first_line})") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a flat dict of tensors")
    return state


def load_tokenizer(directory: Path):
    """The tokenizer in a checkpoint directory, loaded offline (None if there is none).

    Args:
        directory: the checkpoint directory.

    Returns:
        The tokenizer, or None.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer_json = directory / "tokenizer.json"
    if tokenizer_json.is_file():
        special = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            config = read_json(config_file)
            for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
                token = config.get(name)
                token = token.get("content") if isinstance(token, dict) else token
                if isinstance(token, str):
                    special[name] = token
        try:
            return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), **special)
        except Exception as e:  # tokenizers raises its own exception types
            raise CheckpointError(f"{tokenizer_json}: not a readable tokenizer ({e})") from None
    if any((directory / f).is_file() for f in ("vocab.json", "tokenizer.model", "vocab.txt")):
        try:
            return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
        except Exception as e:
            raise CheckpointError(f"{directory}: tokenizer files present but not loadable offline ({e})") from None
    return None
