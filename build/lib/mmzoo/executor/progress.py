"""The progress bar of a generation run: requests done, input and output tokens per second (tqdm)."""

from __future__ import annotations

import time

from mmzoo.types import Result


class Progress:
    """Requests done, with input and output tokens per second."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="req", dynamic_ncols=True, leave=False, disable=None)  # off when not a tty
        self.t0, self.tok_in, self.tok_out = time.perf_counter(), 0, 0

    def update(self, r: Result) -> None:
        self.tok_in += len(r.prompt_token_ids)
        self.tok_out += len(r.token_ids)
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"in {self.tok_in / dt:.0f} tok/s, out {self.tok_out / dt:.0f} tok/s")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
