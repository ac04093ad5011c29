"""The composite model: vision tower + fusion + decoder, and `build_model`. The composite sits
here, above the decoders of runtime/models/, because it needs the vision towers and the fusion of
this folder (imports only go downwards).

The config's family (runtime/families/) names the tower, the decoder and the composite class
as "module:Class" strings, resolved here; every family so far uses `VisionLanguageModel`. A tower
whose rows also carry DeepStack levels has them split off by the fusion step and added by the
decoder after its first layers (see vision/fusion.py).

The vision tower runs in TP mode (sharded like the decoder, with per-layer all-reduce), in DP
mode (a full replica on every rank; the batch's frames, a video's temporal patches or an image's
tiles, are balanced over the ranks and the results all-gathered once), or in auto mode (a full
replica; each encoder call runs DP, TP on slices of the full weights, or a hybrid, as
vision/encoder_plan.py plans it and vision/auto_encoder.py runs it).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import torch
from torch import nn

from kernels.attention import AttentionBackend, create_attention_backend
from kernels.ops import TORCH_OPS, KernelOps, get_kernel_ops
from runtime.distributed import TPGroup
from runtime.forward_batch import ForwardBatch, ForwardMode
from runtime.layers.linear import prepare_shard_weights, use_onednn_linears
from runtime.layers.weights import LazyWeight
from runtime.model_config import ModelConfig, ModelConfigError
from runtime.model_loader import load_checkpoint, resolve_dtype
from runtime.multimodal import ItemEncoder, MultimodalDataItem
from runtime.server_args import CPU_LINEAR_PATHS
from vision.auto_encoder import AutoEncoder
from vision.dp_encoder import run_dp_over_frames
from vision.encoder_calibration import calibrate_encoder_costs
from vision.encoder_plan import ENCODER_MODES, EncoderCosts, TowerShape
from vision.fusion import fuse_embeddings
from vision.vit_common import pad_vision_mlps


def resolve_class(path: str) -> type:
    """The class a family names as "module:Class" (imported now, not at file level)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def vision_tower_class(config: ModelConfig) -> type:
    """The vision tower class of the config's family."""
    return resolve_class(config.family.tower_class)


class VisionEncoderModel(nn.Module):
    """The vision tower (its projector or merger included) in one of the encoder modes: what a
    composite model's encode step runs, and all that an encoder server (`--encoder-only`) loads.
    `encode_items` returns each item's rows, DeepStack levels included where the tower has them."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        encoder_mode: str = "tp",
        ops: KernelOps = TORCH_OPS,
        tower: bool = True,
    ):
        super().__init__()
        if encoder_mode not in ENCODER_MODES:
            raise ValueError(f"encoder mode {encoder_mode!r} is not one of {ENCODER_MODES}")
        self.config = config
        self.tp = tp
        self.encoder_mode = encoder_mode if tp.size > 1 and tower else "tp"
        if self.encoder_mode == "auto" and config.vision.num_heads % tp.size:
            raise ValueError(
                f"auto encoder mode shards the vision tower's {config.vision.num_heads} heads "
                f"over up to {tp.size} ranks, which that count does not divide; use the tp "
                "(padded heads, where the tower pads them) or dp encoder mode"
            )
        vision_tp = tp if self.encoder_mode == "tp" else TPGroup()
        self.visual = vision_tower_class(config)(config.vision, vision_tp, ops) if tower else None
        self.auto_encoder: AutoEncoder | None = None  # auto mode: set by set_encoder_costs

    @property
    def plan_counts(self) -> dict[str, int]:
        """Auto mode: encoder calls per plan kind."""
        return dict(self.auto_encoder.plan_counts) if self.auto_encoder else {}

    @property
    def dp_encoder(self) -> bool:
        return self.encoder_mode == "dp"

    @property
    def tower_shape(self) -> TowerShape:
        return TowerShape.of(self.config.vision, self.visual.dtype.itemsize)

    def set_encoder_costs(self, costs: EncoderCosts | None) -> None:
        """Auto mode: use `costs`, or calibrate now (every rank must call this together)."""
        if self.encoder_mode != "auto":
            raise RuntimeError("encoder costs apply only to the auto encoder mode")
        if self.tp.size > 1:  # before the memory plan reads what is free
            prepare_shard_weights(self.visual, self.tp)
        if costs is None:
            costs = calibrate_encoder_costs(self.visual, self.tp, self.tower_shape)
        self.auto_encoder = AutoEncoder(self.visual, self.tp, self.tower_shape, costs)

    def encode_items(self, items: list[MultimodalDataItem]) -> dict[int, torch.Tensor]:
        """Vision embeddings per item hash; every rank calls this with the same items. Items an
        encoder server has encoded (`embedded`) bring their rows; the others run the tower."""
        out = {i.hash: self._arrived(i.feature) for i in items if i.embedded}
        pixels = [i for i in items if not i.embedded]
        if pixels:
            out |= self._encode_pixels(pixels)
        return out

    def _arrived(self, rows: torch.Tensor) -> torch.Tensor:
        weight = next(self.parameters())
        return rows.to(weight.device, weight.dtype)

    def _encode_pixels(self, items: list[MultimodalDataItem]) -> dict[int, torch.Tensor]:
        if self.visual is None:
            raise RuntimeError("this server's ranks have no vision tower (--encoder-urls)")
        pixels = [item.feature for item in items]  # joined only where a mode slices them
        grids = [list(item.grid_thw) for item in items]
        out = self._encode(pixels, grids)
        merge = self.config.vision.spatial_merge_size**2
        rows = [item.num_patches // merge for item in items]
        return {item.hash: emb for item, emb in zip(items, out.split(rows))}

    def _encode(self, blocks: list[torch.Tensor], grids: list[list[int]]) -> torch.Tensor:
        if self.encoder_mode == "tp":  # the tower's patch embedding reads the blocks in place
            return self.visual(blocks, torch.tensor(grids, dtype=torch.long))
        pixels = torch.cat(blocks).to(self.visual.dtype)
        if self.encoder_mode == "dp":  # balanced by frames (tiles), as auto mode plans
            merge = self.config.vision.spatial_merge_size
            return run_dp_over_frames(self.visual, pixels, grids, self.tp, merge)
        if self.auto_encoder is None:
            raise RuntimeError("auto encoder mode needs set_encoder_costs() before encoding")
        return self.auto_encoder(pixels, grids)

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight]]) -> set[str]:
        """Load the tower's tensors of the checkpoint; the decoder's are skipped unread."""
        vision = []
        for name, weight in weights:
            name = self.config.family.checkpoint_name(name)
            if name.startswith("visual."):
                vision.append((name[len("visual.") :], weight))
        return {"visual." + n for n in self.visual.load_weights(vision)}


class VisionLanguageModel(VisionEncoderModel):
    """Vision tower + fusion + decoder. Media tokens attend causally, like text, or (a family
    whose image attention is "bidirectional_item") to every token of their own item as well:
    the scheduler's model runner gives the batch each token's item span. A composite lacking
    a family's rule refuses it here (`IMAGE_ATTENTION`)."""

    IMAGE_ATTENTION: tuple[str, ...] = ("causal", "bidirectional_item")

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup,
        backend: AttentionBackend,
        encoder_mode: str = "tp",
        ops: KernelOps = TORCH_OPS,
        tower: bool = True,
    ):
        if config.family.image_attention not in self.IMAGE_ATTENTION:
            raise ModelConfigError(
                f"image attention {config.family.image_attention!r} of family "
                f"{config.family.name!r} is not supported (supported: {self.IMAGE_ATTENTION})"
            )
        super().__init__(config, tp, encoder_mode, ops, tower)
        decoder = resolve_class(config.family.decoder_class)
        self.language_model = decoder(config.text, tp, backend, ops)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, encode: ItemEncoder | None = None) -> torch.Tensor:
        """Logits of the batch; media rows come from `encode` (the scheduler passes its encoder
        cache in front of `encode_items`), or straight from `encode_items`."""
        embeds = self.language_model.embed(batch.input_ids)
        deepstack = None
        if batch.mode == ForwardMode.EXTEND:
            levels = self.config.vision.num_deepstack
            embeds, deepstack = fuse_embeddings(batch, embeds, encode or self.encode_items, levels)
        return self.language_model(embeds, batch, deepstack)

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight]]) -> set[str]:
        """Load checkpoint tensors (any layout the family publishes, `Family.checkpoint_name`);
        returns the loaded params."""
        params = dict(self.language_model.named_parameters())
        loaded: set[str] = set()
        vision: list[tuple[str, LazyWeight]] = []
        for name, weight in weights:
            name = self.config.family.checkpoint_name(name)
            if name.startswith("visual."):
                vision.append((name[len("visual.") :], weight))
                continue
            if name == "lm_head.weight" and self.config.text.tie_word_embeddings:
                continue
            target, shard = self.language_model.checkpoint_target(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            args = (shard,) if shard is not None else ()
            param.weight_loader(param, weight, *args)
            loaded.add("language_model." + target)
        if self.visual is not None:  # else the tower's tensors stay unread
            loaded |= {"visual." + n for n in self.visual.load_weights(vision)}
        if self.config.text.tie_word_embeddings:
            loaded.add("language_model.lm_head.weight")
        return loaded


def build_model(
    model_path: str,
    tp: TPGroup,
    *,
    attention_backend: str = "torch",
    encoder_mode: str = "tp",
    encoder_costs: EncoderCosts | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    show_progress: bool = False,
    cpu_linear: str = "onednn",
    pad_vit_mlp: bool = True,
    encoder_only: bool = False,
    vision_tower: bool = True,
) -> VisionEncoderModel:
    """Build this rank's shard of the model and load its slice of the checkpoint.

    Auto encoder mode with tp > 1 uses `encoder_costs`, or calibrates them here (every rank).
    `cpu_linear` "onednn" packs the linear layers' CPU weights for oneDNN's matmul once loaded
    (runtime/layers/linear.py); "aten" keeps aten's (MKL) path. GPU weights are never packed.
    On CUDA the vision tower's MLP hidden size is zero-padded where its rows are not 16-byte
    aligned (Qwen2.5-VL's 3420; vision/vit_common.py `pad_vision_mlps`, exact); `pad_vit_mlp`
    False keeps the checkpoint's sizes (the server's `--disable-vit-mlp-padding`).
    `encoder_only`: the vision tower alone (`VisionEncoderModel`, an encoder server's model);
    `vision_tower` False: the composite without its tower (media come encoded, `--encoder-urls`)."""
    if cpu_linear not in CPU_LINEAR_PATHS:
        raise ValueError(f"cpu_linear {cpu_linear!r} is not one of {CPU_LINEAR_PATHS}")
    config = ModelConfig.from_dir(model_path)
    torch_dtype = resolve_dtype(dtype, config.torch_dtype, device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            ops = get_kernel_ops(attention_backend)
            if encoder_only:
                model = VisionEncoderModel(config, tp, encoder_mode, ops)
            else:
                backend = create_attention_backend(attention_backend)
                model_class = resolve_class(config.family.model_class)
                model = model_class(config, tp, backend, encoder_mode, ops, vision_tower)
    finally:
        torch.set_default_dtype(previous)
    load_checkpoint(model, model_path, show_progress)
    model.eval()
    on_cuda = torch.device(device).type == "cuda"
    if pad_vit_mlp and model.visual is not None and on_cuda:  # auto mode runs shards of tp
        pad_vision_mlps(model.visual, tp.size if model.encoder_mode == "auto" else 1)
    if cpu_linear == "onednn":
        use_onednn_linears(model)
    if model.encoder_mode == "auto":
        model.set_encoder_costs(encoder_costs)
    return model
