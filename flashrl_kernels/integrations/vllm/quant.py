"""flashrl_int8 / flashrl_fp8: vLLM quantization methods whose weights are stored quantized and loaded in place.

Every linear layer (column, row, QKV, merged gate/up, replicated) gets
  weight        [out, in]  torch.int8 or torch.float8_e4m3fn   (a vLLM ModelWeightParameter)
  weight_scale  [out]      fp32, one scale per output row      (a buffer)
and no bf16 copy. INT8 layers that run the native W8A8 kernel on an AVX-512 VNNI or AVX2
CPU (activation mode "auto" or "dynamic"; out % 64 == 0 on AVX-512, % 8 on AVX2; in % 4 == 0)
store their codes in that kernel's packed order instead (the same bytes permuted, same
shape; see docs/native.md), plus
  weight_comp   [out]      int32, each row's code sum           (a buffer)
written with the codes by the same loader; `logical_weight(layer)` reads the codes back
in [out, in] order. The weight's loader takes the bf16/fp32 tensor that vLLM's
model.load_weights hands it (from the checkpoint at start-up, from the trainer
at a sync), quantizes it with flashrl_kernels' quantize_rows_ and writes the
rows and their scales into the existing storage, at the row offset of the
shard (q/k/v, gate/up) it belongs to. So a weight sync is a load_weights:
nothing is re-allocated and the storage addresses stay the same (CUDA graphs
captured on them stay valid).

Shard offsets follow vLLM's own parameter classes: the layer's
weight_loader_v2 computes (shard_offset, shard_size, shard_id) and calls
load_qkv_weight / load_merged_column_weight / load_column_parallel_weight /
load_row_parallel_weight on the parameter, which narrows the source and the
destination exactly as vLLM's _ColumnvLLMParameter / RowvLLMParameter do,
then quantizes instead of copying. ReplicatedLinear has no weight_loader_v2:
its own loader is a plain copy_ (which would cast bf16 values into the codes),
so its weight gets _replicated_weight_loader, which quantizes the whole tensor.

Embeddings and the LM head stay in the model dtype by default (their
quantization error lands directly on the logits), with a method that keeps
reading `layer.weight` so in-place syncs of them are seen (vLLM's default CPU
method repacks the LM head into a private copy). With the option
quantize_lm_head the LM head (vLLM's ParallelLMHead) gets the same int8/fp8
rows + fp32 row scales as the linears and computes its logits with
scaled_linear; when the model ties its embeddings, the input embedding shares
that one quantized table and looks its rows up dequantized (no bf16 copy).

Tensor parallelism: every rank quantizes its own shard from the full tensor
it is handed. Column-parallel layers (QKV, gate/up) hold whole rows, so their
scales are those of TP = 1; row-parallel layers (o_proj, down_proj) hold a
slice of every row's columns and quantize it with a shard-local scale (see
load_row_parallel_weight); vocab-parallel tables quantize their row shard.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import weakref
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    ReplicatedLinear,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.parameter import ModelWeightParameter

import flashrl_kernels  # noqa: F401  (registers the torch.library ops)

_ACT_QUANT = ("auto", "dynamic", "none")
# every option hf_overrides={"quantization_config_dict_json": json.dumps({...})} accepts, with its values
OPTIONS = {
    "activation_quant": '"auto" (default), "dynamic" or "none"',
    "quantize_lm_head": "false (default) or true",
    "weight_layout": '"auto" (default: packed where the native W8A8 kernel runs) or "plain"',
}
_LAYOUTS = ("auto", "plain")


def use_activation_quant(mode: str, weight: torch.Tensor) -> bool:
    """Whether scaled_linear quantizes the activations per token (dynamic W8A8) under option `mode`.

    The one place that decides it for every quantized layer (linears and the LM
    head), from the layer's weight (its device and dtype). "auto" is W8A8 where
    the W8A8 GEMM is the fast path: CUDA, and int8 weights on a CPU whose native
    kernel has integer dot products (AVX-512 VNNI's vpdpbusd, AVX2's vpmaddwd;
    measured in docs/quantized_rollout.md, "Which activation mode"); weight-only
    elsewhere (FP8, AVX-512 without VNNI, portable builds).
    "dynamic" / "none" force it on / off. Static under torch.compile.
    """
    if mode != "auto":
        return mode == "dynamic"
    if weight.is_cuda:
        return True
    if weight.device.type != "cpu" or weight.dtype != torch.int8:
        return False
    from flashrl_kernels.ops.quantize import direct_scaled_linear

    # the native backend runs scaled_linear here and its kernel has integer dot products (else W8A8 would be
    # the slower, emulated path)
    return direct_scaled_linear(weight, True) is not None


def prepare_layer(layer: torch.nn.Module, mode: str) -> None:
    """Fix a quantized layer's activation mode and, on the CPU, its direct kernel (after every load).

    The direct kernel is the native C++ op itself (flashrl_kernels.ops.quantize.direct_scaled_linear),
    which skips flashrl::scaled_linear's Python dispatch: ~40 us a call, ~4 ms a decode step of a
    24-layer model. It reads layer.weight / layer.weight_scale at every call, so in-place syncs show.
    """
    from flashrl_kernels.ops.quantize import direct_scaled_linear

    if is_packed(layer):  # W8A8 on the packed kernel, the only one that reads this layout
        layer._flashrl_act_quant = True
        layer._flashrl_direct = torch.ops.flashrl_native.qlinear_packed
        return
    act = use_activation_quant(mode, layer.weight)
    layer._flashrl_act_quant = act
    layer._flashrl_direct = None if layer.weight.is_meta else direct_scaled_linear(layer.weight, act)


def _packed_layout(weight: torch.Tensor, mode: str) -> bool:
    """Whether a new quantized weight is stored packed: int8 on the CPU, W8A8 in this mode, and the native
    packed kernel selected and fitting its shape. Decided once, when the layer is built (it fixes the layout)."""
    if weight.dtype != torch.int8 or weight.device.type != "cpu" or not use_activation_quant(mode, weight):
        return False
    from flashrl_kernels.ops.quantize import direct_packed_w8a8

    return direct_packed_w8a8(weight)


def is_packed(layer: torch.nn.Module) -> bool:
    """Whether `layer`'s quantized weight is stored in the native W8A8 kernel's packed order."""
    return getattr(layer, "weight_comp", None) is not None


def logical_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A flashrl layer's quantized codes in their logical [out, in] row order (a copy when packed, else the
    weight itself): what dequantize_rows(codes, layer.weight_scale) takes."""
    if not is_packed(layer):
        return layer.weight.data
    from flashrl_kernels.native.quantize import unpack_rows

    return unpack_rows(layer.weight.data)


def _scaled_linear(layer: torch.nn.Module, x: torch.Tensor, bias, mode: str) -> torch.Tensor:
    k = x.shape[-1]
    if is_packed(layer):  # its codes are only readable by the packed kernel
        y = torch.ops.flashrl_native.qlinear_packed(x.reshape(-1, k), layer.weight, layer.weight_scale,
                                                     layer.weight_comp, bias)
        return y.view(*x.shape[:-1], y.shape[-1])
    if not hasattr(layer, "_flashrl_act_quant"):
        prepare_layer(layer, mode)
    op = layer._flashrl_direct or torch.ops.flashrl.scaled_linear
    y = op(x.reshape(-1, k), layer.weight, layer.weight_scale, bias, layer._flashrl_act_quant)
    return y.view(*x.shape[:-1], y.shape[-1])


class SyncStats:
    """What the quantizing loaders saw during one weight sync on this rank (see collect_sync_stats)."""

    def __init__(self):
        self.codes_changed = 0  # quantized codes whose value differs after the write
        self.codes_total = 0  # quantized codes written
        self.rel_scale_changes: list[torch.Tensor] = []  # per written shard: max |s_new - s_old| / s_old

    def max_rel_scale_change(self) -> float:
        if not self.rel_scale_changes:
            return 0.0
        return float(torch.stack([t.float().cpu() for t in self.rel_scale_changes]).max())


# per thread (and asyncio task): two in-process engines synced from two threads at once keep separate counts
_sync_stats: contextvars.ContextVar[SyncStats | None] = contextvars.ContextVar("flashrl_sync_stats", default=None)


@contextlib.contextmanager
def collect_sync_stats():
    """Within the block, every quantizing loader also counts the codes it changes and the row scales' largest
    relative change; yields the SyncStats. Outside it (engine start-up) loaders do only the write."""
    stats = SyncStats()
    token = _sync_stats.set(stats)
    try:
        yield stats
    finally:
        _sync_stats.reset(token)


class FlashRLQuantizedWeight(ModelWeightParameter):
    """A [out, in] int8/fp8 weight whose loaders quantize bf16/fp32 input into place.

    The per-row scales live in the owning layer's `weight_scale` buffer; the
    parameter keeps a weak reference to its layer (the layer object survives
    vLLM's layerwise reload, which swaps the tensors but not the module).
    """

    def _layer(self):
        layer = self._flashrl_layer()
        if layer is None:
            raise RuntimeError("flashrl quantized weight outlived its layer")
        return layer

    def _write(self, row_offset: int, src: torch.Tensor) -> None:
        rows = src.shape[0]
        q = self.data.narrow(0, row_offset, rows)
        if q.is_meta:
            # vLLM's layerwise reload first runs loaders on meta tensors to count the
            # loaded elements (it counts copy_ calls): mirror the copy it expects
            q.copy_(src)
            return
        if tuple(src.shape) != tuple(q.shape):
            raise ValueError(
                f"flashrl: a tensor of shape {tuple(src.shape)} cannot be loaded into rows "
                f"[{row_offset}, {row_offset + rows}) of a weight of shape {tuple(self.data.shape)}"
            )
        if src.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            src = src.float()
        if src.device != q.device:
            # non_blocking only towards a GPU (the quantizer runs on its stream after the copy); a GPU -> CPU copy
            # must have landed before the CPU quantizer reads it
            src = src.to(q.device, non_blocking=q.device.type != "cpu")
        if src.stride(-1) != 1:
            src = src.contiguous()
        layer = self._layer()
        # the sync validated the values (finite in fp32) up front; at start-up a non-finite checkpoint row gives
        # scale NaN
        stats = _sync_stats.get()
        if is_packed(layer):
            from flashrl_kernels.native.quantize import quantize_rows_packed_

            scale = layer.weight_scale
            old_scale = scale.narrow(0, row_offset, rows).clone() if stats is not None else None
            changed = quantize_rows_packed_(src, self.data, scale, layer.weight_comp, row_offset, stats is not None)
            if stats is not None:
                stats.codes_changed += changed
                stats.codes_total += rows * self.data.shape[1]
                new = scale.narrow(0, row_offset, rows)
                stats.rel_scale_changes.append(((new - old_scale).abs() / old_scale).max())
            return
        scale = layer.weight_scale.narrow(0, row_offset, rows)
        if stats is None:
            torch.ops.flashrl.quantize_rows_(src, q, scale)
            return
        from flashrl_kernels.ops.quantize import quantize_rows_counted_

        old_scale = scale.clone()
        stats.codes_changed += quantize_rows_counted_(src, q, scale)
        stats.codes_total += q.numel()
        stats.rel_scale_changes.append(((scale - old_scale).abs() / old_scale).max())

    # -- the four entry points vLLM's layer loaders (weight_loader_v2) call --

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor):
        n = self.data.shape[self.output_dim]
        self._write(0, loaded_weight.narrow(self.output_dim, self.tp_rank * n, n))

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, **kwargs):
        shard_offset: int = kwargs["shard_offset"]
        shard_size: int = kwargs["shard_size"]
        src = loaded_weight.narrow(self.output_dim, self.tp_rank * shard_size, shard_size)
        self._write(shard_offset, src)

    def load_qkv_weight(self, loaded_weight: torch.Tensor, **kwargs):
        shard_offset: int = kwargs["shard_offset"]
        shard_size: int = kwargs["shard_size"]
        shard_id = kwargs["shard_id"]
        num_heads: int = kwargs["num_heads"]  # KV-head replicas, as vLLM passes it
        shard_rank = self.tp_rank if shard_id == "q" else self.tp_rank // num_heads
        self._write(shard_offset, loaded_weight.narrow(self.output_dim, shard_rank * shard_size, shard_size))

    def load_replicated_weight(self, loaded_weight: torch.Tensor):
        """A ReplicatedLinear's whole weight: every rank holds (and quantizes) every row."""
        self._write(0, loaded_weight)

    def load_vocab_weight(self, loaded_weight: torch.Tensor):
        """An embedding / LM head table, as VocabParallelEmbedding.weight_loader lays it out.

        Rows [0, n) get this rank's slice of the original vocabulary (n =
        org_vocab_end_index - org_vocab_start_index), quantized; the padding rows
        after them (vLLM pads the vocabulary to a multiple of 64) are written as
        zero rows with scale 1, the spec's encoding of a zero row, exactly as
        vLLM's loader fills them with zeros.
        """
        layer = self._layer()
        if loaded_weight.dim() != 2 or loaded_weight.shape[0] != layer.org_vocab_size:
            raise ValueError(
                f"flashrl: a tensor of shape {tuple(loaded_weight.shape)} cannot be loaded into an embedding "
                f"with a vocabulary of {layer.org_vocab_size} rows of width {self.data.shape[1]}"
            )
        start = layer.shard_indices.org_vocab_start_index
        n = layer.shard_indices.org_vocab_end_index - start
        self._write(0, loaded_weight.narrow(0, start, n))
        pad = self.data.narrow(0, n, self.data.shape[0] - n)
        if pad.numel() and not pad.is_meta:
            if is_packed(layer):  # zero rows, scale 1, sum 0: the quantizer's encoding of a zero row
                from flashrl_kernels.native.quantize import quantize_rows_packed_

                quantize_rows_packed_(torch.zeros(pad.shape, dtype=torch.float32), self.data, layer.weight_scale,
                                      layer.weight_comp, n, False)
            else:
                pad.zero_()
                layer.weight_scale.narrow(0, n, pad.shape[0]).fill_(1.0)
            stats = _sync_stats.get()
            if stats is not None:  # written too, never changed: zeros since the first load
                stats.codes_total += pad.numel()

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor):
        """This rank's input columns of every row, quantized with a scale of their own (shard-local).

        The layer's output is the all-reduced sum over ranks of x_r @ (q_r * s_r).T, every shard
        dequantized by its own row scales before the sum, so the result is the exact product of x with
        the shard-wise quantized weight; a shard's amax is at most the full row's, so its grid is as fine
        or finer than TP = 1's. No rank needs another rank's data, at load or at a sync.
        """
        k = self.data.shape[self.input_dim]
        if loaded_weight.dim() != 2 or loaded_weight.shape[self.output_dim] != self.data.shape[self.output_dim] \
                or loaded_weight.shape[self.input_dim] != k * self.tp_size:
            raise ValueError(
                f"flashrl: a tensor of shape {tuple(loaded_weight.shape)} cannot be loaded into a row-parallel "
                f"weight of shape {tuple(self.data.shape)} at tensor-parallel size {self.tp_size}"
            )
        self._write(0, loaded_weight.narrow(self.input_dim, self.tp_rank * k, k))


def _vocab_weight_loader(param: FlashRLQuantizedWeight, loaded_weight: torch.Tensor) -> None:
    """The `weight_loader` of a quantized embedding / LM head weight (vLLM's loaders call it by name;
    its first argument must be called `param` for vLLM's layerwise reload)."""
    param.load_vocab_weight(loaded_weight)


def _replicated_weight_loader(param: FlashRLQuantizedWeight, loaded_weight: torch.Tensor) -> None:
    """The `weight_loader` of a quantized ReplicatedLinear weight, in place of the layer's own (a copy_)."""
    param.load_replicated_weight(loaded_weight)


def _new_quantized_weight(layer: torch.nn.Module, rows: int, cols: int, dtype: torch.dtype, weight_loader,
                          mode: str, layout: str = "auto"):
    """Register layer.weight [rows, cols] (int8/fp8, zeros) and layer.weight_scale [rows] (fp32, ones); and, when
    the weight is stored packed (_packed_layout), layer.weight_comp [rows] (int32 row code sums, zeros)."""
    data = torch.zeros(rows, cols, dtype=torch.int8).to(dtype)
    packed = layout == "auto" and _packed_layout(data, mode)
    weight = FlashRLQuantizedWeight(data=data, input_dim=1, output_dim=0, weight_loader=weight_loader)
    weight._flashrl_layer = weakref.ref(layer)
    layer.register_parameter("weight", weight)
    # buffers, not parameters: written by the weight's loader, never loaded by name
    scale = torch.ones(rows, dtype=torch.float32)
    scale.weight_loader_numel = 0  # tells vLLM's layerwise reload that no loader fills it by name
    layer.register_buffer("weight_scale", scale)
    if packed:
        comp = torch.zeros(rows, dtype=torch.int32)
        comp.weight_loader_numel = 0
        layer.register_buffer("weight_comp", comp)
    return weight


class FlashRLLinearMethod(LinearMethodBase):
    """Per-output-row INT8/FP8 weights; W8A8 or weight-only as use_activation_quant decides per device."""

    def __init__(self, config: FlashRLQuantConfig):
        self.config = config

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        weight_loader = extra_weight_attrs.pop("weight_loader")
        if isinstance(layer, ReplicatedLinear):
            if getattr(weight_loader, "__func__", None) is not ReplicatedLinear.weight_loader:
                # a subclass's own loader: what it does to the tensor before its copy_ is unknown here
                raise NotImplementedError(f"flashrl: cannot quantize {type(layer).__name__} {layer.prefix!r}: "
                                          "it overrides ReplicatedLinear.weight_loader")
            weight_loader = _replicated_weight_loader
        rows = sum(output_partition_sizes)
        weight = _new_quantized_weight(layer, rows, input_size_per_partition, self.config.weight_dtype, weight_loader,
                                       self.config.activation_quant, self.config.weight_layout)
        for key, value in extra_weight_attrs.items():
            setattr(weight, key, value)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        prepare_layer(layer, self.config.activation_quant)  # the weights are already in kernel format

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _scaled_linear(layer, x, bias, self.config.activation_quant)


class FlashRLEmbeddingMethod(UnquantizedEmbeddingMethod):
    """Model-dtype embeddings / LM head that always compute from `layer.weight` (so in-place syncs show)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if layer.weight.device.type == "cpu":
            # skip vLLM's CPU repacking (it would freeze a private copy of the weight); the head runs the native
            # bf16 kernel on the stored rows (~2x torch's bf16 F.linear at decode with AVX-512 BF16, far more
            # on AVX2-only CPUs, where torch's bf16 GEMM is ~1 GFLOP/s)
            from flashrl_kernels.ops.quantize import direct_bf16_linear

            layer._flashrl_direct = None if layer.weight.is_meta else direct_bf16_linear(layer.weight)
            return
        super().process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.weight.device.type == "cpu":
            op = getattr(layer, "_flashrl_direct", None)
            if op is not None and x.dtype == torch.bfloat16:
                k = x.shape[-1]
                return op(x.reshape(-1, k), layer.weight, bias).view(*x.shape[:-1], layer.weight.shape[0])
            return torch.nn.functional.linear(x, layer.weight, bias)
        return super().apply(layer, x, bias)


class FlashRLQuantizedEmbeddingMethod(QuantizeMethodBase):
    """INT8/FP8 LM head (option quantize_lm_head): per-row quantized vocabulary rows, logits by scaled_linear.

    Not an UnquantizedEmbeddingMethod on purpose: vLLM code that would read
    `lm_head.weight` as a plain float matrix (e.g. a head_dtype override)
    checks for that class and refuses a quantized head instead of casting
    int8 codes without their scales.

    Tied embeddings: tie_weights (which vLLM models call as
    lm_head.tie_weights(embed_tokens)) turns the input embedding into a user of
    the same table: one int8/fp8 weight and one scale buffer, shared by both
    modules; `embedding` gathers the rows of the looked-up ids and dequantizes
    them (q * scale in fp32, rounded once to the model dtype). One copy, half
    the bytes of the bf16 table, and a sync writes it once.
    """

    def __init__(self, config: FlashRLQuantConfig):
        self.config = config

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        rows = sum(output_partition_sizes)
        weight = _new_quantized_weight(
            layer, rows, input_size_per_partition, self.config.weight_dtype, _vocab_weight_loader,
            self.config.activation_quant, self.config.weight_layout,
        )
        # elements a load writes from the checkpoint (padding rows excluded), for vLLM's layerwise reload
        weight.weight_loader_numel = layer.num_org_embeddings_per_partition * input_size_per_partition

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        prepare_layer(layer, self.config.activation_quant)  # already in kernel format

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _scaled_linear(layer, x, bias, self.config.activation_quant)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        q = layer.weight
        ids = input_.reshape(-1)
        if is_packed(layer):
            rows = torch.ops.flashrl_native.unpack_rows(q, ids)
        else:  # gather through an int8 view: a plain byte gather for int8 and fp8 alike
            rows = q.view(torch.int8).index_select(0, ids).view(q.dtype)
        out = torch.ops.flashrl.dequantize_rows(rows, layer.weight_scale.index_select(0, ids), layer.params_dtype)
        return out.view(*input_.shape, q.shape[1])

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module):
        """Share one quantized table between the LM head `layer` and the input embedding."""
        if not isinstance(embed_tokens, VocabParallelEmbedding):
            raise NotImplementedError(f"flashrl: cannot tie a quantized LM head to a {type(embed_tokens).__name__}")
        if not isinstance(embed_tokens.quant_method, FlashRLQuantizedEmbeddingMethod):
            # the embedding was built in the model dtype: rebuild its weight quantized, owned by it
            # (its loader is the one vLLM calls for the checkpoint's embed_tokens tensor)
            del embed_tokens.weight
            for buf in ("weight_scale", "weight_comp"):
                if buf in embed_tokens._buffers:
                    delattr(embed_tokens, buf)
            self.create_weights(
                embed_tokens,
                embed_tokens.embedding_dim,
                [embed_tokens.num_embeddings_per_partition],
                embed_tokens.embedding_dim,
                embed_tokens.num_embeddings_padded,
                params_dtype=embed_tokens.params_dtype,
            )
            embed_tokens.quant_method = self
            embed_tokens.update_param_tp_status()
        if tuple(embed_tokens.weight.shape) != tuple(layer.weight.shape):
            raise ValueError(
                f"flashrl: cannot tie an LM head of shape {tuple(layer.weight.shape)} to an embedding of shape "
                f"{tuple(embed_tokens.weight.shape)}"
            )
        layer.weight = embed_tokens.weight
        layer.weight_scale = embed_tokens.weight_scale
        if is_packed(embed_tokens):
            layer.weight_comp = embed_tokens.weight_comp
        return layer


class FlashRLQuantConfig(QuantizationConfig):
    """Options (hf_overrides={"quantization_config_dict_json": json.dumps({...})}):
    activation_quant: "auto" (dynamic per-token W8A8 for INT8 on CUDA and on CPUs whose native build has integer
                      dot products: AVX-512 VNNI, AVX2; weight-only elsewhere and for FP8), "dynamic" or "none".
    quantize_lm_head: False (default: embeddings and LM head in the model dtype) or True
                      (INT8/FP8 LM head; a tied input embedding shares its quantized table).
    weight_layout:    "auto" (INT8 W8A8 layers on AVX-512 VNNI and AVX2 CPUs store their codes in the packed
                      kernel's order) or "plain" (always [out, in] rows: the plain-layout kernel, e.g. to compare the two).
    """

    weight_dtype: torch.dtype = torch.int8
    method_name: str = ""

    def __init__(self, activation_quant: str = "auto", quantize_lm_head: bool = False, weight_layout: str = "auto"):
        super().__init__()
        if activation_quant not in _ACT_QUANT:
            raise ValueError(f"activation_quant must be one of {_ACT_QUANT}, got {activation_quant!r}")
        if not isinstance(quantize_lm_head, bool):
            raise TypeError(f"quantize_lm_head must be true or false, got {quantize_lm_head!r}")
        if weight_layout not in _LAYOUTS:
            raise ValueError(f"weight_layout must be one of {_LAYOUTS}, got {weight_layout!r}")
        self.activation_quant = activation_quant
        self.quantize_lm_head = quantize_lm_head
        self.weight_layout = weight_layout

    def get_name(self) -> str:
        return self.method_name

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 75  # the scaled matmul falls back to dequantize + matmul where W8A8 GEMMs are missing

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # quantized online from a bf16/fp32 checkpoint: nothing to read

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FlashRLQuantConfig:
        if not isinstance(config, dict):
            raise TypeError(f"{cls.method_name} options must be a JSON object, got {config!r}")
        # a checkpoint's config.json may select the method itself ("quantization_config": {"quant_method":
        # "flashrl_int8", ...}): the way frameworks without a quantization option (AReaL) pick it
        method = config.get("quant_method", cls.method_name)
        if method != cls.method_name:
            raise ValueError(f"{cls.method_name}: the options name quant_method {method!r}")
        config = {k: v for k, v in config.items() if k != "quant_method"}
        unknown = sorted(set(config) - set(OPTIONS))
        if unknown:
            valid = ", ".join(f"{k}: {v}" for k, v in OPTIONS.items())
            raise ValueError(f"unknown {cls.method_name} option(s) {unknown}; valid options are {{{valid}}}")
        return cls(
            activation_quant=config.get("activation_quant", "auto"),
            quantize_lm_head=config.get("quantize_lm_head", False),
            weight_layout=config.get("weight_layout", "auto"),
        )

    @classmethod
    def from_config_dict_json(cls, text: str) -> FlashRLQuantConfig:
        return cls.from_config(json.loads(text))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            return FlashRLLinearMethod(self)
        if isinstance(layer, ParallelLMHead) and self.quantize_lm_head:
            return FlashRLQuantizedEmbeddingMethod(self)
        if isinstance(layer, VocabParallelEmbedding):
            return FlashRLEmbeddingMethod()
        return None


class FlashRLInt8Config(FlashRLQuantConfig):
    weight_dtype = torch.int8
    method_name = "flashrl_int8"


class FlashRLFp8Config(FlashRLQuantConfig):
    weight_dtype = torch.float8_e4m3fn
    method_name = "flashrl_fp8"


class _QuantizingLoadFilter(logging.Filter):
    """Drops vLLM's "Attempted to load weight X with dtype bfloat16 into parameter with dtype int8" warning:
    for a flashrl weight that is the quantizing loader's job, not a mistake (48 lines per load or sync of a
    24-layer model, from the layers vLLM loads by name: o_proj, down_proj)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith("Attempted to load weight") and len(args) == 3
                    and args[2] in (torch.int8, torch.float8_e4m3fn) and args[1] in _FLOAT_SOURCES)


_FLOAT_SOURCES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def register_configs() -> None:
    register_quantization_config("flashrl_int8")(FlashRLInt8Config)
    register_quantization_config("flashrl_fp8")(FlashRLFp8Config)
    register_weight_loader_v2_supported_method(FlashRLLinearMethod)
    logger = logging.getLogger("vllm.model_executor.models.utils")
    if not any(isinstance(f, _QuantizingLoadFilter) for f in logger.filters):
        logger.addFilter(_QuantizingLoadFilter())
