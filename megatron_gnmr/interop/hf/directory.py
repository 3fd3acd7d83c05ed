"""A Hugging Face model directory's config and weights, read as untrusted data: config.json
must be a JSON object naming its class as transformers reads it, the weights come from
safetensors only (a `pytorch_model.bin` is a pickle, which could run code: refused), the
sharded index must name plain files in the directory (no path leaves it), and no tensor may be
held by two files. Every failure is one UserError naming the file; what the fields and
tensors must be is the family mapping's to check (`model_families/checked_hf.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_gnmr.errors import UserError
from megatron_gnmr.model_families import family_reading
from megatron_gnmr.model_families.checked_hf import check_identity

INDEX = "model.safetensors.index.json"


def _json(path: Path, where: str) -> object:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{where}: {path.name} is not JSON ({error})") from None
    except RecursionError:  # nested deeper than the parser goes
        raise UserError(f"{where}: {path.name} is nested too deeply to be a config") from None


def weight_files(hf_dir: Path, where: str) -> list[str]:
    """The safetensors files that hold the weights: the index's, or model.safetensors."""
    if not (hf_dir / INDEX).is_file():
        return ["model.safetensors"]
    index = _json(hf_dir / INDEX, where)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise UserError(f"{where}: {INDEX} has no weight_map of tensor names to files")
    files = sorted(set(weight_map.values()))
    for name in files:
        if Path(name).name != name or name in (".", ".."):
            raise UserError(f"{where}: {INDEX} names {name!r}, not a file in the directory")
    return files


def read_hf(hf_dir: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, str]]:
    """(config.json, weights, the file of each weight) of a Hugging Face model directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    where = f"import-hf {hf_dir}"
    if not (hf_dir / "config.json").is_file():
        raise UserError(f"{where}: no config.json (not a transformers model directory)")
    hf = _json(hf_dir / "config.json", where)
    check_identity(hf, where)
    family_reading(hf, where)
    files = weight_files(hf_dir, where)
    if not all((hf_dir / name).is_file() for name in files):
        if (hf_dir / "pytorch_model.bin").is_file():
            raise UserError(f"{where}: the weights are pytorch_model.bin, a pickle that could "
                            "run code when read; save the model with safetensors "
                            "(save_pretrained(..., safe_serialization=True))")
        raise UserError(f"{where}: no model.safetensors (or the files its index names)")
    weights, file_of = {}, {}
    for name in files:
        try:
            tensors = load_file(str(hf_dir / name))
        except (SafetensorError, OSError) as error:
            raise UserError(f"{where}: {name} is not a safetensors file ({error})") from None
        twice = sorted(set(tensors) & set(weights))
        if twice:
            raise UserError(f"{where}: {twice[0]} is in both {file_of[twice[0]]} and {name}")
        weights.update(tensors)
        file_of.update(dict.fromkeys(tensors, name))
    return hf, weights, file_of
