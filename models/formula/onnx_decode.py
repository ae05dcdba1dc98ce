"""The static decoder on a CPU with its model math run by ONNX Runtime.

Why: on a CPU the static decoder runs eagerly, and a step of one row is a hundred-odd
small PyTorch operations, each paying its dispatch; the encoder's products and attention
run unfused. ONNX Runtime runs the same math as two optimized graphs, with the same
answers and sooner (measured in bench/RESULTS.md: `bench.cpu_onnx`, `bench.cpu`).

How: `OnnxStaticDecoder` is `StaticGreedyDecoder` with two methods replaced. `_encode`
runs the encoder graph (pixels to every decoder layer's cross-attention K and V); `_logits`
runs the step graph on the rows' tokens and positions, the K/V cache up to the furthest
row's position, the cross-attention K/V and both masks, and writes the new K/V it
returns into the cache. Everything else (slots, admission, the greedy choice, finishing,
harvest) is the parent's, so the stream, its tests and its answers carry over. Both
graphs are exported from the loaded model when the decoder is made (a few seconds),
float32 only: with a bf16 model the parent's oneDNN path is the fast one.

With `int8`, a step's products read int8 weights (`_quantized`): a step reads about a
quarter of the bytes, and a step of one row is bound by reading the weights. The encoder
stays float32: its products are bound by arithmetic, where int8 did not pay.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings

import numpy as np
import torch
from torch import nn

from models.formula.fast_decode import StaticGreedyDecoder

logger = logging.getLogger(__name__)


def available() -> bool:
    """Whether ONNX Runtime and the exporter's `onnx` are installed."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


class _EncoderGraph(nn.Module):
    """Pixels [rows, C, H, W] to cross-attention K and V [2, layers, rows, heads, S, D]."""

    def __init__(self, decoder: StaticGreedyDecoder) -> None:
        super().__init__()
        self.model = decoder.model  # registered: its weights become the graph's
        self.decoder = [decoder]  # not a submodule: the model is registered above

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return StaticGreedyDecoder._encode(self.decoder[0], pixels)  # PyTorch's math


class _StepGraph(nn.Module):
    """One step of every row, as `StaticGreedyDecoder._logits` computes it, with the cache
    an input and the new K/V outputs: tokens [R], positions [R], self mask [R, 1, 1, C],
    cache K/V [layers, R, heads, C, D], cross K/V [layers, R, heads, S, D], source mask
    [R, 1, 1, S] to logits [R, V] and the new K/V [layers, R, heads, 1, D]."""

    def __init__(self, decoder: StaticGreedyDecoder) -> None:
        super().__init__()
        self.decoder = decoder.decoder
        self.projection = decoder.lm_head
        self.embed, self.split, self.merge = decoder._embed, decoder._heads, decoder._merge

    def forward(self, tokens, positions, self_mask, past_k, past_v, cross_k, cross_v, source_mask):
        hidden = self.embed(tokens, positions)  # [R, 1, E]
        cache = torch.arange(past_k.shape[3], device=positions.device)
        here = (cache[None, :] == positions[:, None])[:, None, :, None]  # [R, 1, C, 1]
        new_k, new_v = [], []
        for i, layer in enumerate(self.decoder.layers):
            attention = layer.self_attn
            query = self.split(attention.q_proj(hidden) * attention.scaling)
            k, v = self.split(attention.k_proj(hidden)), self.split(attention.v_proj(hidden))
            new_k.append(k)
            new_v.append(v)
            keys, values = torch.where(here, k, past_k[i]), torch.where(here, v, past_v[i])
            out = torch.softmax(query @ keys.transpose(2, 3) + self_mask, dim=-1) @ values
            hidden = layer.self_attn_layer_norm(hidden + attention.out_proj(self.merge(out)))
            cross = layer.encoder_attn
            query = self.split(cross.q_proj(hidden) * cross.scaling)
            scores = query @ cross_k[i].transpose(2, 3) + source_mask
            out = torch.softmax(scores, dim=-1) @ cross_v[i]
            hidden = layer.encoder_attn_layer_norm(hidden + cross.out_proj(self.merge(out)))
            feed_forward = layer.fc2(layer.activation_fn(layer.fc1(hidden)))
            hidden = layer.final_layer_norm(hidden + feed_forward)
        return self.projection(hidden[:, 0]), torch.stack(new_k), torch.stack(new_v)


def _session(graph: bytes, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Its threads sleep between runs instead of spinning: the CPU is shared with the HTTP
    # side, PyTorch's own threads and the next step's bookkeeping.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


class _Steps:
    """A step graph's two sessions: one thread for a row alone, whose products are too
    small to share (waking a second thread costs more than it saves), and every thread
    for more rows. The thread count does not change a result."""

    def __init__(self, graph: bytes, threads: int) -> None:
        self.lone = _session(graph, 1)
        self.many = _session(graph, threads) if threads > 1 else self.lone

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        session = self.lone if len(feeds["tokens"]) == 1 else self.many
        return session.run(None, feeds)


def _export(module: nn.Module, inputs: tuple, names: tuple[list, list], axes: dict) -> bytes:
    """The module traced into an ONNX graph. The tracer's warnings (values it records as
    constants) are not printed: warm-up checks the graphs against PyTorch instead."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            inputs,
            buffer,
            input_names=names[0],
            output_names=names[1],
            dynamic_axes=axes,
            opset_version=18,
            dynamo=False,
        )
    return buffer.getvalue()


def _graphs(decoder: StaticGreedyDecoder, example: torch.Tensor) -> tuple[bytes, bytes]:
    """The encoder's and the step's float32 graphs, traced from `decoder`'s PyTorch math
    with `example` pixels [1, C, H, W]."""
    layers, heads, dim = len(decoder.decoder.layers), decoder.num_heads, decoder.head_dim
    cross = StaticGreedyDecoder._encode(decoder, example)
    source = cross.shape[-2]
    encoder = _export(
        _EncoderGraph(decoder).eval(),
        (example,),
        (["pixels"], ["kv"]),
        {"pixels": {0: "rows", 3: "width"}, "kv": {2: "rows", 4: "source"}},
    )
    cache = torch.zeros(layers, 1, heads, 2, dim)
    step = (
        torch.tensor([decoder.start_id]),
        torch.tensor([0]),
        torch.zeros(1, 1, 1, 2),
        cache,
        cache,
        cross[0],
        cross[1],
        torch.zeros(1, 1, 1, source),
    )
    names = ["tokens", "positions", "self_mask", "past_k", "past_v"]
    names += ["cross_k", "cross_v", "source_mask"]
    rows_c = {1: "rows", 3: "cache"}
    rows_s = {1: "rows", 3: "source"}
    graph = _export(
        _StepGraph(decoder).eval(),
        step,
        (names, ["logits", "new_k", "new_v"]),
        {
            "tokens": {0: "rows"},
            "positions": {0: "rows"},
            "self_mask": {0: "rows", 3: "cache"},
            "past_k": rows_c,
            "past_v": rows_c,
            "cross_k": rows_s,
            "cross_v": rows_s,
            "source_mask": {0: "rows", 3: "source"},
            "logits": {0: "rows"},
            "new_k": {1: "rows"},
            "new_v": {1: "rows"},
        },
    )
    return encoder, graph


def _quantized(graph: bytes) -> bytes:
    """The graph with its products' weights in int8, in blocks of 32 along each input
    (ONNX Runtime's MatMulNBits). Each row's activations are quantized per block of its
    own at run time (`accuracy_level` 4: int8 products), so a row's answer does not
    depend on the rows beside it, as with float32."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    with _quiet():
        quantizer = MatMulNBitsQuantizer(
            onnx.load_from_string(graph), bits=8, block_size=32, is_symmetric=True,
            accuracy_level=4,
        )  # fmt: skip
        quantizer.process()
    return quantizer.model.model.SerializeToString()


@contextlib.contextmanager
def _quiet():
    """The quantizer's progress kept out of the server's log."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _close_int8(int8: torch.Tensor, float32: torch.Tensor) -> bool:
    """Whether int8 logits keep float32's choice in every row and stay within a few
    percent of its range: what int8 weights give a model without outlying activations
    (a model with them gets float32)."""
    spread = float32.amax(-1, keepdim=True) - float32.amin(-1, keepdim=True)
    return bool(
        torch.equal(int8.argmax(-1), float32.argmax(-1))
        and ((int8 - float32).abs() <= 0.05 * spread).all()
    )


class _GraphStepDecoder(StaticGreedyDecoder):
    """`StaticGreedyDecoder` on a CPU whose steps can run a step graph (`_Steps`) on its
    own buffers: its float32 cache and cross-attention K/V."""

    @staticmethod
    def _fits(model, dtype: torch.dtype) -> bool:
        """A TrOCR-decoded model of `dtype` on a CPU, whose steps the graph can trace."""
        return (
            StaticGreedyDecoder.supports(model)
            and model.device.type == "cpu"
            and model.dtype == dtype
            and model.decoder.config.use_learned_position_embeddings
            and available()
        )

    def __init__(self, model, **kwargs) -> None:
        super().__init__(model, **kwargs)
        # The cross-attention K/V of the rows a step reads, contiguous for ONNX Runtime:
        # made again only when admission changed them or the rows or length differ.
        self._cross_version = 0
        self._cross_inputs: tuple[tuple[int, int, int], np.ndarray, np.ndarray] | None = None

    def _store_source(self, kv, slots, mask=None) -> None:
        super()._store_source(kv, slots, mask)
        self._cross_version += 1

    def _graph_step(self, stepper, rows, tokens, positions, self_mask, source_len):
        """`StaticGreedyDecoder._logits` run by `stepper`'s graph: the logits, the new K/V
        written into the cache."""
        cache_len = self_mask.shape[-1]
        key = (rows, source_len, self._cross_version)
        if self._cross_inputs is None or self._cross_inputs[0] != key:
            self._cross_inputs = (
                key,
                self.cross_k[:, :rows, :, :source_len].contiguous().numpy(),
                self.cross_v[:, :rows, :, :source_len].contiguous().numpy(),
            )
        _, cross_k, cross_v = self._cross_inputs
        logits, new_k, new_v = stepper.run(
            {
                "tokens": tokens.numpy(),
                "positions": positions.numpy(),
                "self_mask": self_mask.numpy(),
                "past_k": self.self_k[:, :rows, :, :cache_len].contiguous().numpy(),
                "past_v": self.self_v[:, :rows, :, :cache_len].contiguous().numpy(),
                "cross_k": cross_k,
                "cross_v": cross_v,
                "source_mask": self.source_mask[:rows, ..., :source_len].contiguous().numpy(),
            },
        )
        layers, _, heads, _, dim = new_k.shape
        write = positions[None, :, None, None, None].expand(layers, rows, heads, 1, dim)
        self.self_k[:, :rows].scatter_(3, write, torch.from_numpy(new_k))
        self.self_v[:, :rows].scatter_(3, write, torch.from_numpy(new_v))
        return torch.from_numpy(logits)


class OnnxStaticDecoder(_GraphStepDecoder):
    """`StaticGreedyDecoder` on a CPU, its encoder and step math run by ONNX Runtime."""

    @staticmethod
    def supports(model) -> bool:
        return _GraphStepDecoder._fits(model, torch.float32)

    def __init__(self, model, *, example: torch.Tensor, int8: bool = False, **kwargs) -> None:
        """`example`: pixels [1, C, H, W] of the model's input shape (any width); `int8`:
        steps with int8 weights (checked at warm-up against the float32 graph)."""
        self.onnx = False  # PyTorch's math until the graphs exist, and where they disagree
        super().__init__(model, **kwargs)
        threads = torch.get_num_threads()
        with torch.no_grad():
            encoder, graph = _graphs(self, example)
            self._encoder = _session(encoder, threads)
        self._float_step = _Steps(graph, threads)
        self._int8_step = None
        if int8:
            try:
                self._int8_step = _Steps(_quantized(graph), threads)
            except Exception as exc:  # a quantizer too old, or missing its parts
                logger.warning("decoding in float32: int8 quantization failed (%s)", exc)
        self._stepper = self._int8_step or self._float_step
        self._example_shape = tuple(example.shape[1:])
        self.onnx = True  # until warm-up finds a width its graphs do not reproduce

    @torch.inference_mode()
    def warmup(self, input_shapes=()) -> None:
        """Each input shape encoded, and a step taken, by both PyTorch and the graphs: an
        export traced at one width can hold constants of that width (Swin's windows), so
        a shape the graphs do not reproduce sends the decoder back to PyTorch."""
        generator = torch.Generator().manual_seed(0)
        for index, shape in enumerate(input_shapes):
            # Two rows once, for the batch axis; then one: a width is what can differ.
            pixels = torch.rand((2 if index == 0 else 1, *shape), generator=generator)
            expected = super()._encode(pixels)
            if not torch.allclose(self._encode(pixels), expected, rtol=1e-3, atol=1e-4):
                return self._fall_back(f"the encoder at {shape} differs", input_shapes)
        rows = min(2, self.max_batch_size)
        shape = input_shapes[0] if input_shapes else self._example_shape
        slots = self.admit(torch.rand((rows, *shape), generator=generator))
        self.tokens[:rows] = torch.tensor([self.start_id, self.pad_id][:rows])
        mask = torch.zeros(rows, 1, 1, 1)
        args = (rows, self.tokens[:rows], self.positions[:rows], mask, self._slot_source[0])
        self._stepper = self._float_step
        got, expected = self._logits(*args), super()._logits(*args)
        if self._int8_step is not None:
            self._stepper = self._int8_step
            int8 = self._logits(*args)
        self.release(slots)
        if not torch.allclose(got, expected, rtol=1e-3, atol=1e-4):
            return self._fall_back("a step differs", input_shapes)
        if self._int8_step is not None and not _close_int8(int8, got):
            logger.warning("decoding in float32: the int8 step strays from it")
            self._stepper = self._float_step
        super().warmup(input_shapes)
        self.encoded_every_shape = True

    @property
    def checked_int8_step(self) -> _Steps | None:
        """The int8 step graph where warm-up checked it and steps run it, else None."""
        return self._int8_step if self.onnx and self._stepper is self._int8_step else None

    def _fall_back(self, why: str, input_shapes) -> None:
        logger.warning("decoding with PyTorch: ONNX Runtime's graphs disagree (%s)", why)
        self.onnx = False
        super().warmup(input_shapes)

    def _encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if not self.onnx:
            return super()._encode(pixel_values)
        (kv,) = self._encoder.run(None, {"pixels": pixel_values.contiguous().numpy()})
        return torch.from_numpy(kv)

    def _logits(self, rows, tokens, positions, self_mask, source_len) -> torch.Tensor:
        if not self.onnx:
            return super()._logits(rows, tokens, positions, self_mask, source_len)
        return self._graph_step(self._stepper, rows, tokens, positions, self_mask, source_len)


class LoneRowInt8Decoder(_GraphStepDecoder):
    """A bf16 model's static decoder on a CPU whose steps of a row alone run the int8
    step graph of `OnnxStaticDecoder`.

    Why: on a processor with bf16 matrix instructions, bf16 PyTorch decodes a batch about
    twice as fast as the int8 graph, and a row alone 1.6x slower (bench/RESULTS.md, "bf16
    or int8 decoding on a CPU with AMX"). So a step of one row runs the int8 graph and a
    step of more runs bf16, on the same float32 cache: rows join and leave a running
    decode (the stream) without moving anything. The encoder is the bf16 model's.

    How: the int8 graph is exported from `float_model` (the same weights in float32) by
    an `OnnxStaticDecoder` of two rows, checked at its warm-up against float32; where the
    export, the check or the quantizer fails, every step runs bf16, as before.
    """

    @staticmethod
    def supports(model) -> bool:
        return _GraphStepDecoder._fits(model, torch.bfloat16)

    def __init__(self, model, *, float_model, example: torch.Tensor, **kwargs) -> None:
        """`float_model`: the model's weights in float32 (read only to make the graph);
        `example`: float32 pixels [1, C, H, W] of the model's input shape."""
        super().__init__(model, **kwargs)
        self._lone = None
        self._int8_graphs: OnnxStaticDecoder | None = None
        try:  # two rows: the warm-up's check steps a start token and a pad
            rows = min(2, kwargs["max_batch_size"])
            sizes = {**kwargs, "max_batch_size": rows}
            self._int8_graphs = OnnxStaticDecoder(float_model, example=example, int8=True, **sizes)
        except Exception as exc:  # an architecture the exporter does not take
            logger.warning("decoding every step in bf16: ONNX export failed (%s)", exc)

    @torch.inference_mode()
    def warmup(self, input_shapes=()) -> None:
        """The int8 graph checked as `OnnxStaticDecoder` checks it, and kept only if it
        passes; then the bf16 decoder's own warm-up."""
        graphs, self._int8_graphs = self._int8_graphs, None
        if graphs is not None:
            graphs.warmup(input_shapes)
            self._lone = graphs.checked_int8_step
            if self._lone is None:
                logger.warning("decoding every step in bf16: the int8 step graph did not check")
        super().warmup(input_shapes)

    @property
    def lone_row_int8(self) -> bool:
        """Whether a step of a row alone runs the int8 graph."""
        return self._lone is not None

    def _logits(self, rows, tokens, positions, self_mask, source_len) -> torch.Tensor:
        if rows != 1 or self._lone is None:
            return super()._logits(rows, tokens, positions, self_mask, source_len)
        return self._graph_step(self._lone, rows, tokens, positions, self_mask, source_len)
