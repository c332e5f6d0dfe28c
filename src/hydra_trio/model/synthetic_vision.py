"""Write a vision projector (an "mmproj" GGUF) for a synthetic text model: a tiny CLIP-style
vision tower and LLaVA's two-layer MLP projector ("mlp"), random fixed-seed weights, as
llama.cpp's clip loader reads them (tools/mtmd/clip.cpp, clip-impl.h).

``hydra-trio make-model --preset vision OUT`` writes the text model ``OUT`` (the ``tiny``
preset's shape) and its projector ``OUT.mmproj.gguf``; the projector's output width is the
text model's ``n_embd`` (mtmd refuses a mismatch). An image is resized to ``IMAGE_SIZE``
square and cut into ``PATCH_SIZE`` patches: one image is ``image_tokens()`` positions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .synthetic import PRESETS, write_model

VISION_TEXT_PRESET = "tiny"  # the text model the vision preset writes beside its projector
MMPROJ_SUFFIX = ".mmproj.gguf"


@dataclass(frozen=True, slots=True)
class VisionTower:
    n_embd: int = 32
    n_ff: int = 64  # must differ from n_embd: clip.cpp reads ffn_down's input width to spot swapped legacy files
    n_layer: int = 2  # llava's graph runs all but the last
    n_head: int = 4
    image_size: int = 32
    patch_size: int = 8
    proj_hidden: int = 64


TOWER = VisionTower()


def image_tokens(tower: VisionTower = TOWER) -> int:
    """Positions one image takes in the text model (llava: one per patch)."""
    return (tower.image_size // tower.patch_size) ** 2


def mmproj_path(model_path: str | os.PathLike[str]) -> Path:
    """Where ``write_vision_model`` puts a text model's projector."""
    p = Path(model_path)
    return p.with_name(p.name + MMPROJ_SUFFIX)


def write_vision_model(path: str | os.PathLike[str], *, seed: int = 0) -> tuple[Path, Path]:
    """The text model at ``path`` and its projector beside it; returns both paths."""
    model = write_model(path, VISION_TEXT_PRESET, seed=seed, name="Hydra Synthetic Vision")
    proj = write_mmproj(mmproj_path(model), n_embd_text=PRESETS[VISION_TEXT_PRESET].n_embd, seed=seed)
    return model, proj


def write_mmproj(path: str | os.PathLike[str], *, n_embd_text: int, seed: int = 0, tower: VisionTower = TOWER) -> Path:
    """A LLaVA-style projector GGUF (arch "clip", projector "mlp") whose output is
    ``n_embd_text`` wide. All f32 except the patch embedding (f16, as converters write it:
    ggml's im2col for a convolution kernel)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    t = tower
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_name("Hydra Synthetic Vision Projector")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_audio_encoder", False)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.embedding_length", t.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", t.n_ff)
    w.add_uint32("clip.vision.block_count", t.n_layer)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", t.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.image_size", t.image_size)
    w.add_uint32("clip.vision.patch_size", t.patch_size)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    rng = np.random.default_rng(seed + 7919)  # not the text model's stream
    d, ff = t.n_embd, t.n_ff
    n_pos = image_tokens(t) + 1  # the class embedding's position first

    def f32(*shape: int, std: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    def norm(prefix: str) -> None:
        w.add_tensor(prefix + ".weight", np.ones(d, dtype=np.float32))
        w.add_tensor(prefix + ".bias", np.zeros(d, dtype=np.float32))

    # numpy shapes are ggml's reversed: the patch kernel is ggml [patch, patch, 3, d].
    w.add_tensor("v.patch_embd.weight", f32(d, 3, t.patch_size, t.patch_size, std=0.2).astype(np.float16))
    w.add_tensor("v.class_embd", f32(d))
    w.add_tensor("v.position_embd.weight", f32(n_pos, d))
    norm("v.pre_ln")
    for i in range(t.n_layer):
        p = f"v.blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(p + name + ".weight", f32(d, d))
            w.add_tensor(p + name + ".bias", np.zeros(d, dtype=np.float32))
        norm(p + "ln1")
        norm(p + "ln2")
        w.add_tensor(p + "ffn_up.weight", f32(ff, d))
        w.add_tensor(p + "ffn_up.bias", np.zeros(ff, dtype=np.float32))
        w.add_tensor(p + "ffn_down.weight", f32(d, ff))
        w.add_tensor(p + "ffn_down.bias", np.zeros(d, dtype=np.float32))
    # LLaVA's projector: linear, GELU, linear, into the text model's embedding width.
    w.add_tensor("mm.0.weight", f32(t.proj_hidden, d))
    w.add_tensor("mm.0.bias", np.zeros(t.proj_hidden, dtype=np.float32))
    w.add_tensor("mm.2.weight", f32(n_embd_text, t.proj_hidden, std=0.5))
    w.add_tensor("mm.2.bias", np.zeros(n_embd_text, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)  # atomic, as the text model's writer
    return out
