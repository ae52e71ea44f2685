"""build_batch's two ways side by side: the per-token scatter and the per-row slice copy, on
mini-batches of rows of a given length (the trainer's 64 KiB samples are ~8 000 tokens),
alternating, best of ``--repeat`` each; prints ms per mini-batch and their ratio, and checks
that both build the same tensors.

    .venv/bin/python bench/build_batch.py [--rows 256] [--lengths 16 64 256 1024 8151]
        [--repeat 7]

Run it while nothing else loads the cores.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from trainer import grpo


def _samples(rows: int, length: int, seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        p = int(rng.integers(length // 8 + 1, length // 4 + 2))
        r = int(rng.integers(length // 2 + 1, length - p + 2))
        out.append((rng.integers(3, 30000, p).astype(np.int32),
                    rng.integers(3, 30000, r).astype(np.int32),
                    -rng.random(r).astype(np.float32)))
    return out


def _timed(samples: list[tuple[np.ndarray, ...]], row_copy: bool) -> tuple[float, grpo.Batch]:
    grpo.ROW_COPY_TOKENS = 0 if row_copy else 1 << 62  # type: ignore[misc]
    t0 = time.perf_counter()
    batch = grpo.build_batch(samples)
    return time.perf_counter() - t0, batch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 1024, 8151])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kept = grpo.ROW_COPY_TOKENS
    print(f"{'tokens/row':>10} {'scatter ms':>11} {'row copy ms':>12} {'scatter/copy':>13}")
    for length in args.lengths:
        samples = _samples(args.rows, length)
        best = {False: float("inf"), True: float("inf")}
        built = {}
        for _ in range(args.repeat):
            for row_copy in (False, True):
                s, built[row_copy] = _timed(samples, row_copy)
                best[row_copy] = min(best[row_copy], s)
        a, b = built[False], built[True]
        assert all(torch.equal(x, y) for x, y in zip(
            (a.input_ids, a.attention_mask, a.response_mask, a.old_logprobs),
            (b.input_ids, b.attention_mask, b.response_mask, b.old_logprobs), strict=True))
        print(f"{length:>10} {best[False] * 1e3:>11.2f} {best[True] * 1e3:>12.2f} "
              f"{best[False] / best[True]:>13.2f}")
    grpo.ROW_COPY_TOKENS = kept  # type: ignore[misc]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
