"""What a blend actually draws: per dataset its documents, tokens, weight and the share of
the training samples that come from it (megatron-core's BlendedDataset index, counted over
the samples this run will read), reported at start and logged as a `data_mixture` event."""

from __future__ import annotations

import numpy as np


def mixture(dataset, samples: int) -> list[dict]:
    """One row per dataset of `dataset` (a BlendedDataset, or a single GPTDataset), over its
    first `samples` samples."""
    parts = getattr(dataset, "datasets", None) or [dataset]
    weights = getattr(dataset, "weights", None) or [1.0]
    index = getattr(dataset, "dataset_index", None)
    if index is None:
        drawn = np.array([min(samples, len(dataset))], dtype=np.float64)
    else:
        drawn = np.bincount(np.asarray(index[:samples]), minlength=len(parts)).astype(float)
    total_weight = float(sum(weights))
    rows = []
    for part, weight, count in zip(parts, weights, drawn):
        documents, tokens = _split_size(part)
        rows.append({
            "prefix": getattr(part, "dataset_path", None) or "mock",
            "documents": documents,
            "tokens": tokens,
            "weight": float(weight) / total_weight,
            "share drawn": float(count / max(drawn.sum(), 1)),
        })
    return rows


def _split_size(part) -> tuple[int | None, int | None]:
    """(documents, tokens) of the training split of one GPTDataset (None: mock data)."""
    indexed, documents = getattr(part, "dataset", None), getattr(part, "indices", None)
    if documents is None or not hasattr(indexed, "document_indices"):
        return None, None
    bounds = np.asarray(indexed.document_indices, dtype=np.int64)
    cumulative = np.concatenate([[0], np.cumsum(indexed.sequence_lengths, dtype=np.int64)])
    documents = np.asarray(documents, dtype=np.int64)
    tokens = cumulative[bounds[documents + 1]] - cumulative[bounds[documents]]
    return int(len(documents)), int(tokens.sum())


def describe(rows: list[dict]) -> str:
    lines = ["data mixture (training samples this run reads):"]
    for row in rows:
        lines.append(f"  {row['prefix']}: {row['documents'] or '?'} documents, "
                     f"{row['tokens'] or 0:,} tokens, weight {row['weight']:.3f}, "
                     f"drawn {row['share drawn']:.3f}")
    return "\n".join(lines)
