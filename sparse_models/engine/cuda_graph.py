"""CUDA-graph capture of the decode step (the gpt-fast pattern).

Static input buffers (token ids [B], positions [B]) are filled before each replay; the captured step
reads them, appends to the static cache and writes logits into a static output. Warm-up runs on a side
stream first (Triton compiles its kernels then; kernels skip their host-side value checks while a graph
is being captured). The warm-up writes the same K/V the real step will write, so it is harmless.
"""

from __future__ import annotations

import torch


class GraphedStep:
    """``GraphedStep(step, input_ids, positions)``: captures ``step(input_ids, positions)`` once.

    ``replay()`` reruns it on whatever the buffers hold now and returns the static logits tensor.
    """

    def __init__(self, step, input_ids: torch.Tensor, positions: torch.Tensor, warmup: int = 2, pool=None):
        self.input_ids = input_ids
        self.positions = positions
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                step(input_ids, positions)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = step(input_ids, positions)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits
