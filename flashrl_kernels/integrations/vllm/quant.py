"""flashrl_int8 / flashrl_fp8: vLLM quantization methods whose weights are stored quantized and loaded in place.

Every linear layer (column, row, QKV, merged gate/up) gets
  weight        [out, in]  torch.int8 or torch.float8_e4m3fn   (a vLLM ModelWeightParameter)
  weight_scale  [out]      fp32, one scale per output row      (a buffer)
and no bf16 copy. The weight's loader takes the bf16/fp32 tensor that vLLM's
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
then quantizes instead of copying.

Embeddings and the LM head stay in the model dtype (their quantization error
would land directly on the logits), with a method that keeps reading
`layer.weight` so in-place syncs of them are seen (vLLM's default CPU method
repacks the LM head into a private copy).

Tensor parallelism: TP = 1 is implemented; see docs/quantized_rollout.md for
the TP > 1 plan (per-row scales are shard-local for column-parallel layers;
row-parallel layers need the amax of the full row before sharding).
"""
from __future__ import annotations

import json
import weakref
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.parameter import ModelWeightParameter

import flashrl_kernels  # noqa: F401  (registers the torch.library ops)

_ACT_QUANT = ("auto", "dynamic", "none")


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
            src = src.to(q.device, non_blocking=True)
        if src.stride(-1) != 1:
            src = src.contiguous()
        scale = self._layer().weight_scale.narrow(0, row_offset, rows)
        # the sync validated finiteness up front; at start-up a non-finite checkpoint row gives scale NaN
        torch.ops.flashrl.quantize_rows_(src, q, scale)

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

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor):
        # TP = 1 only (enforced in create_weights): the full row is this rank's row
        if tuple(loaded_weight.shape) != tuple(self.data.shape):
            raise ValueError(
                f"flashrl: a tensor of shape {tuple(loaded_weight.shape)} cannot be loaded into a weight of "
                f"shape {tuple(self.data.shape)}"
            )
        self._write(0, loaded_weight)


class FlashRLLinearMethod(LinearMethodBase):
    """Per-output-row INT8/FP8 weights; weight-only on CPU, dynamic W8A8 on a GPU by default."""

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
        if getattr(layer, "tp_size", 1) != 1:
            raise NotImplementedError(
                f"{self.config.get_name()} supports tensor_parallel_size=1 only for now "
                "(see docs/quantized_rollout.md, 'Tensor parallelism')"
            )
        weight_loader = extra_weight_attrs.pop("weight_loader")
        rows = sum(output_partition_sizes)
        weight = FlashRLQuantizedWeight(
            data=torch.zeros(rows, input_size_per_partition, dtype=torch.int8).to(self.config.weight_dtype),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        weight._flashrl_layer = weakref.ref(layer)
        layer.register_parameter("weight", weight)
        # a buffer, not a parameter: it is written by the weight's loader, never loaded by name
        scale = torch.ones(rows, dtype=torch.float32)
        scale.weight_loader_numel = 0  # tells vLLM's layerwise reload that no loader fills it by name
        layer.register_buffer("weight_scale", scale)
        for key, value in extra_weight_attrs.items():
            setattr(weight, key, value)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return  # weights are already in kernel format: [out, in] rows and fp32 scales

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        act = self.config.activation_quant
        act_quant = x.is_cuda if act == "auto" else act == "dynamic"
        k = x.shape[-1]
        y = torch.ops.flashrl.scaled_linear(x.reshape(-1, k), layer.weight, layer.weight_scale, bias, act_quant)
        return y.view(*x.shape[:-1], y.shape[-1])


class FlashRLEmbeddingMethod(UnquantizedEmbeddingMethod):
    """Model-dtype embeddings / LM head that always compute from `layer.weight` (so in-place syncs show)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if layer.weight.device.type == "cpu":
            return  # skip vLLM's CPU repacking: it would freeze a private copy of the weight
        super().process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.weight.device.type == "cpu":
            return torch.nn.functional.linear(x, layer.weight, bias)
        return super().apply(layer, x, bias)


class FlashRLQuantConfig(QuantizationConfig):
    """Options (hf_overrides={"quantization_config_dict_json": json.dumps({...})}):
    activation_quant: "auto" (dynamic per-token W8A8 on CUDA, weight-only elsewhere),
                      "dynamic" or "none".
    """

    weight_dtype: torch.dtype = torch.int8
    method_name: str = ""

    def __init__(self, activation_quant: str = "auto"):
        super().__init__()
        if activation_quant not in _ACT_QUANT:
            raise ValueError(f"activation_quant must be one of {_ACT_QUANT}, got {activation_quant!r}")
        self.activation_quant = activation_quant

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
        return cls(activation_quant=config.get("activation_quant", "auto"))

    @classmethod
    def from_config_dict_json(cls, text: str) -> FlashRLQuantConfig:
        return cls.from_config(json.loads(text))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            return FlashRLLinearMethod(self)
        if isinstance(layer, VocabParallelEmbedding):
            return FlashRLEmbeddingMethod()
        return None


class FlashRLInt8Config(FlashRLQuantConfig):
    weight_dtype = torch.int8
    method_name = "flashrl_int8"


class FlashRLFp8Config(FlashRLQuantConfig):
    weight_dtype = torch.float8_e4m3fn
    method_name = "flashrl_fp8"


def register_configs() -> None:
    register_quantization_config("flashrl_int8")(FlashRLInt8Config)
    register_quantization_config("flashrl_fp8")(FlashRLFp8Config)
    register_weight_loader_v2_supported_method(FlashRLLinearMethod)
