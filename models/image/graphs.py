"""The UNet of a denoising step as CUDA graphs: one replay per step instead of a thousand
kernel launches.

At the batch sizes a server runs, a Stable Diffusion UNet step on a large GPU takes less
device time than the host needs to launch its kernels one by one, so eager steps leave
the GPU waiting for the CPU (and hold the interpreter lock that other models' threads
need). `UNetGraphs` captures the UNet's forward at the default image size once per row
count, from one row to the loop's largest batch, into one shared memory pool; a step
whose rows match a captured graph copies its inputs into the graph's static buffers and
replays it, any other step (another image size, a timestep of another dtype) runs eagerly.

A replay runs the very kernels of an eager call of the same shape, so an image is the
same with and without graphs; warm-up captures every graph before readiness, so no
request pays for a capture.
"""

from __future__ import annotations

import logging

import torch

from models.devices import GraphFamily, capture_graph

log = logging.getLogger(__name__)


def unet_forward(
    unet: torch.nn.Module, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor
) -> torch.Tensor:
    """One eager UNet call: the noise predicted for each row."""
    return unet(sample, timestep, encoder_hidden_states=context, return_dict=False)[0]


class UNetGraphs:
    """`unet(sample, timestep, encoder_hidden_states)` for one latent shape and context
    shape, replayed from CUDA graphs for every row count up to `max_rows`."""

    def __init__(
        self,
        unet: torch.nn.Module,
        sample_shape: tuple[int, int, int],  # (channels, latent height, latent width)
        context_shape: tuple[int, int],  # (tokens, width) of the text embeddings
        timestep_dtype: torch.dtype,
        max_rows: int,
    ) -> None:
        self.unet = unet
        self.device = unet.device
        dtype = unet.dtype
        self.sample = torch.zeros((max_rows, *sample_shape), device=self.device, dtype=dtype)
        self.context = torch.zeros((max_rows, *context_shape), device=self.device, dtype=dtype)
        self.timestep = torch.zeros(max_rows, device=self.device, dtype=timestep_dtype)
        self.max_rows = max_rows
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        """A graph for every row count from the largest down (the largest sizes the pool)."""
        family = GraphFamily.on(self.device)
        for rows in range(self.max_rows, 0, -1):
            out: list[torch.Tensor] = []
            graph = capture_graph(
                lambda rows=rows, out=out: out.append(self._eager_static(rows)),
                family,
                self.device,
                warm=lambda rows=rows: self._eager_static(rows),
                warmups=2,
            )
            self._graphs[rows] = (graph, out[-1])

    def __call__(
        self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor
    ) -> torch.Tensor:
        rows = sample.shape[0]
        captured = self._graphs.get(rows)
        if (
            captured is None
            or sample.shape[1:] != self.sample.shape[1:]
            or context.shape[1:] != self.context.shape[1:]
            or timestep.dtype != self.timestep.dtype
        ):
            return unet_forward(self.unet, sample, timestep, context)
        graph, out = captured
        self.sample[:rows].copy_(sample)
        self.timestep[:rows].copy_(timestep)
        self.context[:rows].copy_(context)
        graph.replay()
        # The next replay writes the same buffer; the scheduler keeps what it is given.
        return out.clone()

    def _eager_static(self, rows: int) -> torch.Tensor:
        return unet_forward(
            self.unet, self.sample[:rows], self.timestep[:rows], self.context[:rows]
        )


def graphed_unet(pipe, height: int, width: int, max_rows: int) -> UNetGraphs | None:
    """The pipeline's UNet captured for images of `height` x `width`, or None (with a
    warning) where capturing fails: the loop then steps eagerly."""
    try:
        scale = pipe.vae_scale_factor
        context, _ = pipe.encode_prompt("", pipe.device, 1, False)
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        scheduler.set_timesteps(2, device=pipe.device)
        graphs = UNetGraphs(
            pipe.unet,
            (pipe.unet.config.in_channels, height // scale, width // scale),
            tuple(context.shape[1:]),
            scheduler.timesteps.dtype,
            max_rows,
        )
        graphs.capture()
        return graphs
    except Exception as exc:  # eager steps are slower, never wrong
        log.warning("capturing the UNet as CUDA graphs failed (%s); stepping eagerly", exc)
        return None
