"""Qwen3-VL's vision tower (Qwen2-VL's ViT parametrized, with the DeepStack mergers) against transformers'.

A tiny random ``Qwen3VLVisionModel`` is mapped by name (:func:`~mmzoo.encoders.qwen3_vl_vision_weights`)
into ``Tower(qwen3_vl_vit(...), PatchMerger(..., deepstack_taps=2))``; for two images and a
two-frame video of different grids the main and DeepStack features match transformers' in float32
with each attention backend.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmzoo.adapters import PatchMerger
from mmzoo.encoders import (frame_segments, patch_positions, pos_interpolation, qwen3_vl_vision_weights,
                            qwen3_vl_vit)
from mmzoo.models.composition import Tower

SIDE, MERGE, OUT = 4, 2, 48
DEEPSTACK = [0, 1]
GRID = np.array([[1, 4, 6], [1, 8, 4], [2, 4, 4]])  # two images and a two-frame video, (t, h, w) patches


def _hf_model():
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = Qwen3VLVisionConfig(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                                 patch_size=4, temporal_patch_size=2, spatial_merge_size=MERGE, out_hidden_size=OUT,
                                 num_position_embeddings=SIDE * SIDE, deepstack_visual_indexes=DEEPSTACK,
                                 hidden_act="gelu_pytorch_tanh")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3VLVisionModel(config).eval()
    with torch.no_grad():  # weights far from the init's, so every term shows
        for name, p in model.named_parameters():
            if name.split(".")[-2].startswith("norm") and name.endswith(".weight"):  # LayerNorm scales near 1
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name == "pos_embed.weight":
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf():
    return _hf_model()


def _tower(hf, attention: str) -> Tower:
    c = hf.config
    encoder = qwen3_vl_vit(embed_dim=c.hidden_size, depth=c.depth, num_heads=c.num_heads,
                           intermediate_dim=c.intermediate_size, num_position_embeddings=c.num_position_embeddings,
                           deepstack_blocks=c.deepstack_visual_indexes, in_channels=c.in_channels,
                           temporal_patch_size=c.temporal_patch_size, patch_size=c.patch_size, act=c.hidden_act,
                           rope_theta=c.rope_parameters["rope_theta"], attention=attention)
    adapter = PatchMerger(context_dim=c.hidden_size, out_dim=c.out_hidden_size, merge_size=c.spatial_merge_size,
                          deepstack_taps=len(c.deepstack_visual_indexes))
    tower = Tower(encoder=encoder, adapter=adapter).eval()
    tower.load_state_dict(qwen3_vl_vision_weights(hf.state_dict()), strict=True)
    return tower


def _inputs(grid: np.ndarray, patches: torch.Tensor) -> dict[str, torch.Tensor]:
    idx, w = pos_interpolation(grid, SIDE, MERGE)
    arrays = {"patch_pos": patch_positions(grid, MERGE), "segment_ids": frame_segments(grid),
              "interp_indices": idx, "interp_weights": w}
    return {"patches": patches, **{k: torch.from_numpy(v) for k, v in arrays.items()}}


def _patches(hf, grid: np.ndarray) -> torch.Tensor:
    c = hf.config
    g = torch.Generator().manual_seed(1)
    return torch.randn(int(grid.prod(axis=1).sum()), c.in_channels * c.temporal_patch_size * c.patch_size ** 2,
                       generator=g)


def _reference(hf, grid: np.ndarray, patches: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.no_grad():
        out = hf(hidden_states=patches, grid_thw=torch.from_numpy(grid))
    return out.pooler_output, list(out.deepstack_features)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "pallas"])
def test_main_and_deepstack_features_match_transformers(hf, attention):
    grid = GRID
    patches = _patches(hf, grid)
    main, deep = _reference(hf, grid, patches)
    with torch.no_grad():
        out = _tower(hf, attention)(**_inputs(grid, patches))
    rows = int(grid.prod(axis=1).sum()) // MERGE ** 2
    assert out.shape == (rows, (1 + len(DEEPSTACK)) * OUT)
    for j, want in enumerate([main] + deep):
        got = out[:, j * OUT:(j + 1) * OUT]
        err = (got - want).abs().max().item()
        assert torch.allclose(got, want, atol=1e-5, rtol=0), f"{attention} stream {j}: max |diff| {err:.2e}"


def test_interpolation_weights_are_transformers_own():
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    idx, w = pos_interpolation(GRID, SIDE, MERGE)
    ref_idx, ref_w = get_vision_interpolation_indices_and_weights(torch.from_numpy(GRID), SIDE, mode="bilinear",
                                                                  align_corners=True, spatial_merge_size=MERGE)
    assert np.array_equal(idx, ref_idx.numpy()) and np.array_equal(w, ref_w.numpy())  # bit for bit
    assert idx.shape == (int(GRID.prod(axis=1).sum()), 4) and w.dtype == np.float32


def test_interpolation_is_exercised():
    """On the learned grid's own size the taps are the identity; on any other grid they blend, and the
    features follow a perturbed pos_embed (still matching transformers)."""
    idx, w = pos_interpolation(np.array([[1, SIDE, SIDE]]), SIDE, MERGE)
    assert set(np.unique(w)) <= {0.0, 1.0}
    pos = patch_positions(np.array([[1, SIDE, SIDE]]), MERGE)
    assert np.array_equal(idx[np.arange(len(w)), w.argmax(1)], pos[:, 0] * SIDE + pos[:, 1])
    _, w = pos_interpolation(GRID[:2], SIDE, MERGE)  # 4x6 and 8x4 patches from a 4x4 grid
    assert ((w > 0) & (w < 1)).any(axis=1).mean() > 0.5

    hf = _hf_model()
    grid = GRID[1:2]  # 8 x 4
    patches = _patches(hf, grid)
    with torch.no_grad():
        before = _tower(hf, "sdpa")(**_inputs(grid, patches))
        hf.pos_embed.weight.add_(torch.randn_like(hf.pos_embed.weight))
        tower = _tower(hf, "sdpa")
        after = tower(**_inputs(grid, patches))
    assert (after - before).abs().max() > 1e-2
    main, deep = _reference(hf, grid, patches)
    assert torch.allclose(after, torch.cat([main] + deep, dim=-1), atol=1e-5, rtol=0)


def test_weight_names_cover_the_tower(hf):
    keys = set(qwen3_vl_vision_weights(hf.state_dict()))
    assert {"encoder.pos_embed.weight", "encoder.patch_embed.proj.bias", "encoder.blocks.2.attn.q_proj.weight",
            "encoder.blocks.0.mlp.fc1.weight", "adapter.ln_q.weight", "adapter.mlp.2.bias",
            "adapter.deepstack.1.ln_q.weight", "adapter.deepstack.0.mlp.0.weight"} <= keys
    tower = _tower(hf, "eager")
    assert tower.adapter.deepstack[0].ln_q.weight.shape == (32 * MERGE ** 2,)  # normed after the merge
    assert tower.adapter.ln_q.weight.shape == (32,)  # before it


def test_inputs_and_sizes_are_checked(hf):
    tower = _tower(hf, "eager")
    inputs = _inputs(GRID[:1], _patches(hf, GRID[:1]))
    del inputs["interp_weights"]
    with pytest.raises(ValueError, match="4x4 learned position grid"):
        tower.encoder(**inputs)
    with pytest.raises(ValueError, match="num_position_embeddings=15 is not a square"):
        qwen3_vl_vit(embed_dim=32, depth=3, num_heads=2, intermediate_dim=64, num_position_embeddings=15)
    with pytest.raises(ValueError, match=r"deepstack_blocks=\[0, 3\]: 3 is not a block index \(depth=3\)"):
        qwen3_vl_vit(embed_dim=32, depth=3, num_heads=2, intermediate_dim=64, num_position_embeddings=16,
                     deepstack_blocks=[0, 3])
    with pytest.raises(ValueError, match="rows of width 32, but 3 streams"):
        tower.adapter(torch.zeros(4, 32))


def test_conf_file_builds_the_tower():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from mmzoo import config

    node = OmegaConf.load(config.CONF_DIR / "encoder" / "qwen3_vl_vit.yaml")
    assert (node.embed_dim, node.depth, node.patch_size, node.num_position_embeddings) == (1024, 24, 16, 2304)
    node = OmegaConf.merge(node, {"embed_dim": 32, "depth": 3, "num_heads": 2, "intermediate_dim": 64,
                                  "num_position_embeddings": 16, "deepstack_blocks": [0, 1], "attention": "eager"})
    encoder = instantiate(node)
    assert encoder.pos_grid == 4 and encoder.deepstack_blocks == [0, 1]
    assert encoder.patch_embed.proj.bias is not None


def test_one_xla_graph_for_every_grid_of_a_row_count(hf):
    """The grids live in the host's inputs (positions, segments, interpolation taps), not in shapes:
    three grids of 32 patches run one compiled graph on an XLA device, matching eager."""
    import torch_xla
    import torch_xla.debug.metrics as met

    device = torch_xla.device()
    eager, xla = _tower(hf, "sdpa"), _tower(hf, "sdpa").to(device)
    compiles = None
    for grid in ([[1, 4, 8]], [[1, 8, 4]], [[2, 4, 4]]):
        grid = np.array(grid)
        inputs = _inputs(grid, _patches(hf, grid))
        with torch.no_grad():
            want = eager(**inputs)
            got = xla(**{k: v.to(device) for k, v in inputs.items()}).cpu()
        assert torch.allclose(got, want, atol=1e-5, rtol=0), f"grid {grid.tolist()}: {(got - want).abs().max():.2e}"
        if compiles is None:
            compiles = met.metric_data("CompileTime")[0]
    assert met.metric_data("CompileTime")[0] == compiles
